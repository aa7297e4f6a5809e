"""Local mode on the agent: provisional tails, their reconciliation, and the session journal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agent_peer import BusPeer, Faults, TargetJudge, prompt_text, reference, running_agent
from test_drafting import GREEDY, SAMPLED, make_drafter

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from device_agent import drafting, sessions
from device_agent.catalog import DrafterCatalog
from device_agent.drafting import Reconciliation, SessionDrafter, reconcile
from device_agent.journal import SessionJournal
from device_agent.sessions import AgentSession, SessionRequest, SessionSummary, StreamEvent
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer

NEURAL = "draft-l1"  # proposes at every position, so it can generate alone
MAX_TOKENS = 40
# Once a deliberate silence is over, a fallback no real verdict outlasts, however loaded the host.
SLOW_HOST_FALLBACK_S = 60.0


@pytest.mark.parametrize(
    ("tail", "committed", "finished", "expected"),
    [
        # The target agrees with the first two tokens, then says otherwise: the rest is replaced.
        ([1, 2, 3, 4], [1, 2, 9], False, (2, (3, 4), ())),
        # It contradicts the very first provisional token.
        ([1, 2, 3], [7], False, (0, (1, 2, 3), ())),
        # It has ruled on two tokens only: the rest waits for the next draft.
        ([1, 2, 3, 4], [1, 2], False, (2, (), (3, 4))),
        # ... unless the session ended there, which drops the rest.
        ([1, 2, 3, 4], [1, 2], True, (2, (3, 4), ())),
        # Nothing committed yet: everything still waits.
        ([1, 2], [], False, (0, (), (1, 2))),
        # The whole tail kept, and the target's own token after it.
        ([1, 2], [1, 2, 5], False, (2, (), ())),
        # No tail at all.
        ([], [4, 5], False, (0, (), ())),
    ],
)
def test_reconcile_keeps_the_common_prefix_and_replaces_from_the_first_rejection(
    tail: list[int],
    committed: list[int],
    finished: bool,
    expected: tuple[int, tuple[int, ...], tuple[int, ...]],
) -> None:
    outcome = reconcile(tail, committed, finished)
    assert outcome == Reconciliation(*expected)
    # Every provisional token is kept, replaced or still pending: none lost, none twice.
    assert outcome.kept + len(outcome.replaced) + len(outcome.pending) == len(tail)


def _drafter(
    tokenizer: ChatTokenizer,
    catalog: DrafterCatalog,
    prompt_id: str,
    sampling: m.SamplingSpec = GREEDY,
) -> SessionDrafter:
    if not catalog.has(NEURAL):
        pytest.skip(f"{NEURAL} is not built in {catalog.models_dir}")
    return make_drafter(
        tokenizer,
        catalog,
        prompt_id,
        draft=NEURAL,
        k=3,
        sampling=sampling,
        proactive=False,
        max_tokens=MAX_TOKENS,
    )


def _round(drafter: SessionDrafter, judge: TargetJudge) -> m.Verdict:
    draft = drafter.draft().message(drafter.spec.session_id, 0.0)
    verdict = judge.judge(draft)
    assert isinstance(verdict, m.Verdict), verdict
    assert drafter.apply_verdict(verdict) is not None
    return verdict


def _generate_alone(drafter: SessionDrafter) -> list[int]:
    made = drafter.start_local()
    while drafter.can_generate_locally:
        made += drafter.generate_locally(5)
    return made


def _finish(drafter: SessionDrafter, judge: TargetJudge) -> None:
    while not drafter.finished:
        _round(drafter, judge)


def test_a_tail_generated_offline_goes_out_as_one_draft_and_the_target_s_text_wins(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    drafter = _drafter(tokenizer, catalog, "chat-01")
    drafter.resync(judge.open(drafter.spec.open_message()))
    for _ in range(2):
        _round(drafter, judge)
    at = len(drafter.generated)
    window = drafter.draft()  # in flight when the link goes; the judge never sees it

    made = _generate_alone(drafter)
    # The tail opens with the window in flight, runs to max_tokens (or eos), greedy = argmax.
    assert made == drafter.provisional and made[: len(window.tokens)] == list(window.tokens)
    assert len(made) == MAX_TOKENS - at or made[-1] == tokenizer.eos_id
    assert not drafter.can_generate_locally and drafter.generate_locally(5) == []

    # The link is back: the state says nothing moved, and the tail goes out as round 2.
    outcome = drafter.resync(judge.open(drafter.spec.open_message()))
    assert outcome.in_sync and drafter.tail_unsent
    provisional = drafter.draft()
    assert provisional.provisional and list(provisional.tokens) == made
    assert (provisional.round, provisional.base_len) == (window.round, window.base_len)
    message = provisional.message(drafter.spec.session_id, 0.0)
    assert message.provisional and message.q_ids is None  # greedy: no q'
    verdict = judge.judge(message)
    assert isinstance(verdict, m.Verdict)
    drafter.apply_verdict(verdict)

    settled = drafter.take_reconciled()
    assert settled is not None and drafter.spell is None and drafter.provisional == []
    expected = reference("chat-01", target, MAX_TOKENS)
    assert settled.at == at and settled.provisional == len(made)
    assert settled.kept >= verdict.n_accepted
    assert settled.kept + len(settled.replaced) == len(made)
    assert made[: settled.kept] == expected[at : at + settled.kept]
    assert list(settled.replaced) == made[settled.kept :]
    # The first replaced token is where the target said otherwise.
    if settled.replaced:
        assert expected[at + settled.kept] != settled.replaced[0]
    assert drafter.records[-1].provisional and drafter.records[-1].drafted == len(made)

    _finish(drafter, judge)
    assert drafter.generated == expected
    assert [r.round for r in drafter.records] == list(range(len(drafter.records)))


def test_a_verdict_lost_on_the_way_settles_the_tail_through_the_state(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    drafter = _drafter(tokenizer, catalog, "code-01")
    drafter.resync(judge.open(drafter.spec.open_message()))
    _round(drafter, judge)
    at = len(drafter.generated)
    # The coordinator verifies the window in flight, but its verdict is lost with the link.
    lost = judge.judge(drafter.draft().message(drafter.spec.session_id, 0.0))
    assert isinstance(lost, m.Verdict)
    made = _generate_alone(drafter)

    outcome = drafter.resync(judge.open(drafter.spec.open_message()))
    assert not outcome.in_sync and not outcome.rewound
    committed = outcome.new_tokens  # the lost round: its accepted tokens and the target's one
    expected = reference("code-01", target, MAX_TOKENS)
    assert committed == expected[at : at + len(committed)]
    kept = reconcile(made, committed).kept
    if drafter.provisional:  # the target agreed with all it ruled on: the rest goes out next
        assert made[: len(committed)] == committed
        assert drafter.draft().tokens == tuple(made[len(committed) :])
    else:
        settled = drafter.take_reconciled()
        assert settled is not None and settled.kept == kept
        assert list(settled.replaced) == made[kept:]
    _finish(drafter, judge)
    assert drafter.generated == expected


def test_a_sampled_tail_carries_the_q_it_was_drawn_from(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    drafter = _drafter(tokenizer, catalog, "chat-01", SAMPLED)
    drafter.resync(judge.open(drafter.spec.open_message()))
    _round(drafter, judge)
    drafter.draft()
    made = _generate_alone(drafter)
    assert len(drafter.provisional_q) == len(made)

    drafter.resync(judge.open(drafter.spec.open_message()))
    message = drafter.draft().message(drafter.spec.session_id, 0.0)  # validates q' rows
    assert message.provisional and message.q_ids is not None and message.q_probs is not None
    for token, ids, probs in zip(message.tokens, message.q_ids, message.q_probs, strict=True):
        assert probs[ids.index(token)] > 0  # drawn from the q' it sends
    verdict = judge.judge(message)
    assert isinstance(verdict, m.Verdict)
    drafter.apply_verdict(verdict)
    settled = drafter.take_reconciled()
    assert settled is not None and settled.kept + len(settled.replaced) == len(made)
    _finish(drafter, judge)
    assert drafter.finished and len(drafter.generated) <= MAX_TOKENS


def test_the_tail_is_capped(
    target: tuple[OnnxRuntime, ChatTokenizer],
    catalog: DrafterCatalog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(drafting, "PROVISIONAL_MAX_TOKENS", 7)
    _, tokenizer = target
    drafter = _drafter(tokenizer, catalog, "chat-01")
    drafter.resync(
        m.SessionState(
            session_id=drafter.spec.session_id,
            prompt_len=drafter.prompt_len,
            generated_ids=(),
            next_round=0,
            status="active",
        )
    )
    made = _generate_alone(drafter)
    assert len(made) == 7 or made[-1] == tokenizer.eos_id


def test_a_copying_drafter_with_nothing_to_copy_waits_for_the_link(
    tokenizer: ChatTokenizer, catalog: DrafterCatalog
) -> None:
    drafter = make_drafter(tokenizer, catalog, "chat-01", draft="lookup")
    # A context whose last token never occurred before: prompt lookup has no match.
    drafter.committed.append(max(drafter.committed) + 1)
    assert drafter.start_local() == []
    assert drafter.can_generate_locally
    assert drafter.generate_locally(4) == []
    assert not drafter.can_generate_locally and drafter.provisional == []


def test_the_journal_keeps_open_sessions_and_their_tails(
    tmp_path: Path, target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    drafter = _drafter(tokenizer, catalog, "chat-01", SAMPLED)
    drafter.resync(judge.open(drafter.spec.open_message()))
    _round(drafter, judge)
    drafter.draft()
    made = _generate_alone(drafter)
    assert drafter.spell is not None
    drafter.spell.since = 1234.5

    path = tmp_path / "agent" / "journal.sqlite3"
    journal = SessionJournal(path)
    journal.record(drafter, "local")
    journal.close()

    reopened = SessionJournal(path)  # as a restarted agent opens it
    (entry,) = reopened.open_sessions()
    assert entry.spec == drafter.spec and entry.status == "local"
    assert entry.generated == drafter.generated and entry.next_round == drafter.round
    assert entry.provisional == made and entry.provisional_q == drafter.provisional_q
    assert entry.spell is not None and entry.spell.generated == len(made)
    assert entry.spell.since == 1234.5
    reopened.forget(drafter.spec.session_id)
    assert reopened.open_sessions() == []
    reopened.close()


def test_the_journal_writes_a_spec_once_and_then_the_progress_alone(
    tmp_path: Path, target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    """A commit updates the session's progress and leaves its spec (the prompt) as written; a
    journal opened again (a restarted agent) writes the whole row at its first record."""
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    drafter = _drafter(tokenizer, catalog, "chat-01", SAMPLED)
    drafter.resync(judge.open(drafter.spec.open_message()))
    path = tmp_path / "journal.sqlite3"
    journal = SessionJournal(path)
    journal.record(drafter, "active")

    def spec_text() -> str:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return str(db.execute("SELECT spec FROM sessions").fetchone()[0])

    # The same spec as another text: a full write would put the journal's own text back.
    marked = json.dumps(json.loads(spec_text()), indent=1)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE sessions SET spec = ?", (marked,))
    _round(drafter, judge)
    journal.record(drafter, "active")
    assert spec_text() == marked
    (entry,) = journal.open_sessions()
    assert entry.spec == drafter.spec and entry.generated == drafter.generated
    assert entry.next_round == drafter.round >= 1
    journal.close()

    reopened = SessionJournal(path)
    reopened.record(drafter, "active")
    assert spec_text() != marked and json.loads(spec_text()) == json.loads(marked)
    reopened.forget(drafter.spec.session_id)
    reopened.record(drafter, "active")  # forgotten, then recorded again: a whole row
    (entry,) = reopened.open_sessions()
    assert entry.spec == drafter.spec and entry.generated == drafter.generated
    reopened.close()


@contextlib.asynccontextmanager
async def _chat_01(
    peer: BusPeer, broker_url: str, models_dir: Path, max_tokens: int, **settings: Any
) -> AsyncIterator[tuple[Any, AgentSession]]:
    """The peer and a real agent on the broker, and a session of chat-01 drafted by NEURAL."""
    async with (
        peer.running(),
        running_agent(
            broker_url, f"dev-{secrets.token_hex(4)}", models_dir, proactive=False, **settings
        ) as agent,
    ):
        request = SessionRequest(
            prompt=prompt_text("chat-01"), max_tokens=max_tokens, draft=NEURAL, k=3
        )
        yield agent, await agent.sessions.start(request)


def test_a_session_that_hears_nothing_generates_alone_then_reconciles(
    mosquitto: PrivateMosquitto,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    catalog: DrafterCatalog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not catalog.has(NEURAL):
        pytest.skip(f"{NEURAL} is not built in {catalog.models_dir}")
    monkeypatch.setattr(sessions, "OPEN_TIMEOUT_S", 0.5)
    runtime, tokenizer = target
    faults = Faults()
    peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id), faults)
    max_tokens = 32

    async def scenario() -> tuple[SessionSummary, list[StreamEvent]]:
        async with _chat_01(
            peer, mosquitto.url, models_dir, max_tokens, fallback_after_s=0.4, round_timeout_s=1.0
        ) as (agent, session):
            events: list[StreamEvent] = []
            async for event in session.events():
                events.append(event)
                if event.kind == "text" and not faults.silent and len(events) == 1:
                    faults.silent = True  # the coordinator goes quiet after the first round
                if event.kind == "provisional" and not session.drafter.can_generate_locally:
                    faults.silent = False  # and answers the next open
                    # One spell is the scenario: from here a verdict slower than 0.4 s (the
                    # target on a loaded host) must not start a second one.
                    agent.sessions.settings.fallback_after_s = SLOW_HOST_FALLBACK_S
            summary = await asyncio.wait_for(session.wait(), 60)
            return summary, events

    summary, events = asyncio.run(scenario())
    expected = reference("chat-01", target, max_tokens)
    assert summary.status == "finished" and summary.token_ids == expected

    kinds = [e.kind for e in events]
    first_provisional = kinds.index("provisional")
    (settled_at,) = [i for i, kind in enumerate(kinds) if kind == "reconciled"]
    assert set(kinds[first_provisional:settled_at]) <= {"provisional", "text"}
    made = [t for e in events if e.kind == "provisional" for t in e.data["tokens"]]
    settled = events[settled_at].data
    text_before = "".join(e.data["delta"] for e in events[:settled_at] if e.kind == "text")
    assert settled["text"] == text_before
    at, kept = settled["at"], settled["kept"]
    assert settled["provisional"] == len(made) and settled["replaced"] == made[kept:]
    assert made[:kept] == expected[at : at + kept]
    if settled["replaced"]:
        assert expected[at + kept] != settled["replaced"][0]
        assert settled["replaced_text"] == tokenizer.decode(settled["replaced"])
    assert (summary.fallbacks, summary.provisional_tokens) == (1, len(made))
    assert summary.provisional_kept == kept
    assert summary.provisional_replaced == len(settled["replaced"])

    # The coordinator heard of the spell with the open that found it again, then got the tail
    # as one provisional draft of the round that was in flight; no round went out twice.
    reports = [o for o in peer.opens if o.fallback is not None]
    assert reports and reports[0].fallback is not None
    assert reports[0].resume is m.ResumeReason.RETRY
    assert reports[0].fallback.provisional_tokens == len(made)
    (tail,) = [d for d in peer.drafts if d.provisional]
    assert list(tail.tokens) == made
    judged = peer.judge.sessions[summary.session_id].verdicts
    assert sorted(judged) == list(range(len(judged)))
    assert judged[tail.round].n_accepted <= kept


@pytest.mark.parametrize(("slow_round", "fallbacks"), [(0, 0), (1, 0), (2, 1)])
def test_the_first_verdicts_wait_on_the_prefills_without_local_mode(
    mosquitto: PrivateMosquitto,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    catalog: DrafterCatalog,
    slow_round: int,
    fallbacks: int,
) -> None:
    """A verdict 1 s late, with fallback_after_s = 0.5 and the link up: one of the first
    GRACE_VERDICTS (they wait on the prompt's prefill and those of the sessions opened with it)
    is waited for, FIRST_VERDICT_GRACE times as long; a later one starts local mode. Either way
    the answer is the target's."""
    if not catalog.has(NEURAL):
        pytest.skip(f"{NEURAL} is not built in {catalog.models_dir}")
    assert 0.5 < 1.0 < 0.5 * sessions.FIRST_VERDICT_GRACE and sessions.GRACE_VERDICTS == 2
    runtime, tokenizer = target
    faults = Faults(verdict_delays={slow_round: 1.0})
    peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id), faults)
    max_tokens = 16

    async def scenario() -> SessionSummary:
        async with _chat_01(
            peer, mosquitto.url, models_dir, max_tokens, fallback_after_s=0.5, round_timeout_s=5.0
        ) as (agent, session):
            async for event in session.events():
                # Once the slow verdict is past (text heard after the peer took the slow round's
                # draft, or the spell it started), a verdict slower than 0.5 s on a loaded host
                # must not start another spell.
                slow_taken = slow_round not in faults.verdict_delays
                if event.kind == "provisional" or (event.kind == "text" and slow_taken):
                    agent.sessions.settings.fallback_after_s = SLOW_HOST_FALLBACK_S
            return await asyncio.wait_for(session.wait(), 60)

    summary = asyncio.run(scenario())
    assert summary.status == "finished"
    assert summary.token_ids == reference("chat-01", target, max_tokens)
    assert summary.fallbacks == fallbacks
