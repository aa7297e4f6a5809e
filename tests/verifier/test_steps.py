"""The inference process running plain stream rounds on by itself (`verifier.child.run_steps`),
on the real target: each row's next round is its context grown by the token just decided, up to
its limit or its end token, and anything the worker sends down the pipe stops the run."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from pathlib import Path

from verifier_helpers import greedy_reference, make_request, prompt_ids

from broker.messages import VerifyRequest
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer
from verifier.child import (
    ChildConfig,
    Extend,
    InferenceChild,
    Interrupt,
    PassTrace,
    Steps,
    run_steps,
    timed_pass,
)
from verifier.core import VerifierCore

Target = tuple[OnnxRuntime, ChatTokenizer]


def plain_rounds(prompts: tuple[int, ...], tag: str) -> list[VerifyRequest]:
    return [make_request(f"{tag}-{p}", 0, prompt_ids(p), ()) for p in prompts]


def test_each_row_runs_to_its_limit_with_the_targets_own_tokens(target: Target) -> None:
    runtime, _ = target
    core = VerifierCore(runtime)
    requests = plain_rounds((2, 4, 7), "limits")
    plan = Steps(requests, (1, 3, 5), (None, None, None))
    first = core.verify_batch(requests)
    ours, _theirs = multiprocessing.Pipe()
    steps = list(run_steps(core, runtime, plan, first, ours))
    assert [step.rows for step in steps] == [(1, 2), (1, 2), (2,), (2,)]
    for row, prompt in ((1, 4), (2, 7)):
        ran = [
            v
            for step in steps
            for r, v in zip(step.rows, step.verifications, strict=True)
            if r == row
        ]
        tokens = [first[row].next_token] + [v.next_token for v in ran]
        assert tokens == list(greedy_reference(prompt, plan.limits[row]))
        assert [v.round for v in ran] == list(range(1, plan.limits[row]))
    assert all(step.compute_ms > 0 for step in steps)


def test_a_row_stops_at_its_end_token(target: Target) -> None:
    runtime, _ = target
    core = VerifierCore(runtime)
    requests = plain_rounds((3, 8), "eos")
    reference = greedy_reference(3, 4)
    # Row 0's second token taken for its end token: it stops after it, row 1 goes on.
    plan = Steps(requests, (4, 4), (reference[1], None))
    first = core.verify_batch(requests)
    ours, _theirs = multiprocessing.Pipe()
    steps = list(run_steps(core, runtime, plan, first, ours))
    assert [step.rows for step in steps] == [(0, 1), (1,), (1,)]
    assert steps[0].verifications[0].next_token == reference[1]


def test_anything_down_the_pipe_stops_the_run_and_is_left_for_the_next_receive(
    target: Target,
) -> None:
    runtime, _ = target
    core = VerifierCore(runtime)
    requests = plain_rounds((1,), "interrupt")
    plan = Steps(requests, (8,), (None,))
    first = core.verify_batch(requests)
    ours, theirs = multiprocessing.Pipe()
    theirs.send(Interrupt())
    assert list(run_steps(core, runtime, plan, first, ours)) == []
    assert isinstance(ours.recv(), Interrupt)


def test_an_extend_lets_the_rows_run_on_and_anything_else_ends_the_run_held_for_the_loop(
    target: Target,
) -> None:
    runtime, _ = target
    core = VerifierCore(runtime)
    requests = plain_rounds((1, 2), "extend")
    plan = Steps(requests, (2, 2), (None, None))
    first = core.verify_batch(requests)
    ours, theirs = multiprocessing.Pipe()
    held: list[object] = []
    theirs.send(Extend(2))
    steps = list(run_steps(core, runtime, plan, first, ours, None, held))
    assert [step.rows for step in steps] == [(0, 1)] * 3  # 2 rounds a row, and 2 more
    assert held == []
    for row, prompt in ((0, 1), (1, 2)):
        tokens = [first[row].next_token] + [step.verifications[row].next_token for step in steps]
        assert tokens == list(greedy_reference(prompt, 4))
    theirs.send(Extend(2))
    theirs.send(Interrupt())
    more = plain_rounds((3,), "extend-then-stop")
    again = core.verify_batch(more)
    assert list(run_steps(core, runtime, Steps(more, (3,), (None,)), again, ours, None, held)) == []
    assert held == [Interrupt()] and not ours.poll()


def test_the_pass_trace_has_a_line_per_pass_with_its_rows(target: Target, tmp_path: Path) -> None:
    runtime, _ = target
    core = VerifierCore(runtime)
    requests = plain_rounds((1, 3), "trace")
    trace = PassTrace(tmp_path / "passes.jsonl")
    first, _, _ = timed_pass(core, runtime, requests, trace)
    ours, _theirs = multiprocessing.Pipe()
    steps = list(
        run_steps(core, runtime, Steps(requests, (3, 3), (None, None)), first, ours, trace)
    )
    lines = [json.loads(line) for line in (tmp_path / "passes.jsonl").read_text().splitlines()]
    assert len(lines) == 1 + len(steps) == 3
    opening, *ran = lines
    # The first pass prefilled both prompts (their rounds 0); the run-on passes are steps.
    assert (opening["rows"], opening["prefills"], opening["steps"]) == (2, 2, False)
    assert opening["prefilled"] == sum(len(prompt_ids(p)) - 1 for p in (1, 3))
    assert opening["rows_of"] == [f"{r.session_id[:8]}:0" for r in requests]
    for number, line in enumerate(ran, start=1):
        assert (line["rows"], line["prefills"], line["positions"], line["steps"]) == (2, 0, 1, True)
        assert [row.split(":")[1] for row in line["rows_of"]] == [str(number)] * 2
        assert line["ms"] > 0 and line["t"] > opening["t"]
        assert line["stack_ms"] >= 0 and line["faults"] >= 0


def test_a_row_whose_answer_ends_in_the_run_has_its_cache_dropped_there(target: Target) -> None:
    runtime, _ = target
    core = VerifierCore(runtime)
    requests = plain_rounds((2, 4, 7), "ends")
    reference = greedy_reference(2, 4)
    # Row 0 ends at its end token, row 1 at its answer's length, row 2 at this call's limit
    # only: its session goes on in the next call, and keeps its cache.
    plan = Steps(requests, (4, 2, 2), (reference[1], None, None), left=(48, 2, 48))
    first = core.verify_batch(requests)
    ours, _theirs = multiprocessing.Pipe()
    steps = list(run_steps(core, runtime, plan, first, ours))
    assert [step.rows for step in steps] == [(0, 1, 2)]
    assert [core.cached_tokens(r.session_id) is None for r in requests] == [True, True, False]


def test_a_forgotten_session_leaves_the_inference_process_with_its_next_batch() -> None:
    async def scenario() -> tuple[int, int]:
        child = InferenceChild(ChildConfig(cloud_drafts=False, profile=False))
        await child.start()
        try:
            both = plain_rounds((1, 3), "forget")
            before = await child.verify(both, timeout_s=120)
            child.forget(both[0].session_id)
            again = make_request(both[1].session_id, 1, (*prompt_ids(3), 1), ())
            after = await child.verify([again], timeout_s=120)
            return before.stats.sessions_cached, after.stats.sessions_cached
        finally:
            child.stop()

    assert asyncio.run(scenario()) == (2, 1)
