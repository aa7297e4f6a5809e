"""The database check every end-to-end test makes of a finished session."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from coordinator.db.models import DecodingSession, Round, SessionStatus


def assert_rounds_rebuild(
    db: Session, session_id: str | uuid.UUID, token_ids: Sequence[int]
) -> tuple[DecodingSession, list[Round]]:
    """The session finished; its rounds are contiguous from 0, each starts where the one before
    left off, and together they rebuild the committed tokens, which the caller received: no
    token lost, none duplicated. Returns the session and its rounds."""
    session_uuid = session_id if isinstance(session_id, uuid.UUID) else uuid.UUID(session_id)
    session = db.get(DecodingSession, session_uuid)
    assert session is not None
    assert session.status is SessionStatus.FINISHED
    rounds = list(
        db.scalars(
            sa.select(Round).where(Round.session_id == session_uuid).order_by(Round.round_index)
        )
    )
    assert [r.round_index for r in rounds] == list(range(len(rounds)))
    rebuilt: list[int] = []
    for r in rounds:
        assert r.base_len == len(session.prompt_ids) + len(rebuilt)
        rebuilt += [*r.draft_tokens[: r.n_accepted], r.next_token]
        assert r.committed_len == len(session.prompt_ids) + len(rebuilt)
    assert rebuilt == session.committed_ids == list(token_ids)
    return session, rounds
