"""Where an adaptive session opens: rated against the sessions open beside it.

A wave of sessions opens within milliseconds, before any has sent a round, so the verifiers'
reported load is 0 for every one of them. The opening decision counts the active sessions of
the book beside the new one (and those of them in a host mode, as the streams its device windows
would hold up), so the last session of a wave opens as the fleet will be, not as if alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from broker import messages as m
from coordinator.db.models import SessionStatus
from coordinator.runtime.adaptation import AdaptiveBook
from coordinator.runtime.quotas import Quotas
from coordinator.runtime.session_state import LiveSession
from coordinator.runtime.verifiers import VerifierPool
from core.settings import Settings


async def _publish(topic: str, payload: bytes) -> None:
    raise AssertionError(f"an opening decision publishes nothing ({topic})")


async def _admit(device_id: str) -> bool:
    return True


def _book(tmp_path: Path) -> AdaptiveBook:
    engine = create_engine(f"sqlite:///{tmp_path / 'opening.sqlite'}")
    pool = VerifierPool(_publish)
    status = m.VerifierStatus(
        verifier_id="v1", state=m.DeviceState.ONLINE, at=1_000.0, max_batch=32, drafts=("hybrid",)
    )
    asyncio.run(pool.on_status("v1", status))
    return AdaptiveBook(
        sessionmaker(bind=engine),
        pool,
        _publish,
        admit=_admit,
        quotas=Quotas.from_settings(Settings()),
        idle_timeout_s=60.0,
    )


def _session(index: int, mode: m.Mode = m.Mode.DISTRIBUTED) -> LiveSession:
    live = LiveSession(
        id=f"session-{index}",
        device_id=f"phone-{index}",
        prompt_ids=[1, 2, 3],
        generated=[],
        next_round=0,
        sampling=m.SamplingSpec(),
        max_tokens=64,
        task_type="chat",
        policy=m.Policy(mode=mode, draft_model="hybrid", k=0),
        status=SessionStatus.ACTIVE,
    )
    live.policy_task = "chat"
    live.modes = frozenset({m.Mode.DISTRIBUTED, m.Mode.CLOUD, m.Mode.PLAIN})
    return live


def _opening(book: AdaptiveBook, index: int) -> m.Policy:
    live = _session(index)
    book._open_where_best(live)
    book.live[live.id] = live
    return live.policy


def test_a_lone_session_and_the_last_of_a_wave_open_differently(tmp_path: Path) -> None:
    book = _book(tmp_path)
    alone = _opening(book, 0)
    assert book._opening_beside("session-new") == (1.0, float(alone.mode in m.HOST_MODES))
    for index in range(1, 31):
        _opening(book, index)
    last = _opening(book, 31)
    # Nothing was reported by the verifier in between: only the book's sessions differ.
    assert book.pool.live()[0].load == 0
    assert alone.mode is m.Mode.CLOUD and alone.k > 0, alone
    assert last.mode is m.Mode.PLAIN or last.k < alone.k, last


def test_only_active_sessions_of_the_book_count_beside_a_new_one(tmp_path: Path) -> None:
    book = _book(tmp_path)
    for index, mode in enumerate([m.Mode.CLOUD, m.Mode.PLAIN, m.Mode.DISTRIBUTED]):
        live = _session(index, mode)
        book.live[live.id] = live
    ended = _session(9, m.Mode.CLOUD)
    ended.status = SessionStatus.FINISHED
    book.live[ended.id] = ended
    # Three active beside it, two of them on the host; the session itself never counts.
    assert book._opening_beside("session-new") == (3.0, 2.0)
    assert book._opening_beside("session-0") == (2.0, 1.0)
