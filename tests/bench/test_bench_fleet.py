"""`specfleet bench fleet`: the replay verifier's table, the agents' drafts, the round checks,
the refusals, and a small real run (a private Mosquitto, the coordinator in its own process,
agent swarms and a replay verifier) that must lose and duplicate nothing."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import fleet
from bench.recorded import (
    DEFAULT_ANSWERS,
    RecordedAnswer,
    RecordingError,
    ReplayTarget,
    draft_along,
    load_answers,
)
from core.errors import CommandError
from specfleet import cli

ANSWER = RecordedAnswer(prompt_ids=(1, 5, 9), answer_ids=(11, 12, 13, 14, 2))


@pytest.mark.parametrize(
    ("context", "draft", "n_accepted", "next_token"),
    [
        ((1, 5, 9), (11, 12, 13), 3, 14),  # the whole draft matches
        ((1, 5, 9), (11, 99, 13), 1, 12),  # an early mismatch
        ((1, 5, 9, 11), (), 0, 12),  # an empty draft: the next token alone
        ((1, 5, 9, 11, 12), (13, 14, 2, 7), 2, 2),  # never past the recording: EOS stays next
        ((1, 5, 9, 11, 12, 13, 14), (2,), 0, 2),
    ],
)
def test_the_replay_target_answers_like_greedy_verification(
    context: tuple[int, ...], draft: tuple[int, ...], n_accepted: int, next_token: int
) -> None:
    replayed = ReplayTarget([ANSWER]).verify(context, draft)
    assert (replayed.n_accepted, replayed.next_token) == (n_accepted, next_token)


@pytest.mark.parametrize("context", [(1, 5), (1, 5, 9, 12), (1, 5, 9, 11, 12, 13, 14, 2)])
def test_contexts_the_recording_does_not_continue_are_refused(context: tuple[int, ...]) -> None:
    with pytest.raises(RecordingError):
        ReplayTarget([ANSWER]).verify(context, (11,))


@pytest.mark.parametrize(("alpha", "expected"), [(1.0, (12, 13, 14)), (0.0, (13,))])
def test_drafts_follow_the_recording_with_probability_alpha(
    alpha: float, expected: tuple[int, ...]
) -> None:
    # After one answer token: at most 3 more may be drafted (one must stay for next_token).
    assert draft_along(ANSWER, 1, 8, alpha, random.Random(0)) == expected


def test_the_shipped_recording_loads_and_replays_itself() -> None:
    answers = load_answers(DEFAULT_ANSWERS)
    assert len(answers) == 64
    target = ReplayTarget(answers)
    for answer in answers[:8]:
        replayed = target.verify(answer.prompt_ids, answer.answer_ids[:4])
        assert (replayed.n_accepted, replayed.next_token) == (4, answer.answer_ids[4])


def test_rounds_are_checked_against_the_database() -> None:
    sessions = [
        {"session_id": "a", "rounds": [0, 1, 2]},  # all stored
        {"session_id": "b", "rounds": [0, 1]},  # round 1 lost; round 2 stored, never seen
        {"session_id": "c", "rounds": [0]},  # round 1 stored twice, its verdict never seen
    ]
    stored = fleet.StoredRounds({"a": [0, 1, 2], "b": [0, 2], "c": [0, 1, 1]}, 8)
    assert fleet.check_rounds(sessions, stored) == {
        "lost": 1, "duplicated": 1, "gaps": 1, "unconfirmed": 2,
    }  # fmt: skip


def test_a_round_splits_into_its_legs() -> None:
    """A 20 ms round whose verifier computed 0.5 ms: uplink 3 and hops 4 (stored by the
    answerer), downlink 2.5 of which 1 in the swarm's queue (seen by the agent), and the
    answerer's own 10 is the rest; a round stored without legs still has its overhead."""
    sessions = [{
        "session_id": "a", "rounds": [0, 1], "latencies_ms": [20.0, 8.0],
        "downlink_ms": [2.5, 2.0], "agent_wait_ms": [1.0, 0.5],
    }]  # fmt: skip
    stored = fleet.StoredRounds(
        {"a": [0, 1]}, 2,
        {("a", 0): fleet.StoredLegs(3.0, 4.0, 0.5), ("a", 1): fleet.StoredLegs(None, None, None)},
    )  # fmt: skip
    legs = fleet.round_legs(sessions, stored)
    assert legs["overhead"] == [19.5, 8.0]
    assert (legs["overhead_first"], legs["overhead_later"]) == ([19.5], [8.0])
    assert (legs["uplink"], legs["verifier_hops"], legs["answerer"]) == ([3.0], [4.0], [10.0])
    assert (legs["downlink"], legs["agent_wait"]) == ([2.5, 2.0], [1.0, 0.5])


def test_cpu_is_shared_out_by_role_and_the_rest_of_the_host() -> None:
    """Two snapshots 2 s apart: the roles' CPU seconds over the wall time are cores, and what
    the host was busy beyond them is the rest (PostgreSQL, the bench); a process gone by the
    second snapshot (a SIGKILLed coordinator) counts for nothing."""
    before = ({"coordinators": {1: 10.0, 2: 5.0}, "broker": {3: 1.0}}, (100.0, 400.0))
    after = ({"coordinators": {1: 11.0}, "broker": {3: 1.5}}, (103.0, 404.0))
    cores = fleet.cpu_used(before, after, 2.0)
    assert cores == {
        "coordinators": 0.5, "broker": 0.25, "rest_of_host": 0.75, "host_busy": 1.5,
        "host_cores": 2,
    }  # fmt: skip
    # A saturated host, its clock read a moment apart from the wall clock: never above its cores.
    saturated = fleet.cpu_used(before, (after[0], (104.0, 404.0)), 1.99)
    assert (saturated["host_busy"], saturated["host_cores"]) == (2.0, 2)
    # Every tick busy: exactly all the cores, not a rounding above them.
    full = fleet.cpu_used(before, (after[0], (100.0 + 0.2, 400.0 + 0.2)), 0.1)
    assert (full["host_busy"], full["host_cores"]) == (2.0, 2)


def test_a_rerun_with_the_same_seed_gets_new_session_ids() -> None:
    """Session ids are the database's keys: the same seed twice drafts alike, in new sessions
    (the same ids were refused as another run's sessions)."""
    first, second = (fleet.make_plans(_args(agents=6, sessions=3, seed=7), DEFAULT_ANSWERS, 64)
                     for _ in range(2))  # fmt: skip
    sessions = [[s for plan in plans for s in plan.sessions] for plans in (first, second)]
    assert [(s.answer_index, s.seed) for s in sessions[0]] == [
        (s.answer_index, s.seed) for s in sessions[1]
    ]
    assert not {s.session_id for s in sessions[0]} & {s.session_id for s in sessions[1]}


def _args(**overrides: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"coordinators": 2}, "share a fleet through PostgreSQL advisory locks"),
        ({"coordinators": 0}, "--coordinators must be in 1..8"),
        ({"kill_coordinator_after": 5.0}, "--kill-coordinator-after needs --coordinators 2+"),
        ({"agents": 10, "sessions": 11}, "--sessions must be in 1..--agents"),
        ({"agents": 0}, "--agents must be in 1..20000"),
        ({"alpha": 1.5}, "--alpha must be in [0, 1]"),
        ({"processes": 0}, "--processes must be in 1..32"),
        ({"round_interval_ms": -1.0}, "--round-interval-ms must be in 0..60000"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(overrides: dict[str, Any], reason: str) -> None:
    with pytest.raises(CommandError, match=reason.replace("[", r"\[").replace(".", r"\.")):
        fleet.check_arguments(_args(**overrides))


def test_sessions_are_dealt_to_swarms_one_per_agent() -> None:
    plans = fleet.make_plans(_args(agents=10, sessions=4, processes=3), DEFAULT_ANSWERS, 64)
    devices = [d for plan in plans for d in plan.device_ids]
    assert len(devices) == len(set(devices)) == 10
    sessions = [s for plan in plans for s in plan.sessions]
    assert len({s.device_id for s in sessions}) == 4
    for plan in plans:
        assert {s.device_id for s in plan.sessions} <= set(plan.device_ids)


@pytest.mark.parametrize("via_coordinator", [False, True], ids=["direct", "via-coordinator"])
def test_a_small_fleet_runs_with_nothing_lost_or_duplicated(
    tmp_path: Path,
    create_pg_database: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
    via_coordinator: bool,
) -> None:
    """Direct: every round is leased to the replay verifier, which persists it and answers the
    agent; via the coordinator: the verifier takes no lease and answers the coordinator."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("bench.commands",))
    out = tmp_path / "fleet.json"
    path = ["--via-coordinator"] if via_coordinator else []
    status = cli.main([
        "bench", "fleet", "--agents", "24", "--sessions", "8", "--processes", "2",
        "--max-tokens", "24", "--database-url", create_pg_database(), "--json", str(out), *path,
    ])  # fmt: skip
    document = json.loads(out.read_text())
    assert status == 0, document
    assert document["agents_connected"] == 24
    assert document["sessions_finished"] == 8
    assert document["errors"] == 0
    assert document["rounds"] == document["rounds_stored"] > 8
    assert (document["rounds_lost"], document["rounds_duplicated"]) == (0, 0)
    assert document["sessions_with_gaps"] == 0
    by_round = document["overhead_by_round_ms"]
    assert by_round["first"]["n"] == 8
    assert by_round["first"]["n"] + by_round["later"]["n"] == document["rounds"]
    assert document["coordinator_rss_mb_max"] > 0
    answers = document["verifier_answers"]
    assert answers["answered"] == document["rounds"]
    assert answers["direct"] == (0 if via_coordinator else document["rounds"])
    assert document["rounds_path"] == ("via_coordinator" if via_coordinator else "direct")
    cpu = document["cpu_cores"]
    assert cpu["host_cores"] >= 1 and 0 < cpu["host_busy"] <= cpu["host_cores"]
    assert cpu["coordinators"] > 0 and cpu["agent_swarms"] > 0
    # The broker's CPU is read in clock ticks (10 ms) over a run of half a second: it may use
    # less than one tick here, so it is only required to be read.
    assert cpu["broker"] >= 0


@pytest.mark.parametrize("via_coordinator", [False, True], ids=["direct", "via-coordinator"])
def test_two_coordinators_share_the_fleet_and_survive_one_sigkill(
    tmp_path: Path,
    create_pg_database: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
    via_coordinator: bool,
) -> None:
    """One of two sharing coordinators is SIGKILLed 1.5 s into the sessions: the other takes its
    shards, and every session finishes with its rounds contiguous in the database. Via the
    coordinator the survivor answers the dead one's rounds; direct, the verifier holding the
    leases goes on answering them."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("bench.commands",))
    out = tmp_path / "fleet.json"
    status = cli.main([
        "bench", "fleet", "--agents", "40", "--sessions", "30", "--processes", "1",
        "--max-tokens", "200", "--alpha", "0.5", "--coordinators", "2",
        "--kill-coordinator-after", "1.5", "--database-url", create_pg_database(),
        "--json", str(out), *(["--via-coordinator"] if via_coordinator else []),
    ])  # fmt: skip
    document = json.loads(out.read_text())
    assert status == 0, document
    assert document["coordinator_killed_at_s"] == 1.5
    assert document["sessions_finished"] == 30
    assert document["errors"] == 0
    assert (document["rounds_lost"], document["rounds_duplicated"]) == (0, 0)
    assert document["sessions_with_gaps"] == 0
    assert document["rounds_stored"] == document["rounds"] + document["rounds_unconfirmed"]
