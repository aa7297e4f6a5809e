"""The sessions' rows: created, loaded, finished, their stored verdicts and their events
(each call runs in a worker thread: the caller hands it to asyncio.to_thread)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from coordinator.db.engine import read_one_snapshot
from coordinator.db.events import append_event
from coordinator.db.models import DecodingSession, Round, SessionStatus, utcnow
from coordinator.runtime.session_state import LiveSession, restore

DEFAULT_K = 4


@dataclass(frozen=True)
class Opening:
    """What a session's open found: the session (stored already, or created now), else why it
    was refused."""

    live: LiveSession | None
    created: bool = False
    refusal: str | None = None


class SessionStore:
    """Sessions in the database, for the session book."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._db = sessions

    def create(
        self,
        device_id: str,
        session_uuid: uuid.UUID,
        request: m.SessionOpen,
        default_draft: str,
    ) -> LiveSession:
        row = DecodingSession(
            id=session_uuid,
            device_id=device_id,
            task_type=request.task_type,
            prompt=request.prompt,
            prompt_ids=list(request.prompt_ids),
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
            seed=request.sampling.seed,
            max_tokens=request.max_tokens,
            # A session that leaves the window to the coordinator starts where its agent does.
            mode=(
                request.mode if request.k or request.mode is m.Mode.PLAIN else m.Mode.DISTRIBUTED
            ),
            draft_model=request.draft_model or default_draft,
            k=request.k or DEFAULT_K,
            status=SessionStatus.ACTIVE,
            committed_ids=[],
            committed_len=len(request.prompt_ids),
        )
        with self._db.begin() as db:
            db.add(row)
            append_event(
                db,
                "session.opened",
                device_id=device_id,
                session_id=session_uuid,
                detail={"task_type": request.task_type, "k": row.k, "draft_model": row.draft_model},
            )
        return LiveSession.from_row(row, next_round=0)

    def open(
        self,
        device_id: str,
        session_uuid: uuid.UUID,
        request: m.SessionOpen,
        default_draft: str,
        *,
        admitted: Callable[[str], bool],
        refusal: str | None,
    ) -> Opening:
        """A session's open in one call (one hop to a thread, where a lookup, the device's
        admission and the insert were three): the stored session when there is one (a resume),
        else a new one unless the device is not `admitted` or the open has a `refusal` (the
        checks the caller made of it as a new session)."""
        stored = self.load(str(session_uuid))
        if stored is not None:
            return Opening(stored)
        if not admitted(device_id):
            return Opening(None, refusal="unregistered device")
        if refusal is not None:
            return Opening(None, refusal=refusal)
        return Opening(self.create(device_id, session_uuid, request, default_draft), created=True)

    def load(self, session_id: str) -> LiveSession | None:
        try:
            session_uuid = uuid.UUID(session_id)
        except ValueError:
            return None
        with self._db() as db:
            read_one_snapshot(db)  # the row and its last round as of one moment
            row = db.get(DecodingSession, session_uuid)
            return None if row is None else restore(db, row)

    def load_active(self) -> list[LiveSession]:
        with self._db() as db:
            read_one_snapshot(db)
            rows = db.scalars(
                sa.select(DecodingSession).where(DecodingSession.status == SessionStatus.ACTIVE)
            ).all()
            return [restore(db, row) for row in rows]

    def rounds_between(self, session_id: str, start: int, end: int) -> list[Round]:
        """The session's stored rounds start..end-1, in order (detached)."""
        with self._db() as db:
            return list(
                db.scalars(
                    sa.select(Round)
                    .where(
                        Round.session_id == uuid.UUID(session_id),
                        Round.round_index >= start,
                        Round.round_index < end,
                    )
                    .order_by(Round.round_index)
                ).all()
            )

    def stored_verdict(self, live: LiveSession, round_index: int) -> m.Verdict | None:
        with self._db() as db:
            row = db.scalar(
                sa.select(Round).where(
                    Round.session_id == uuid.UUID(live.id), Round.round_index == round_index
                )
            )
        if row is None:
            return None
        finished = live.status is SessionStatus.FINISHED and round_index == live.next_round - 1
        return m.Verdict(
            session_id=live.id,
            round=round_index,
            base_len=row.base_len,
            n_accepted=row.n_accepted,
            next_token=row.next_token,
            committed_len=row.committed_len,
            finished=finished,
            policy=m.Policy.model_validate(row.policy) if row.policy else None,
            verifier_id=row.verifier_id or "",
            draft_tokens=tuple(row.draft_tokens) if row.mode is m.Mode.CLOUD else None,
        )

    def finish(
        self, live: LiveSession, status: SessionStatus, reason: str, kind: str | None = None
    ) -> None:
        with self._db.begin() as db:
            row = db.get(DecodingSession, uuid.UUID(live.id))
            if row is not None:
                row.status = status
                row.finished_at = utcnow()
            append_event(
                db,
                kind or f"session.{status.value}",
                device_id=live.device_id,
                session_id=uuid.UUID(live.id),
                detail={"reason": reason},
            )

    def event(self, kind: str, live: LiveSession, detail: dict[str, Any]) -> None:
        with self._db.begin() as db:
            append_event(
                db, kind, device_id=live.device_id, session_id=uuid.UUID(live.id), detail=detail
            )
