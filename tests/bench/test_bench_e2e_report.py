"""`specfleet bench e2e`'s plan and report, on results made up here (no fleet is started)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.e2e import (
    BenchRun,
    Goal,
    RunConfig,
    RunResult,
    adaptive_modes,
    cpu_use,
    identity_check,
    level_work,
    plan,
    report,
    throughput,
)
from localfleet.prompts import BenchPrompt

ANSWERS = {"chat-01": [5, 6, 7], "math-01": [8, 9, 2]}


def plain_session(prompt_id: str, elapsed_s: float = 1.0) -> dict[str, Any]:
    tokens = ANSWERS[prompt_id]
    return {
        "prompt_id": prompt_id,
        "task": prompt_id.split("-")[0],
        "token_ids": list(tokens),
        "tokens": len(tokens),
        "rounds": len(tokens),
        "elapsed_s": elapsed_s,
        "tokens_per_s": len(tokens) / elapsed_s,
    }


def bus_session(prompt_id: str, tokens: list[int] | None = None) -> dict[str, Any]:
    token_ids = list(ANSWERS[prompt_id]) if tokens is None else tokens
    return {
        **plain_session(prompt_id),
        "token_ids": token_ids,
        "session_id": f"{prompt_id}-session",
        "rounds": 2,
        "drafted": [2, 0],
        "accepted": [1, 0],
        "wait_ms": [3.0, 4.0],
        "turnaround_ms": [0.5],
        "proactive_hits": 0,
        "proactive_misses": 0,
        "proactive_skipped": 0,
    }


def level_results(level: int, plain_s: float, fixed_s: float, adaptive_s: float) -> list[RunResult]:
    """A level's three arms, each answering both prompts in the wall time given."""
    prompts = list(ANSWERS)
    return [
        RunResult(RunConfig(level, "plain"), plain_s, [plain_session(p, plain_s) for p in prompts]),
        RunResult(RunConfig(level, "fixed", "hybrid"), fixed_s, [bus_session(p) for p in prompts]),
        RunResult(
            RunConfig(level, "adaptive"),
            adaptive_s,
            [bus_session(p) for p in prompts],
            unmatched_rounds=4,  # every round streamed by the host: no probe record
            round_modes={"plain": 3, "distributed": 1},
        ),
    ]


def test_each_level_runs_plain_serving_the_fixed_drafter_and_adaptive() -> None:
    plans = plan([1, 4], "hybrid", [], [])
    assert [[c.label for c in configs] for configs in plans] == [
        ["plain serving x1", "hybrid x1", "adaptive x1"],
        ["plain serving x4", "hybrid x4", "adaptive x4"],
    ]


def test_a_level_runs_every_prompt_and_at_least_its_waves() -> None:
    prompts = [BenchPrompt(f"chat-{i:02d}", "chat", f"prompt {i}") for i in range(10)]
    assert len(level_work(prompts, 1, 3)) == 10  # every prompt once: 10 waves of one
    assert len(level_work(prompts, 4, 3)) == 12
    work = level_work(prompts, 16, 3)
    assert len(work) == 48 and work[:10] == prompts and work[10:20] == prompts
    assert len(level_work(prompts, 32, 1)) == 32


def test_the_old_baseline_and_part_4_run_only_when_asked() -> None:
    (configs,) = plan([4], "hybrid", [4], ["hybrid", "ngram"], bus_target_only=True)
    assert [c.label for c in configs] == [
        "plain serving x4",
        "bus target-only x4",
        "hybrid x4",
        "adaptive x4",
        "hybrid no-proactive x4",
        "ngram x4",
        "ngram no-proactive x4",
    ]


@pytest.mark.parametrize(
    ("level", "adaptive_s", "verdicts"),
    [
        (1, 1.0, [(1.0, True), (1.5, True)]),  # twice plain serving's tokens/s
        (1, 1.6, [(1.0, True), (1.5, False)]),
        (4, 1.6, [(1.0, True), (1.2, True)]),
        (4, 2.5, [(1.0, False), (1.2, False)]),
        (16, 1.9, [(1.0, True)]),  # no goal above the floor at 16
    ],
)
def test_adaptive_is_judged_against_plain_serving_at_every_level(
    level: int, adaptive_s: float, verdicts: list[tuple[float, bool]]
) -> None:
    results = level_results(level, plain_s=2.0, fixed_s=4.0, adaptive_s=adaptive_s)
    (_, rows), goals = throughput(results, [level], "hybrid")
    assert [(g.goal, g.met) for g in goals] == verdicts
    assert goals[0].measured == pytest.approx(2.0 / adaptive_s)
    assert rows[0][5] == pytest.approx(0.5)  # fixed / plain


def test_every_answer_is_checked_against_plain_serving_at_the_lowest_level() -> None:
    results = level_results(4, 1.0, 1.0, 1.0) + level_results(1, 1.0, 1.0, 1.0)
    results[2].sessions[1] = bus_session("math-01", [8, 9, 3])  # adaptive x4 differs
    identity = identity_check(results)
    assert identity.reference_level == 1
    assert identity.checked == 10  # 2 prompts x 5 runs besides the reference
    assert identity.differing == ["adaptive x4:math-01"]


def test_modes_of_the_adaptive_rounds_are_listed_per_level() -> None:
    results = level_results(1, 1.0, 1.0, 1.0) + level_results(4, 1.0, 1.0, 1.0)
    results[5].round_modes = {"cloud": 2, "someday": 1}
    (headers, rows), by_level = adaptive_modes(results, [1, 4])
    assert list(headers) == ["sessions", "rounds", "distributed", "cloud", "plain", "someday"]
    assert rows == [[1, 4, 1, 0, 3, 0], [4, 3, 0, 2, 0, 1]]
    assert by_level == {"1": {"plain": 3, "distributed": 1}, "4": {"cloud": 2, "someday": 1}}


def test_the_report_holds_every_goal_even_when_no_round_could_be_matched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = level_results(1, 2.0, 1.5, 1.0) + level_results(4, 2.0, 1.8, 1.9)
    args = argparse.Namespace(
        **{"drafter": "hybrid", "k": None, "max_tokens": 3, "limit": 2, "agents": 4},
        **{"sessions": [1, 4], "arrivals": "waves", "bus_target_only": False},
        **{"stream_clients": False},
        **{"proactive_sessions": []},
        **{"proactive_drafters": [], "broker": None},
    )
    run = BenchRun(results, "mqtt://127.0.0.1:1", "sqlite://", tmp_path, 0, 1.5)
    document = json.loads(json.dumps(report(run, args)))
    out = capsys.readouterr().out
    assert "clients (in this process, on the coordinator's CPU): whole answers" in out
    assert document["settings"]["stream_clients"] is False
    assert "adaptive / plain serving: 2.00x" in out  # session tokens/s: 3.0 against 1.5
    assert "greedy answers equal to plain serving's (x1): 10/10" in out
    goals = {(g["goal"], g["target"]): g for g in document["goals"]}
    assert goals[("tokens/s x1, adaptive / plain serving", 1.5)]["met"] is True
    assert goals[("tokens/s x4, adaptive / plain serving", 1.2)]["met"] is False
    p50 = goals[("per-round overhead beyond compute, hybrid x1, ms, p50", 2.0)]
    assert p50["aim"] == 1.0 and p50["met"] is False  # no matched round: nothing to judge
    assert document["identity"]["met"] is True
    assert document["adaptive_round_modes"]["4"] == {"plain": 3, "distributed": 1}
    plain_run = document["runs"][0]
    assert plain_run["arm"] == "plain" and "ms" not in plain_run
    assert document["runs"][2]["unmatched_rounds"] == 4


def test_cpu_time_by_role_is_summed_over_waves_and_given_per_committed_token() -> None:
    """Part 7: a run's CPU seconds by role add up over its waves, and come out in ms per
    committed token, with everything but the target's summed as `beside`."""
    plain, _, adaptive = level_results(1, 1.0, 1.0, 1.0)  # 6 tokens each
    start = {"coordinator": 10.0, "verifier": 1.0, "agents": 2.0, "other": 0.5, "target": 20.0}
    after = {"coordinator": 10.03, "verifier": 1.006, "agents": 2.012, "other": 0.5, "target": 20.3}
    adaptive.add_cpu(start, after)
    adaptive.add_cpu(after, after | {"coordinator": 10.06, "target": 20.36})
    plain.add_cpu(start, start | {"target": 20.3})
    per = adaptive.cpu_ms_per_token
    assert per["coordinator"] == pytest.approx(10.0)  # 60 ms over 6 tokens
    assert per["verifier"] == pytest.approx(1.0) and per["agents"] == pytest.approx(2.0)
    assert per["other"] == 0.0 and per["target"] == pytest.approx(60.0)
    assert per["beside"] == pytest.approx(13.0)
    headers, rows = cpu_use([plain, adaptive])
    assert headers[-2:] == ("beside the target", "target")
    assert rows == [
        ["plain serving x1", "0.00", "0.00", "0.00", "0.00", "0.00", "50.00"],
        ["adaptive x1", "10.00", "1.00", "2.00", "0.00", "13.00", "60.00"],
    ]
    document = json.loads(json.dumps(adaptive.summary()))
    assert document["cpu_ms_per_token"]["beside"] == pytest.approx(13.0)


def test_a_goal_says_which_way_it_is_judged() -> None:
    assert Goal("overhead", 2.0, 1.5, at_most=True, aim=1.0).line() == (
        "overhead: 1.500 (goal <= 2.0; aiming at 1.0) met"
    )
    assert not Goal("ratio", 1.5, math.nan).met
