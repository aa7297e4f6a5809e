"""Supervised draft children: restarts with backoff, quarantine, and drafting through a loss."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_peer import BusPeer, TargetJudge, prompt_text, reference, running_agent

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from device_agent import draft_supervisor
from device_agent.draft_supervisor import DraftSupervisor, SupervisedProposer
from device_agent.sessions import SessionRequest, SessionSummary
from inference import isolated_runtime
from inference.drafters import HYBRID, make_proposer
from inference.isolated_runtime import RuntimeLost
from inference.onnx_runtime import OnnxRuntime
from inference.proposers import Proposer
from inference.tokenizer import ChatTokenizer

DRAFT = "draft-l1"
READY_TIMEOUT_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def supervisor(models_dir: Path, clock: Clock) -> Iterator[DraftSupervisor]:
    supervisor = DraftSupervisor(models_dir, threads=1, clock=clock)
    yield supervisor
    supervisor.stop()


def kill_child(supervisor: DraftSupervisor, sig: signal.Signals = signal.SIGKILL) -> None:
    """Kill the draft's child and let the runtime find out, as a drafting call would."""
    runtime = supervisor.runtime(DRAFT)
    assert runtime.pid is not None
    os.kill(runtime.pid, sig)
    with pytest.raises(RuntimeLost):
        runtime.forward([1], runtime.new_cache())


def wait_available(supervisor: DraftSupervisor) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not supervisor.available(DRAFT):
        assert time.monotonic() < deadline, "the draft child did not come back"
        time.sleep(0.05)


def test_a_lost_child_restarts_after_its_backoff(
    supervisor: DraftSupervisor, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_supervisor, "RESTART_BACKOFF_S", 2.0)
    assert supervisor.wait_first_load(DRAFT)
    first_pid = supervisor.runtime(DRAFT).pid
    kill_child(supervisor)
    [health] = supervisor.health()
    assert (health.state, health.losses) == ("down", 1)
    assert "SIGKILL" in health.last_loss
    clock.now += 1.9
    assert not supervisor.available(DRAFT)
    assert supervisor.health()[0].state == "down"  # not restarted within the backoff
    clock.now += 0.2
    wait_available(supervisor)
    [health] = supervisor.health()
    assert (health.state, health.starts, health.quarantined) == ("up", 2, False)
    assert health.pid not in (None, first_pid)
    runtime = supervisor.runtime(DRAFT)
    assert runtime.forward([1, 2], runtime.new_cache()).shape[0] == 2


def test_the_backoff_doubles_with_each_loss_in_the_window(
    supervisor: DraftSupervisor, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_supervisor, "RESTART_BACKOFF_S", 1.0)
    monkeypatch.setattr(draft_supervisor, "QUARANTINE_LOSSES", 5)
    assert supervisor.wait_first_load(DRAFT)
    kill_child(supervisor)
    clock.now += 1.0
    wait_available(supervisor)
    kill_child(supervisor)
    clock.now += 1.5
    assert not supervisor.available(DRAFT)  # the second loss waits 2 s
    clock.now += 0.5
    wait_available(supervisor)


def test_a_draft_that_keeps_crashing_is_quarantined_and_reported(
    supervisor: DraftSupervisor, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_supervisor, "RESTART_BACKOFF_S", 0.0)
    monkeypatch.setattr(draft_supervisor, "QUARANTINE_LOSSES", 3)
    assert supervisor.wait_first_load(DRAFT)
    for sig in (signal.SIGSEGV, signal.SIGKILL):
        kill_child(supervisor, sig)
        clock.now += 10.0
        wait_available(supervisor)
    assert supervisor.quarantined() == {}
    kill_child(supervisor, signal.SIGSEGV)
    clock.now += 3600.0  # quarantine outlasts any backoff
    assert not supervisor.available(DRAFT)
    [reason] = supervisor.quarantined().values()
    assert "3 losses" in reason and "SIGSEGV" in reason
    [health] = supervisor.health()
    assert (health.state, health.quarantined, health.losses, health.pid) == (
        "quarantined",
        True,
        3,
        None,
    )


def test_losses_outside_the_window_do_not_quarantine(
    supervisor: DraftSupervisor, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_supervisor, "RESTART_BACKOFF_S", 0.0)
    monkeypatch.setattr(draft_supervisor, "QUARANTINE_LOSSES", 2)
    assert supervisor.wait_first_load(DRAFT)
    kill_child(supervisor)
    clock.now += draft_supervisor.QUARANTINE_WINDOW_S + 1.0
    wait_available(supervisor)
    kill_child(supervisor)
    assert supervisor.quarantined() == {}


def rounds(proposer: Proposer, context: list[int], n: int, k: int = 4) -> list[list[int]]:
    """n greedy windows, each committed whole (as if the target accepted it)."""
    windows = []
    for _ in range(n):
        window = proposer.get_candidates(context, k).tokens.tolist()
        windows.append(window)
        context += window or [context[-1]]
    return windows


@pytest.mark.parametrize("name", [DRAFT, "hybrid+" + DRAFT])
def test_a_supervised_drafter_drafts_as_in_process_and_falls_back_through_a_loss(
    supervisor: DraftSupervisor,
    models_dir: Path,
    tokenizer: ChatTokenizer,
    clock: Clock,
    name: str,
) -> None:
    assert supervisor.wait_first_load(DRAFT)
    proposer = SupervisedProposer(
        name,
        lambda: make_proposer(name, models_dir, load_runtime=supervisor.runtime),
        make_proposer(HYBRID, models_dir),
        lambda: supervisor.available(DRAFT),
    )
    in_process = make_proposer(name, models_dir, threads=1)
    fallback = make_proposer(HYBRID, models_dir)
    context = tokenizer.apply_chat_template("Write a haiku about the sea and the moon.")

    assert rounds(proposer, list(context), 3) == rounds(in_process, list(context), 3)
    assert proposer.drafting_with == name
    kill_child(supervisor, signal.SIGSEGV)
    # The round that meets the loss is drafted by the fallback, at once.
    window = proposer.get_candidates(context, 4)
    assert window.tokens.tolist() == fallback.get_candidates(context, 4).tokens.tolist()
    assert proposer.drafting_with == HYBRID
    clock.now += 60.0
    wait_available(supervisor)
    proposer.rollback(len(context))
    in_process.rollback(0)
    assert rounds(proposer, list(context), 2) == rounds(in_process, list(context), 2)
    assert proposer.drafting_with == name
    assert proposer.fallback_rounds >= 1


def test_a_forgotten_draft_gets_a_new_child_and_its_sessions_draft_on(
    supervisor: DraftSupervisor, models_dir: Path, tokenizer: ChatTokenizer
) -> None:
    assert supervisor.wait_first_load(DRAFT)
    old_pid = supervisor.runtime(DRAFT).pid
    proposer = SupervisedProposer(
        DRAFT,
        lambda: make_proposer(DRAFT, models_dir, load_runtime=supervisor.runtime),
        make_proposer(HYBRID, models_dir),
        lambda: supervisor.available(DRAFT),
    )
    in_process = make_proposer(DRAFT, models_dir, threads=1)
    context = tokenizer.apply_chat_template("Name three rivers in Europe.")
    assert rounds(proposer, list(context), 2) == rounds(in_process, list(context), 2)
    supervisor.forget(DRAFT)  # an OTA install changed its files: not a loss
    deadline = time.monotonic() + READY_TIMEOUT_S
    proposer.get_candidates(context, 2)
    assert proposer.drafting_with == HYBRID  # its child is gone: the round is the fallback's
    while proposer.drafting_with != DRAFT:  # no other session asks: the round starts a child
        assert time.monotonic() < deadline, "the draft never came back after forget"
        time.sleep(0.05)
        proposer.get_candidates(context, 2)
    [health] = supervisor.health()
    assert health.losses == 0 and health.pid not in (None, old_pid)
    proposer.rollback(len(context))
    in_process.rollback(0)
    assert rounds(proposer, list(context), 2) == rounds(in_process, list(context), 2)


# -- the agent: a draft child killed or hung mid-session -------------------------------------

E2E_PROMPT = "summarize-01"
E2E_MAX_TOKENS = 48
SESSION_TIMEOUT_S = 90.0


async def session_with_a_fault(
    broker_url: str,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    fault: signal.Signals,
    at_draft: int,
) -> tuple[SessionSummary, BusPeer, list[dict[str, object]], bool]:
    runtime, tokenizer = target
    peer = BusPeer(broker_url, TargetJudge(runtime, tokenizer.eos_id))
    device = f"dev-{secrets.token_hex(4)}"
    async with peer.running(), running_agent(broker_url, device, models_dir) as agent:
        supervisor = agent.catalog.supervisor
        assert supervisor is not None, "drafts run in child processes by default"
        request = SessionRequest(
            prompt=prompt_text(E2E_PROMPT), max_tokens=E2E_MAX_TOKENS, draft=DRAFT, k=3
        )
        session = await agent.sessions.start(request)
        while len(peer.drafts) < at_draft:
            await asyncio.sleep(0.002)
        pid = supervisor.runtime(DRAFT).pid
        assert pid is not None
        os.kill(pid, fault)
        summary = await asyncio.wait_for(session.wait(), SESSION_TIMEOUT_S)
        health = agent.health()
        still_up = agent.connected.is_set() and not session.local
    return summary, peer, list(health["draft_runtimes"]), still_up


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP])
def test_a_draft_child_killed_or_hung_mid_session_costs_a_round_not_the_answer(
    mosquitto: PrivateMosquitto,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    fault: signal.Signals,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SIGSTOP leaves the child alive and silent: a hang, found by the call deadline.
    monkeypatch.setattr(isolated_runtime, "CALL_DEADLINE_S", 0.5)
    summary, peer, health, still_up = asyncio.run(
        session_with_a_fault(mosquitto.url, models_dir, target, fault, at_draft=3)
    )
    assert summary.status == "finished" and summary.error == ""
    assert summary.token_ids == reference(E2E_PROMPT, target, E2E_MAX_TOKENS)
    assert still_up  # the agent, its bus session and its other work went on
    [draft_health] = [h for h in health if h["name"] == DRAFT]
    assert draft_health["losses"] == 1
    expected = "hung" if fault is signal.SIGSTOP else fault.name
    assert expected in str(draft_health["last_loss"])
    assert not draft_health["quarantined"]
    # Rounds went on after the fault, one per draft: none was lost or sent twice.
    assert summary.rounds > 3
    assert [d.round for d in peer.drafts] == list(range(summary.rounds))
    # The rounds the fallback drafted say so: the policy does not count them as draft-l1's.
    labels = [d.draft_model for d in peer.drafts]
    assert labels[:3] == [DRAFT] * 3 and HYBRID in labels


def test_an_agent_with_a_quarantined_draft_reports_it_and_its_sessions_draft_with_the_hybrid(
    mosquitto: PrivateMosquitto,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(draft_supervisor, "QUARANTINE_LOSSES", 1)

    async def main() -> tuple[SessionSummary, BusPeer, m.Telemetry, dict[str, Any]]:
        runtime, tokenizer = target
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id))
        device = f"dev-{secrets.token_hex(4)}"
        async with peer.running(), running_agent(mosquitto.url, device, models_dir) as agent:
            supervisor = agent.catalog.supervisor
            assert supervisor is not None and supervisor.wait_first_load(DRAFT)
            kill_child(supervisor, signal.SIGSEGV)
            request = SessionRequest(
                prompt=prompt_text(E2E_PROMPT), max_tokens=E2E_MAX_TOKENS, draft=DRAFT, k=3
            )
            session = await agent.sessions.start(request)
            summary = await asyncio.wait_for(session.wait(), SESSION_TIMEOUT_S)
            return summary, peer, agent._telemetry(), agent.health()

    summary, peer, telemetry, health = asyncio.run(main())
    assert telemetry.quarantined_drafts == (DRAFT,)
    [draft_health] = health["draft_runtimes"]
    assert draft_health["state"] == "quarantined" and "SIGSEGV" in draft_health["last_loss"]
    assert summary.status == "finished"
    assert summary.token_ids == reference(E2E_PROMPT, target, E2E_MAX_TOKENS)
    assert {d.draft_model for d in peer.drafts} == {HYBRID}
