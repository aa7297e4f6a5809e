"""A verifier that leaves in order (it says offline itself, with nothing in flight) ends a normal
shutdown without a warning; one whose Will speaks for it, or that leaves work behind, is a
fail-over: a warning, and its requests go to another verifier."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from broker import messages as m
from broker.topics import VerifierChannel, verifier_topic
from coordinator.runtime.verifiers import VerifierPool

CONNECTED_AT = 1_000.0  # when the verifier connected: its Will carries this time
HEARTBEAT_AT = 1_010.0


def status(verifier_id: str, state: m.DeviceState, at: float) -> m.VerifierStatus:
    return m.VerifierStatus(verifier_id=verifier_id, state=state, at=at, max_batch=4)


def request() -> m.VerifyRequest:
    return m.VerifyRequest(
        request_id=uuid.uuid4().hex,
        session_id=str(uuid.uuid4()),
        round=0,
        context_ids=(1, 2, 3),
        tokens=(4, 5),
    )


class Sent:
    """What the pool published, by topic (the pool's only way out)."""

    def __init__(self) -> None:
        self.topics: list[str] = []
        self.arrived = asyncio.Event()

    async def __call__(self, topic: str, payload: bytes) -> None:
        self.topics.append(topic)
        self.arrived.set()


async def _online(pool: VerifierPool, *verifier_ids: str) -> None:
    for verifier_id in verifier_ids:
        await pool.on_status(verifier_id, status(verifier_id, m.DeviceState.ONLINE, CONNECTED_AT))
        await pool.on_status(verifier_id, status(verifier_id, m.DeviceState.ONLINE, HEARTBEAT_AT))


@pytest.mark.parametrize(
    ("offline_at", "level", "words"),
    [
        (HEARTBEAT_AT + 1, logging.INFO, "verifier v1 left; moving 0 requests"),  # its goodbye
        (CONNECTED_AT, logging.WARNING, "verifier v1 went offline; moving 0 requests"),  # Will
    ],
)
def test_an_idle_verifier_that_says_goodbye_is_no_warning(
    offline_at: float, level: int, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        pool = VerifierPool(Sent())
        await _online(pool, "v1")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="coordinator.runtime.verifiers"):
            await pool.on_status("v1", status("v1", m.DeviceState.OFFLINE, offline_at))
        assert not pool.is_alive("v1")
        assert pool.failovers == 1

    asyncio.run(scenario())
    (record,) = [r for r in caplog.records if "v1" in r.getMessage()]
    assert record.levelno == level
    assert words in record.getMessage()


def test_a_goodbye_with_a_request_in_flight_warns_and_resends_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> list[str]:
        sent = Sent()
        pool = VerifierPool(sent)
        await _online(pool, "v1")
        verifying = asyncio.create_task(pool.verify(request()))
        await asyncio.wait_for(sent.arrived.wait(), 5)
        await _online(pool, "v2")
        sent.arrived.clear()
        with caplog.at_level(logging.INFO, logger="coordinator.runtime.verifiers"):
            await pool.on_status("v1", status("v1", m.DeviceState.OFFLINE, HEARTBEAT_AT + 1))
        await asyncio.wait_for(sent.arrived.wait(), 5)
        verifying.cancel()
        return sent.topics

    topics = asyncio.run(scenario())
    assert topics == [
        verifier_topic("v1", VerifierChannel.WORK),
        verifier_topic("v2", VerifierChannel.WORK),
    ]
    (record,) = [r for r in caplog.records if "verifier v1" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "verifier v1 left; moving 1 requests, 0 streams" in record.getMessage()
