"""A verification that outlasts VERIFY_TIMEOUT_S is waited for while its verifier heartbeats with
work in hand (a loaded host over a wave of prefills), and sent again when the verifier is idle:
an idle verifier that has not answered never got the request."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from broker import messages as m
from broker.messages import decode
from coordinator.runtime import verifiers
from coordinator.runtime.verifiers import VerifierPool

TIMEOUT_S = 0.2


class Sent:
    """The work messages the pool published (its only way out), decoded."""

    def __init__(self) -> None:
        self.requests: list[m.VerifyRequest] = []
        self.arrived = asyncio.Event()

    async def __call__(self, topic: str, payload: bytes) -> None:
        message = decode(payload)
        assert isinstance(message, m.VerifyRequest)
        self.requests.append(message)
        self.arrived.set()


def _request() -> m.VerifyRequest:
    return m.VerifyRequest(
        request_id=uuid.uuid4().hex,
        session_id=str(uuid.uuid4()),
        round=3,
        context_ids=(1, 2, 3),
        tokens=(4, 5),
    )


def _result(request: m.VerifyRequest) -> m.VerifyResult:
    return m.VerifyResult(
        request_id=request.request_id,
        session_id=request.session_id,
        round=request.round,
        base_len=len(request.context_ids),
        n_accepted=1,
        next_token=7,
        verifier_id="v1",
    )


async def _heartbeats(
    pool: VerifierPool, in_flight: int, beat_s: float = 0.05, first_after_s: float = 0.0
) -> None:
    """A live verifier: a heartbeat every `beat_s`, with `in_flight` rows in hand."""
    await asyncio.sleep(first_after_s)
    while True:
        status = m.VerifierStatus(
            verifier_id="v1",
            state=m.DeviceState.ONLINE,
            at=1_000.0,
            max_batch=4,
            heartbeat_s=beat_s,
            in_flight=in_flight,
        )
        await pool.on_status("v1", status)
        await asyncio.sleep(beat_s)


@pytest.mark.parametrize(("in_flight", "sent_times"), [(3, 1), (0, 3)])
def test_a_busy_verifier_is_waited_for_and_an_idle_one_is_sent_the_request_again(
    monkeypatch: pytest.MonkeyPatch, in_flight: int, sent_times: int
) -> None:
    monkeypatch.setattr(verifiers, "VERIFY_TIMEOUT_S", TIMEOUT_S)

    async def scenario() -> tuple[m.VerifyResult, list[m.VerifyRequest]]:
        sent = Sent()
        pool = VerifierPool(sent)
        beating = asyncio.create_task(_heartbeats(pool, in_flight))
        try:
            await asyncio.sleep(0.06)
            verifying = asyncio.create_task(pool.verify(_request()))
            await asyncio.wait_for(sent.arrived.wait(), 5)
            # The answer comes after two and a half timeouts: to the request in flight then.
            await asyncio.sleep(2.5 * TIMEOUT_S)
            await pool.on_result("v1", _result(sent.requests[-1]))
            result = await asyncio.wait_for(verifying, 5)
        finally:
            beating.cancel()
        return result, sent.requests

    result, requests = asyncio.run(scenario())
    assert result.next_token == 7 and result.request_id == requests[-1].request_id
    assert len(requests) == sent_times


def test_a_busy_verifier_is_waited_for_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifiers, "VERIFY_TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setattr(verifiers, "BUSY_WAITS", 1)
    monkeypatch.setattr(verifiers, "MAX_ATTEMPTS", 1)

    async def scenario() -> None:
        pool = VerifierPool(Sent())
        beating = asyncio.create_task(_heartbeats(pool, 5))
        try:
            await asyncio.sleep(0.06)
            await pool.verify(_request())
        finally:
            beating.cancel()

    with pytest.raises(verifiers.VerificationFailed, match="v1 timed out"):
        asyncio.run(scenario())


def test_a_stall_of_the_coordinator_s_own_loop_is_no_silence_of_the_verifier() -> None:
    """The coordinator's loop blocked for 2 s (a starved host), longer than the 0.75 s of silence
    that makes a verifier dead: the heartbeats that waited meanwhile are read after the watch's
    next look, which must not call the verifier dead; real silence afterwards still does."""
    beat_s = 0.25

    async def scenario() -> tuple[int, int]:
        pool = VerifierPool(Sent())
        beating = asyncio.create_task(_heartbeats(pool, 0, beat_s))
        watching = asyncio.create_task(pool.watch())
        try:
            await asyncio.sleep(0.6)
            beating.cancel()
            time.sleep(2.0)  # the whole loop stalls
            beating = asyncio.create_task(_heartbeats(pool, 0, beat_s, first_after_s=0.1))
            await asyncio.sleep(0.6)
            after_stall = pool.failovers
            beating.cancel()
            await asyncio.sleep(verifiers.MISSED_HEARTBEATS * beat_s + 0.75)
            return after_stall, pool.failovers
        finally:
            beating.cancel()
            watching.cancel()

    after_stall, after_silence = asyncio.run(scenario())
    assert (after_stall, after_silence) == (0, 1)
