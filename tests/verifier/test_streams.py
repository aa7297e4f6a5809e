"""Host streams on a real worker: plain and cloud sessions run by the verifier round after round."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from test_worker import run_with_worker
from verifier_helpers import BusListener, greedy_reference, prompt_ids, target_pair

from broker.messages import (
    StreamRedraft,
    StreamSpec,
    StreamStop,
    VerifyRequest,
    VerifyResult,
    encode,
)
from broker.mosquitto import PrivateMosquitto
from verifier.streams import COPY_REACH, HostStream, HostStreams
from verifier.worker import VerifierWorker

MAX_NEW = 12


def stream_request(
    prompt: int,
    draft: str | None,
    rounds: int = 64,
    adaptive: bool = True,
    max_new: int = MAX_NEW,
    batched: bool = False,
) -> VerifyRequest:
    _, tokenizer = target_pair()
    return VerifyRequest(
        request_id=uuid.uuid4().hex,
        session_id=f"stream-{uuid.uuid4().hex[:8]}",
        round=0,
        context_ids=prompt_ids(prompt),
        tokens=(),
        cloud_draft=draft,
        cloud_k=None if draft is None else 4,
        stream=StreamSpec(
            rounds=rounds,
            max_new=max_new,
            eos_id=tokenizer.eos_id,
            adaptive=adaptive,
            batched=batched,
        ),
    )


def committed(rounds: list[VerifyResult]) -> list[int]:
    tokens: list[int] = []
    for result in rounds:
        assert result.next_token is not None and result.draft_tokens is not None
        tokens += [*result.draft_tokens[: result.n_accepted], result.next_token]
    return tokens


@pytest.mark.parametrize(("draft", "adaptive"), [(None, True), ("hybrid", True), ("hybrid", False)])
def test_a_stream_runs_to_the_end_of_the_targets_answer(
    mosquitto: PrivateMosquitto, draft: str | None, adaptive: bool
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        request = stream_request(3, draft, adaptive=adaptive)
        await listener.client.publish(worker.work_topic, encode(request))
        rounds = await listener.stream_end(request.request_id)
        assert [r.round for r in rounds] == list(range(len(rounds)))
        assert committed(rounds)[:MAX_NEW] == list(greedy_reference(3, MAX_NEW))
        assert [r.stream_ends for r in rounds] == [False] * (len(rounds) - 1) + [True]
        assert all(not r.error and r.pass_choice is not None for r in rounds)
        if draft is None:  # plain: one token a round, nothing drafted
            assert len(rounds) == MAX_NEW
            assert all(r.draft_tokens == () and r.pass_choice.k == 0 for r in rounds)  # type: ignore[union-attr]
        if not adaptive:  # a fixed window is drafted every round it fits
            assert all(r.pass_choice.k == min(4, MAX_NEW - 1 - n) for r, n in _generated(rounds))  # type: ignore[union-attr]
            # The heartbeat reports what its windows cost a token and its passes' cost model:
            # the coordinator's policy prices cloud rounds with them.
            status = await listener.status(lambda s: draft in s.draft_ms)
            assert 0 < status.draft_ms[draft] < 50
            assert status.pass_cost is not None and sum(status.pass_cost) > 0
        assert len(worker.streams) == 0

    run_with_worker(mosquitto, body)


def _generated(rounds: list[VerifyResult]) -> list[tuple[VerifyResult, int]]:
    out, n = [], 0
    for result in rounds:
        out.append((result, n))
        n += result.n_accepted + 1
    return out


def test_streams_share_passes_and_a_stop_ends_one(mosquitto: PrivateMosquitto) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        kept = stream_request(1, None)
        stopped = stream_request(2, None, rounds=200, max_new=200)
        for request in (kept, stopped):
            await listener.client.publish(worker.work_topic, encode(request))
        rounds = await listener.stream_end(kept.request_id)
        # Both ran in the same passes: rows of two.
        assert any(r.batch_size == 2 for r in rounds)
        stop = StreamStop(request_id=stopped.request_id, session_id=stopped.session_id)
        await listener.client.publish(worker.work_topic, encode(stop))
        for _ in range(100):
            if not worker.streams:
                break
            await asyncio.sleep(0.05)
        assert len(worker.streams) == 0
        await asyncio.sleep(0.5)  # the pass under way at the stop may still report its round
        seen = len(listener.streamed.get(stopped.request_id, []))
        assert seen < 200
        await asyncio.sleep(0.5)  # but no round of it runs after
        assert len(listener.streamed.get(stopped.request_id, [])) == seen

    run_with_worker(mosquitto, body)


def test_batched_streams_rounds_of_a_pass_come_in_one_message(
    mosquitto: PrivateMosquitto,
) -> None:
    """Streams opened `batched` get each pass's rounds in one VerifyResults, in the same
    rounds and tokens as alone; a stream that is not batched beside them gets its own."""

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        together = [stream_request(p, None, batched=True) for p in (1, 2, 3)]
        alone = stream_request(4, None)
        for request in (*together, alone):
            await listener.client.publish(worker.work_topic, encode(request))
        for request, prompt in zip((*together, alone), (1, 2, 3, 4), strict=True):
            rounds = await listener.stream_end(request.request_id)
            assert [r.round for r in rounds] == list(range(MAX_NEW))
            assert committed(rounds) == list(greedy_reference(prompt, MAX_NEW))
        # A pass of the three batched streams: one message of three (the first passes may
        # have held fewer of them, as the sessions' prefills came).
        assert listener.envelopes and max(listener.envelopes) == 3
        assert sum(listener.envelopes) <= 3 * MAX_NEW
        assert listener.deliveries[alone.request_id] == MAX_NEW

    run_with_worker(mosquitto, body)


def test_a_device_drafted_round_of_a_streamed_session_ends_its_stream(
    mosquitto: PrivateMosquitto,
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        request = stream_request(0, None, rounds=200, max_new=200)
        await listener.client.publish(worker.work_topic, encode(request))
        while not listener.streamed.get(request.request_id):
            await asyncio.sleep(0.01)
        reference = greedy_reference(0, MAX_NEW)
        device = VerifyRequest(
            request_id=uuid.uuid4().hex,
            session_id=request.session_id,
            round=1,
            context_ids=prompt_ids(0) + reference[:1],
            tokens=reference[1:3],
        )
        await listener.client.publish(worker.work_topic, encode(device))
        result = await listener.result(device.request_id)
        assert (result.n_accepted, result.next_token) == (2, reference[3])
        assert len(worker.streams) == 0

    run_with_worker(mosquitto, body)


def test_plain_rounds_run_on_in_the_inference_process_as_pass_by_pass(
    mosquitto: PrivateMosquitto,
) -> None:
    """Plain stream rounds that the child runs on by itself (`Steps`) are the rounds the worker
    would send it pass by pass: the same tokens, rounds and verdicts, each round reported."""
    seen: dict[int, list[tuple[int, int, int | None, bool]]] = {}
    reasons: dict[int, list[str]] = {}

    for steps in (1, 4):

        async def body(worker: VerifierWorker, listener: BusListener, steps: int = steps) -> None:
            requests = [stream_request(p, None, max_new=20) for p in (5, 6)]
            for request in requests:
                await listener.client.publish(worker.work_topic, encode(request))
            rounds = [await listener.stream_end(r.request_id) for r in requests]
            seen[steps] = [
                (r.round, r.base_len, r.next_token, r.stream_ends) for run in rounds for r in run
            ]
            reasons[steps] = [r.pass_choice.reason for run in rounds for r in run if r.pass_choice]
            for prompt, run in zip((5, 6), rounds, strict=True):
                assert committed(run) == list(greedy_reference(prompt, 20))
            assert len(worker.streams) == 0

        run_with_worker(mosquitto, body, steps_per_call=steps)
    assert seen[4] == seen[1] and len(seen[1]) == 40
    assert not any("run on in the inference process" in r for r in reasons[1])
    assert any("run on in the inference process" in r for r in reasons[4])
    # The worker chose plain again while each call's last pass ran: the call went on (`Extend`).
    assert any("pass 9 run on" in r for r in reasons[4])


@pytest.mark.parametrize("adaptive", [False, True])
def test_drafted_rounds_run_on_in_the_inference_process_as_pass_by_pass(
    mosquitto: PrivateMosquitto, adaptive: bool
) -> None:
    """Rounds drafted on the host run on in the child too, each at the call's window cut to
    what the answer has left: a fixed window's rounds are those of pass-by-pass running (the
    same drafts, verdicts and ends), and either way the answer is the target's own."""
    seen: dict[int, list[tuple[int, int, tuple[int, ...] | None, int, int | None, bool]]] = {}
    reasons: dict[int, list[str]] = {}
    run_on: dict[int, int] = {}

    for steps in (1, 4):

        async def body(worker: VerifierWorker, listener: BusListener, steps: int = steps) -> None:
            requests = [stream_request(p, "hybrid", max_new=20, adaptive=adaptive) for p in (5, 6)]
            for request in requests:
                await listener.client.publish(worker.work_topic, encode(request))
            rounds = [await listener.stream_end(r.request_id) for r in requests]
            seen[steps] = [
                (r.round, r.base_len, r.draft_tokens, r.n_accepted, r.next_token, r.stream_ends)
                for run in rounds
                for r in run
            ]
            reasons[steps] = [r.pass_choice.reason for run in rounds for r in run if r.pass_choice]
            for prompt, run in zip((5, 6), rounds, strict=True):
                assert committed(run) == list(greedy_reference(prompt, 20))
                # No window reached past the answer's 20 tokens.
                assert all(
                    r.base_len + len(r.draft_tokens or ()) < len(prompt_ids(prompt)) + 20
                    for r in run
                )
            assert len(worker.streams) == 0
            # A pass the child ran on by itself has no pipe: its round trip is its compute.
            run_on[steps] = sum(
                t.roundtrip_ms == t.compute_ms for t in worker.counters.timings if t.size == 2
            )

        run_with_worker(mosquitto, body, steps_per_call=steps)
    assert run_on[1] == 0 and run_on[4] > 0
    if adaptive:
        assert any("run on in the inference process" in r for r in reasons[4])
    else:
        assert seen[4] == seen[1]
        assert any(r[2] for r in seen[4])  # windows were drafted


def test_a_pass_that_opens_a_session_leaves_the_streams_that_ran_the_last_to_the_next() -> None:
    """A stream's first round prefills its prompt in a forward of its own: a pass of streams
    that opens one leaves those that ran the pass before to the next pass, once in a row, where
    they join the opened session's rows (plain serving prefills, then decodes every session
    together). A pass with a device-drafted round keeps them: that forward runs anyway."""
    streams = HostStreams()
    under_way = HostStream.open(stream_request(1, None), 0.0)
    streams.open(under_way)
    assert under_way.first_round and streams.turn(16, 1, ()) == [under_way]
    under_way.advance((), 0, 7)
    opened = HostStream.open(stream_request(2, None), 0.0)
    streams.open(opened)
    assert streams.turn(16, 2, ()) == [opened]
    opened.advance((), 0, 7)
    # Another opens at once: the stream that sat out runs now; the one that ran sits out.
    third = HostStream.open(stream_request(3, None), 0.0)
    streams.open(third)
    assert streams.turn(16, 3, ()) == [third, under_way]
    third.advance((), 0, 7)
    assert streams.turn(16, 4, ()) == [opened, under_way, third]
    # Beside a device's round (its session busy) nobody sits out.
    fourth = HostStream.open(stream_request(4, None), 0.0)
    streams.open(fourth)
    turn = streams.turn(16, 5, ("device-session",))
    assert sorted(s.session_id for s in turn) == sorted(
        s.session_id for s in (opened, under_way, third, fourth)
    )


def test_a_stream_under_way_joins_the_pass_after_a_new_sessions_prefill(
    mosquitto: PrivateMosquitto,
) -> None:
    """On a real worker: the pass that prefills a second session holds its round alone, the
    first stream's rounds go on contiguously from the pass after, and both answers are the
    target's."""

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        under_way = stream_request(1, None, max_new=24)
        await listener.client.publish(worker.work_topic, encode(under_way))
        while len(listener.streamed.get(under_way.request_id, [])) < 2:
            await asyncio.sleep(0.005)
        opened = stream_request(2, None)
        await listener.client.publish(worker.work_topic, encode(opened))
        second = await listener.stream_end(opened.request_id)
        first = await listener.stream_end(under_way.request_id)
        assert second[0].pass_choice is not None and second[0].pass_choice.rows == 1
        assert any(r.pass_choice is not None and r.pass_choice.rows == 2 for r in first)
        assert [r.round for r in first] == list(range(len(first)))
        assert committed(first) == list(greedy_reference(1, 24))
        assert committed(second) == list(greedy_reference(2, MAX_NEW))

    run_with_worker(mosquitto, body)


@pytest.mark.parametrize(
    ("first", "then"), [(None, "lookup"), ("hybrid", None), ("hybrid", "lookup")]
)
def test_a_redraft_changes_a_running_streams_drafter_in_place(
    mosquitto: PrivateMosquitto, first: str | None, then: str | None
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        assert (await listener.status(lambda s: s.redraft)).redraft
        request = stream_request(3, first, max_new=40, adaptive=False)
        await listener.client.publish(worker.work_topic, encode(request))
        while len(listener.streamed.get(request.request_id, [])) < 3:
            await asyncio.sleep(0.005)
        redraft = StreamRedraft(
            request_id=request.request_id,
            session_id=request.session_id,
            cloud_draft=then,
            cloud_k=None if then is None else 2,
        )
        await listener.client.publish(worker.work_topic, encode(redraft))
        rounds = await listener.stream_end(request.request_id)
        # One stream, every round once, in order: nothing run again, nothing skipped.
        assert [r.round for r in rounds] == list(range(len(rounds)))
        assert committed(rounds)[:40] == list(greedy_reference(3, 40))
        # Each round names the stream's drafter for it: the first, then the new one from a pass
        # after the redraft came, never the first again.
        drafts = [r.stream_draft for r in rounds]
        switched = drafts.index(then)
        assert switched >= 3 and set(drafts[:switched]) == {first}
        assert set(drafts[switched:]) == {then}, drafts
        # Its windows are the new drafter's: none for plain decoding, else the new cap of 2 (a
        # fixed window; the lookup may propose fewer tokens than it allows).
        windows = [r.pass_choice.k for r in rounds[switched:]]  # type: ignore[union-attr]
        if then is None:
            assert set(windows) == {0} and all(not r.draft_tokens for r in rounds[switched:])
        else:
            assert max(windows) == 2 and windows.count(2) >= len(windows) - 2, windows
        assert len(worker.streams) == 0

    run_with_worker(mosquitto, body)


def test_a_redraft_for_a_stream_that_ended_changes_nothing() -> None:
    streams = HostStreams()
    request = stream_request(1, "hybrid")
    stream = HostStream.open(request, 0.0)
    streams.open(stream)
    other = StreamRedraft(
        request_id=uuid.uuid4().hex, session_id=request.session_id, cloud_draft=None
    )
    assert streams.redraft(other) is None  # another request's stream (a stale message)
    redraft = StreamRedraft(
        request_id=request.request_id, session_id=request.session_id, cloud_draft=None
    )
    assert streams.redraft(redraft) is stream
    assert stream.draft == "hybrid"  # until its next turn: a pass in flight keeps its drafter
    assert streams.turn(4, 1, ()) == [stream]
    assert (stream.draft, stream.cap, stream.row().draft) == (None, 0, None)
    streams.stop(request.session_id)
    assert streams.redraft(redraft) is None


def test_an_adaptive_streams_drafted_round_may_copy_as_far_as_a_devices_hybrid() -> None:
    """`cloud_reach`: an adaptive stream's drafted round may copy a long match up to the
    hybrid's own window (COPY_REACH), cut to what its answer has left; a plain round, or a
    fixed window's, reaches no further than its window."""
    stream = HostStream.open(stream_request(1, "hybrid", max_new=40), 0.0)
    assert (stream.request(1).cloud_k, stream.request(1).cloud_reach) == (1, COPY_REACH)
    assert stream.request(0).cloud_reach is None and stream.request(0).cloud_k is None
    stream.generated = 36  # 4 tokens left: 3 drafted at most, and the target's own
    assert (stream.request(1).cloud_k, stream.request(1).cloud_reach) == (1, 3)
    stream.generated = 38
    assert (stream.request(1).cloud_k, stream.request(1).cloud_reach) == (1, None)
    fixed = HostStream.open(stream_request(1, "hybrid", max_new=40, adaptive=False), 0.0)
    assert fixed.request(0).cloud_k == 4 and fixed.request(0).cloud_reach is None
