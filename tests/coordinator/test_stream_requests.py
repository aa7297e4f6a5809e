"""What the coordinator asks a verifier for when it opens a session's host stream."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from coordinator.db.engine import make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from coordinator.runtime import verifiers
from coordinator.runtime.quotas import Quotas
from coordinator.runtime.round_model import CLOUD_STREAM_ROUNDS
from coordinator.runtime.sessions import SessionBook
from coordinator.runtime.verifiers import VerifierPool
from core.settings import Settings
from inference.artifacts import TargetIdentity
from tests.coordinator.test_direct_round_reports import Published, _admit
from tests.coordinator.test_round_writer import DEVICE, PROMPT_IDS, open_session

TRIED = "hybrid+eagle-h1"
TARGET = TargetIdentity("target", "1" * 64, "2" * 64, 1000, 7)


def _book(
    sessions: sessionmaker[Session], published: Published | None = None
) -> tuple[SessionBook, Published]:
    """A book whose only way out is `Published`, with no verifier up."""
    published = published or Published()
    book = SessionBook(sessions, VerifierPool(published), published, admit=_admit,
                       quotas=Quotas.from_settings(Settings()), idle_timeout_s=600,
                       target=TARGET)  # fmt: skip
    return book, published


def test_a_stream_trying_a_drafter_runs_past_the_decision_that_ends_the_try(
    sqlite_engine: Engine,
) -> None:
    """A drafter being tried streams for a whole answer like any other: the decision after its
    round 8 ends the try, and the coordinator ends the stream only where that decision chooses
    another drafter (`RoundPipeline._host_stream`). A try's stream cut at the decision always
    ended, and the session's next round waited a bus round trip for the next stream, a pass
    behind the sessions beside it."""
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = open_session(sessions)

    async def scenario() -> m.VerifyRequest:
        book, _ = _book(sessions)
        live = await book.get(str(session_id))
        assert live is not None
        live.policy_task = "chat"
        live.policy = live.policy.model_copy(
            update={"mode": m.Mode.CLOUD, "draft_model": TRIED, "k": 4}
        )
        book.policy.exploration.exploring[TRIED] = live.id
        return book._stream_request(live)

    request = asyncio.run(scenario())
    assert request.stream is not None
    assert (request.cloud_draft, request.round) == (TRIED, 0)
    assert request.context_ids == tuple(PROMPT_IDS)
    assert request.stream.rounds == CLOUD_STREAM_ROUNDS
    assert request.stream.adaptive and request.stream.eos_id == TARGET.eos_id


@pytest.mark.parametrize("awaits", [True, False])
def test_a_session_opened_on_the_host_streams_from_the_open_where_its_agent_awaits_it(
    sqlite_engine: Engine, awaits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that awaits its stream (`SessionOpen.awaits_stream`) asks for none: the state
    says the stream runs (`SessionState.streaming`) and the coordinator starts it at the open,
    a bus round trip sooner. Here no verifier is up, so the stream breaks off at once and the
    state that follows says so (not streaming), after which the agent asks for it as an agent
    that predates the field always does; to such an agent the state says nothing of a stream."""
    monkeypatch.setattr(verifiers, "NO_VERIFIER_WAIT_S", 0.2)  # the pool's wait for one
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = str(uuid.uuid4())
    request = m.SessionOpen(
        session_id=session_id,
        prompt="hello",
        prompt_ids=tuple(PROMPT_IDS),
        draft_model="hybrid",
        k=0,
        mode=m.Mode.PLAIN,
        modes=(m.Mode.DISTRIBUTED, m.Mode.CLOUD, m.Mode.PLAIN),
        awaits_stream=awaits,
    )

    async def scenario() -> list[m.Message]:
        book, published = _book(sessions)
        await book.on_session_open(DEVICE, request)
        return [message for _, message in published.messages]

    replies = asyncio.run(scenario())
    states = [reply for reply in replies if isinstance(reply, m.SessionState)]
    errors = [reply for reply in replies if isinstance(reply, m.ErrorReply)]
    assert all(state.session_id == session_id and state.next_round == 0 for state in states)
    if awaits:
        assert [state.streaming for state in states] == [True, False]
        assert [error.reason for error in errors] == ["the host stream broke off"]
        assert replies.index(errors[0]) < replies.index(states[1])
    else:
        assert [state.streaming for state in states] == [False] and not errors


class StateAckedLate(Published):
    """The broker's acknowledgement of a streaming state held until `released`."""

    def __init__(self) -> None:
        super().__init__()
        self.released = asyncio.Event()
        self.broke_off = asyncio.Event()  # the stream ran, found no verifier, and said so

    async def __call__(self, topic: str, payload: bytes) -> None:
        await super().__call__(topic, payload)
        message = self.messages[-1][1]
        if isinstance(message, m.ErrorReply):
            self.broke_off.set()
        if isinstance(message, m.SessionState) and message.streaming:
            await self.released.wait()


def test_a_stream_opened_with_its_session_does_not_wait_for_the_states_acknowledgement(
    sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state that says a stream runs goes out first, and the stream starts without waiting
    for the broker to acknowledge it: here the stream runs (and, with no verifier up, breaks
    off) while that acknowledgement is still held. It once waited: 4-65 ms of a wave's start
    when 16 sessions opened at once."""
    monkeypatch.setattr(verifiers, "NO_VERIFIER_WAIT_S", 0.2)
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    request = m.SessionOpen(session_id=str(uuid.uuid4()), prompt="hello",
                            prompt_ids=tuple(PROMPT_IDS), draft_model="hybrid", k=0,
                            mode=m.Mode.PLAIN, modes=(m.Mode.DISTRIBUTED, m.Mode.PLAIN),
                            awaits_stream=True)  # fmt: skip

    async def scenario() -> tuple[bool, list[m.Message]]:
        published = StateAckedLate()
        book, _ = _book(sessions, published)
        opening = asyncio.create_task(book.on_session_open(DEVICE, request))
        try:
            await asyncio.wait_for(published.broke_off.wait(), 5.0)
            ran_unacknowledged = not published.released.is_set()
        finally:
            published.released.set()
        await opening
        return ran_unacknowledged, [message for _, message in published.messages]

    ran_unacknowledged, replies = asyncio.run(scenario())
    assert ran_unacknowledged
    assert isinstance(replies[0], m.SessionState) and replies[0].streaming
    assert [type(r).__name__ for r in replies] == ["SessionState", "ErrorReply", "SessionState"]


def test_a_request_or_an_open_sent_again_while_its_stream_runs_is_told_the_stream_runs(
    sqlite_engine: Engine,
) -> None:
    """An agent that timed out sends its host window again while the stream runs, or opens the
    session again as it reconnects: the answer is the state with `streaming`, on which the agent
    waits for the verdicts (a state without it had the agent send the window again at once, and
    so on, until the stream's next verdict)."""
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = open_session(sessions)

    async def scenario() -> list[m.Message]:
        book, published = _book(sessions)
        live = await book.get(str(session_id))
        assert live is not None
        live.policy = live.policy.model_copy(update={"mode": m.Mode.PLAIN, "k": 0})
        live.streaming = True  # its stream runs
        again = m.Draft(session_id=live.id, round=0, base_len=len(PROMPT_IDS), tokens=(),
                        draft_model="hybrid", cloud_k=4)  # fmt: skip
        await book.on_draft(DEVICE, again)
        # And the agent that reconnects opens the session again: told the same.
        reopen = m.SessionOpen(session_id=live.id, prompt="hello", prompt_ids=tuple(PROMPT_IDS),
                               draft_model="hybrid", resume=m.ResumeReason.RECONNECT,
                               awaits_stream=True)  # fmt: skip
        await book.on_session_open(DEVICE, reopen)
        live.streaming = False  # its stream ended: a state from now on says nothing of one
        await book.on_session_open(DEVICE, reopen)
        return [message for _, message in published.messages]

    replies = asyncio.run(scenario())
    states = [reply for reply in replies if isinstance(reply, m.SessionState)]
    assert len(states) == len(replies) and all(state.next_round == 0 for state in states)
    assert [state.streaming for state in states] == [True, True, False]
