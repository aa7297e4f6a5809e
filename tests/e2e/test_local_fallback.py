"""Local fallback and resume across real processes: a device whose link is cut generates alone,
provisionally, and the target's text wins on reconnect; a device agent SIGKILLed mid-session
resumes the session from its journal. The broker is a private Mosquitto; the agent talks to it
through a network emulator of its own, so that its link alone can be cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rounds_check import assert_rounds_rebuild
from test_dsd_bus import shared_prompts, target_answer

from broker.mosquitto import PrivateMosquitto
from coordinator.db.models import Event, Round
from core.settings import Settings
from device_agent.local_api import HOST, ApiError, SseEvent, stream_session, watch_session
from localfleet.fleet import AgentSpec, LocalFleet, local_fleet

# A neural draft proposes at every position, so the device can generate alone.
AGENT = AgentSpec("fallback-jetson", "jetson", "draft-l1", "onnx")
VERIFIERS = ["fallback-verifier"]
MAX_TOKENS = 40
FALLBACK_AFTER_S = 1.0
CUT_S = 3.0  # longer than FALLBACK_AFTER_S; the fault matrix cuts for 60 s
SESSION_TIMEOUT_S = 120.0


def _prompt() -> dict[str, str]:
    return next(p for p in shared_prompts() if p["task"] == "chat")


def _request(prompt: dict[str, str]) -> dict[str, Any]:
    return {
        "prompt": prompt["prompt"],
        "task_type": prompt["task"],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }


@contextlib.asynccontextmanager
async def _fleet(
    tmp_path: Path, broker_url: str, database_url: str | None = None
) -> AsyncIterator[LocalFleet]:
    overrides: dict[str, Any] = {
        "home": tmp_path / "home",
        "models_dir": Settings().resolved_models_dir,  # the built target and drafts
        "coordinator_id": f"coord-{uuid.uuid4().hex[:8]}",
    }
    if database_url is not None:
        overrides["database_url"] = database_url
    async with local_fleet(
        Settings(**overrides),
        [AGENT],
        VERIFIERS,
        workdir=tmp_path / "fleet",
        external_broker=broker_url,
        behind_netem={AGENT.device_id},
        agent_flags=["--fallback-after", str(FALLBACK_AFTER_S)],
    ) as fleet:
        yield fleet


def _check_rounds(fleet: LocalFleet, summary: dict[str, Any]) -> tuple[list[Round], int]:
    """Rounds contiguous from 0, rebuilding the committed tokens; returns them and the prompt's
    length."""
    with fleet.coordinator.sessions() as db:
        session, rounds = assert_rounds_rebuild(db, summary["session_id"], summary["token_ids"])
        return rounds, len(session.prompt_ids)


def _events(fleet: LocalFleet, session_id: str, kind: str) -> list[dict[str, Any]]:
    with fleet.coordinator.sessions() as db:
        rows = db.scalars(
            sa.select(Event)
            .where(Event.session_id == uuid.UUID(session_id), Event.kind == kind)
            .order_by(Event.id)
        )
        return [dict(row.detail) for row in rows]


def _check_stream(events: list[SseEvent], expected: tuple[int, ...]) -> list[dict[str, Any]]:
    """The caller's view: provisional tokens, then a reconciliation that keeps exactly those the
    target also produced and replaces the rest; the committed text is the target's. Returns the
    spells as {at, tokens, kept}."""
    assert events[-1].event == "done", events[-1]
    summary = events[-1].data
    assert tuple(summary["token_ids"]) == expected
    spells: list[dict[str, Any]] = []
    tokens: list[int] = []
    text = ""
    for event in events:
        if event.event == "text":
            text += event.data["delta"]
        elif event.event == "provisional":
            tokens += event.data["tokens"]
        elif event.event == "reconciled":
            settled = event.data
            at, kept = settled["at"], settled["kept"]
            assert settled["provisional"] == len(tokens)
            assert tokens[:kept] == list(expected[at : at + kept])
            assert settled["replaced"] == tokens[kept:]
            if settled["replaced"] and at + kept < len(expected):
                assert expected[at + kept] != settled["replaced"][0]
            assert settled["text"] == text  # the kept tokens came as committed text first
            spells.append({"at": at, "tokens": tokens, "kept": kept})
            tokens = []
    assert spells, "the caller saw no reconciliation"
    assert tokens == [], "provisional tokens left unreconciled"
    assert text == summary["text"]
    provisional = sum(len(s["tokens"]) for s in spells)
    assert provisional > 0 and summary["provisional_tokens"] == provisional
    assert summary["provisional_kept"] == sum(s["kept"] for s in spells)
    assert summary["fallbacks"] >= 1
    return spells


def _check_provisional_rounds(
    rounds: tuple[list[Round], int], spells: list[dict[str, Any]]
) -> list[Round]:
    """Each provisional round drafted a stretch of a spell's tokens at the spell's position."""
    rows, prompt_len = rounds
    provisional = [r for r in rows if r.provisional]
    for r in provisional:
        generated = r.base_len - prompt_len  # tokens committed before the round
        spell = next(s for s in reversed(spells) if s["at"] <= generated)
        offset = generated - spell["at"]
        assert list(r.draft_tokens) == spell["tokens"][offset : offset + len(r.draft_tokens)]
    return provisional


Checked = tuple[list[SseEvent], tuple[list[Round], int], dict[str, list[dict[str, Any]]]]


async def _run(
    tmp_path: Path,
    broker_url: str,
    fault: Callable[[LocalFleet, SseEvent], None],
    before: Callable[[LocalFleet], None] | None = None,
) -> Checked:
    """One session with `fault` applied as its events arrive (after `before`, once the fleet is
    up); its events, its rounds and the coordinator's events about it."""
    async with _fleet(tmp_path, broker_url) as fleet:
        if before is not None:
            before(fleet)
        port = fleet.agent_ports[AGENT.device_id]
        events: list[SseEvent] = []

        async def follow() -> None:
            async for event in stream_session(HOST, port, _request(_prompt()), timeout_s=30.0):
                events.append(event)
                fault(fleet, event)

        await asyncio.wait_for(follow(), SESSION_TIMEOUT_S)
        summary = events[-1].data
        rounds = await asyncio.to_thread(_check_rounds, fleet, summary)
        logged = {
            kind: await asyncio.to_thread(_events, fleet, summary["session_id"], kind)
            for kind in ("session.fallback", "session.reconciled", "session.resumed")
        }
        return events, rounds, logged


def test_a_link_cut_mid_session_falls_back_to_local_text_then_the_target_s_wins(
    tmp_path: Path,
) -> None:
    cut: list[bool] = []

    def fault(fleet: LocalFleet, event: SseEvent) -> None:
        if event.event == "text" and not cut:  # mid-generation: a round has committed
            fleet.links[AGENT.device_id].cut(CUT_S)
            cut.append(True)

    with PrivateMosquitto() as mosquitto:
        events, rounds, logged = asyncio.run(_run(tmp_path, mosquitto.url, fault))
    expected = target_answer(_prompt()["prompt"], MAX_TOKENS)
    spells = _check_stream(events, expected)
    provisional = _check_provisional_rounds(rounds, spells)
    # The device told the coordinator of its spell when it reconnected, and resumed.
    (report, *_) = logged["session.fallback"]
    assert report["provisional_tokens"] >= 1 and report["offline_s"] >= FALLBACK_AFTER_S
    assert any(r.get("reason") == "reconnect" for r in logged["session.resumed"])
    reconciled_rounds = [e["round"] for e in logged["session.reconciled"]]
    assert reconciled_rounds == [r.round_index for r in provisional]


def test_a_tail_generated_before_the_coordinator_ever_answered_is_one_provisional_round(
    tmp_path: Path,
) -> None:
    """The link stalls as the session opens and is then cut, so the open never arrives: the
    whole answer so far is provisional, and goes out as round 0 when the link returns."""

    def stall(fleet: LocalFleet) -> None:
        fleet.links[AGENT.device_id].stall(None)  # holds the open to come

    def fault(fleet: LocalFleet, event: SseEvent) -> None:
        link = fleet.links[AGENT.device_id]
        if event.event == "session":
            link.cut(None)  # drops the open held in the link
            asyncio.get_running_loop().call_later(CUT_S, link.restore)

    with PrivateMosquitto() as mosquitto:
        events, rounds, logged = asyncio.run(_run(tmp_path, mosquitto.url, fault, stall))
    expected = target_answer(_prompt()["prompt"], MAX_TOKENS)
    (spell, *others) = _check_stream(events, expected)
    assert spell["at"] == 0
    (first, *_) = _check_provisional_rounds(rounds, [spell, *others])
    # Round 0 is the whole tail, the first window included, sent as one long draft.
    assert first.round_index == 0 and list(first.draft_tokens) == spell["tokens"]
    assert first.k == len(spell["tokens"]) > 1
    assert logged["session.fallback"][0]["provisional_tokens"] == len(spell["tokens"])
    assert logged["session.reconciled"][0]["kept"] == spell["kept"]


@pytest.mark.slow  # the fault matrix's agent SIGKILL row proves the same on every run
def test_an_agent_sigkilled_mid_session_resumes_it_from_its_journal(
    tmp_path: Path, create_pg_database: Callable[[], str]
) -> None:
    async def scenario(broker_url: str) -> tuple[list[SseEvent], list[Round], list[Any]]:
        async with _fleet(tmp_path, broker_url, create_pg_database()) as fleet:
            port = fleet.agent_ports[AGENT.device_id]
            session_id = ""
            seen = 0
            # The caller's stream ends when the agent dies.
            with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
                async for event in stream_session(HOST, port, _request(_prompt())):
                    if event.event == "session":
                        session_id = str(event.data["session_id"])
                    elif event.event == "text":
                        seen += 1
                        if seen == 3:  # mid-generation
                            await fleet.restart_agent(AGENT.device_id)
                    assert event.event not in ("done", "error"), "finished before the kill"
            assert session_id and seen == 3
            # The restarted agent lists the session once it has read its journal, and the
            # caller re-attaches to it.
            events: list[SseEvent] = []
            for _ in range(150):
                try:
                    async for event in watch_session(HOST, port, session_id, timeout_s=10.0):
                        events.append(event)
                    break
                except ApiError as exc:
                    assert exc.status in (0, 404), exc.reason
                    await asyncio.sleep(0.1)
            summary = events[-1].data
            rounds, _ = await asyncio.to_thread(_check_rounds, fleet, summary)
            resumed = await asyncio.to_thread(_events, fleet, session_id, "session.resumed")
            return events, rounds, resumed

    with PrivateMosquitto() as mosquitto:
        events, rounds, resumed = asyncio.run(scenario(mosquitto.url))
    assert events and events[-1].event == "done", events[-1:]
    summary = events[-1].data
    assert tuple(summary["token_ids"]) == target_answer(_prompt()["prompt"], MAX_TOKENS)
    assert summary["resumed"] is True
    # The re-attached stream starts over: the journaled text, then the rest, the target's.
    assert "".join(e.data["delta"] for e in events if e.event == "text") == summary["text"]
    assert any(r.get("reason") == "restart" for r in resumed)
    assert len(rounds) > summary["rounds"]  # rounds ran before the kill too
