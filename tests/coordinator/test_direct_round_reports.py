"""Direct rounds the coordinator never heard of: a verifier persisted them, but their reports
were lost (or the verifier died before sending them). When a later report or a takeover makes
the coordinator reload the session from the database, its round observers (what /metrics
counts) see each of those rounds once, so that every committed token is counted. A takeover
also ends the lease on the verifier declared dead, which may only have been slow to be heard:
alive, it would go on answering the session's drafts beside the coordinator."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from broker.topics import VerifierChannel, verifier_topic
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import Round, SessionStatus
from coordinator.db.registry import DeviceRegistry
from coordinator.db.round_writer import RoundWriter
from coordinator.runtime import verifiers
from coordinator.runtime.quotas import Quotas
from coordinator.runtime.session_state import LiveSession
from coordinator.runtime.sessions import SessionBook
from coordinator.runtime.verifiers import VerifierPool
from core.settings import Settings
from tests.coordinator.test_round_writer import DEVICE, PROMPT_IDS, open_session, round_row

VERIFIER = "v-direct"


class Published:
    """What the book published (its only way out), in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, m.Message]] = []

    async def __call__(self, topic: str, payload: bytes) -> None:
        self.messages.append((topic, m.decode(payload)))


def _admit(_device_id: str) -> bool:
    return True


async def _persist(engine: Engine, session_id: uuid.UUID, indices: range) -> None:
    """Rounds as the verifier holding the lease stores them (each commits two tokens)."""
    writer = RoundWriter(engine)
    running = asyncio.create_task(writer.run())
    try:
        for index in indices:
            generated = [7, 9] * (index + 1)
            await writer.write(round_row(session_id, index, 2 * index), generated,
                               SessionStatus.ACTIVE, device_id=DEVICE)  # fmt: skip
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running


def _report(session_id: uuid.UUID, index: int) -> m.RoundDone:
    return m.RoundDone(
        lease_id="lease-1",
        session_id=str(session_id),
        round=index,
        base_len=len(PROMPT_IDS) + 2 * index,
        committed=(7, 9),
        drafted=2,
        n_accepted=1,
        draft_model="lookup",
        verifier_id=VERIFIER,
    )


@pytest.fixture
def sessions(sqlite_engine: Engine) -> sessionmaker[Session]:
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    return sessions


def test_rounds_whose_reports_were_lost_are_observed_once(
    sessions: sessionmaker[Session], sqlite_engine: Engine
) -> None:
    session_id = open_session(sessions)
    published = Published()
    observed: list[int] = []

    def observe(_live: LiveSession, row: Round) -> None:
        observed.append(row.round_index)

    async def scenario() -> LiveSession:
        book = SessionBook(sessions, VerifierPool(published), published, admit=_admit,
                           quotas=Quotas.from_settings(Settings()), idle_timeout_s=600)  # fmt: skip
        book.round_observers.append(observe)
        live = await book.get(str(session_id))
        assert live is not None and live.next_round == 0
        # Rounds 0-2 stored; the reports of 0 and 1 lost: round 2's report makes it reload.
        await _persist(sqlite_engine, session_id, range(3))
        await book.on_round_done(VERIFIER, _report(session_id, 2))
        assert observed == [0, 1, 2]
        assert live.lease == (VERIFIER, "lease-1")
        # Round 3 stored, and its verifier is declared dead before reporting it: the takeover
        # ends its lease there and reloads.
        await _persist(sqlite_engine, session_id, range(3, 4))
        book.on_verifier_lost(VERIFIER)
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*book._tasks), 10)
        ends = [message for topic, message in published.messages
                if topic == verifier_topic(VERIFIER, VerifierChannel.WORK)]  # fmt: skip
        assert ends == [m.LeaseEnd(lease_id="lease-1", session_id=str(session_id))]
        assert live.lease is None
        # A report of a round already known changes nothing.
        await book.on_round_done(VERIFIER, _report(session_id, 3))
        return live

    live = asyncio.run(scenario())
    assert observed == [0, 1, 2, 3]
    assert (live.next_round, live.generated) == (4, [7, 9] * 4)


def test_a_lease_not_answered_in_time_is_ended_there(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier's answer to a lease may only be late (its loop busy): if it took the lease,
    it would answer the session's drafts beside the coordinator, which goes on without it. The
    coordinator ends the lease there, and answers the session itself."""
    monkeypatch.setattr(verifiers, "LEASE_TIMEOUT_S", 0.2)
    session_id = open_session(sessions)
    published = Published()

    async def scenario() -> bool:
        pool = VerifierPool(published)
        book = SessionBook(sessions, pool, published, admit=_admit,
                           quotas=Quotas.from_settings(Settings()), idle_timeout_s=600)  # fmt: skip
        status = m.VerifierStatus(
            verifier_id=VERIFIER, state=m.DeviceState.ONLINE, at=time.time(), max_batch=8,
            heartbeat_s=1.0, leases=True, vocab_size=49152, eos_id=2,
        )  # fmt: skip
        await pool.on_status(VERIFIER, status)
        live = await book.get(str(session_id))
        assert live is not None
        leased = await book._leased_here(live, send_state=True)
        assert live.lease is None
        return leased

    assert asyncio.run(scenario()) is False
    work = [message for topic, message in published.messages
            if topic == verifier_topic(VERIFIER, VerifierChannel.WORK)]  # fmt: skip
    assert [type(message) for message in work] == [m.SessionLease, m.LeaseEnd]
    lease, end = work
    assert isinstance(lease, m.SessionLease) and isinstance(end, m.LeaseEnd)
    assert (end.lease_id, end.session_id) == (lease.lease_id, str(session_id))
