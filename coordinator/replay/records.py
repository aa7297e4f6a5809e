"""A session's stored rounds, read from the database and detached from the ORM."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from broker.messages import Mode
from coordinator.db.engine import read_one_snapshot
from coordinator.db.models import DecodingSession, Round, SessionStatus
from coordinator.runtime.metrics import RoundLegs

if TYPE_CHECKING:
    pass


class TokenKind(str, enum.Enum):
    """Where a committed token came from."""

    ACCEPTED = "accepted"  # drafted, and accepted by the target
    CORRECTED = "corrected"  # the target's token in place of a rejected draft token
    TARGET = "target"  # the target's bonus token after a fully accepted draft, or a plain step
    PROVISIONAL = "provisional"  # drafted offline, shown before the target saw it, then accepted


class ReplayError(Exception):
    """A session that cannot be replayed; the message says why."""


class SessionNotFoundError(ReplayError, LookupError):
    def __init__(self, session_id: uuid.UUID) -> None:
        super().__init__(f"no session {session_id}")
        self.session_id = session_id


@dataclass(frozen=True)
class RoundRecord:
    """One stored round, detached from the ORM."""

    index: int
    base_len: int
    draft_tokens: tuple[int, ...]  # [k]
    draft_model: str | None
    k: int
    n_accepted: int
    next_token: int
    committed_len: int
    provisional: bool
    mode: Mode  # who drafted: the device, or the verifier host (cloud)
    q_ids: tuple[tuple[int, ...], ...] | None  # [k, K]
    q_probs: tuple[tuple[float, ...], ...] | None  # [k, K]
    verifier_id: str | None
    policy: dict[str, Any] | None
    legs: RoundLegs
    created_at: datetime

    @classmethod
    def from_row(cls, row: Round) -> RoundRecord:
        return cls(
            index=row.round_index,
            base_len=row.base_len,
            draft_tokens=tuple(row.draft_tokens),
            draft_model=row.draft_model,
            k=row.k,
            n_accepted=row.n_accepted,
            next_token=row.next_token,
            committed_len=row.committed_len,
            provisional=row.provisional,
            mode=row.mode,
            q_ids=None if row.q_ids is None else tuple(tuple(r) for r in row.q_ids),
            q_probs=None if row.q_probs is None else tuple(tuple(r) for r in row.q_probs),
            verifier_id=row.verifier_id,
            policy=row.policy,
            legs=RoundLegs(
                draft_ms=row.t_draft_ms,
                uplink_ms=row.t_uplink_ms,
                queue_ms=row.t_queue_ms,
                verify_ms=row.t_verify_ms,
                downlink_ms=row.t_downlink_ms,
            ),
            created_at=row.created_at,
        )

    @property
    def committed_tokens(self) -> tuple[int, ...]:
        """What this round committed: the accepted prefix and the target's token, cut where the
        session stopped (an accepted eos, or max_tokens)."""
        tokens = (*self.draft_tokens[: self.n_accepted], self.next_token)
        return tokens[: max(0, self.committed_len - self.base_len)]

    @property
    def rejected_tokens(self) -> tuple[int, ...]:
        """Drafted and not kept: rejected, or past the point where the session stopped."""
        return self.draft_tokens[self.n_accepted + (1 if self.last_is_drafted else 0) :]

    @property
    def last_is_drafted(self) -> bool:
        """The round's last token is the draft's own: the session stopped on it (an accepted eos,
        or max_tokens), so the coordinator stored it as `next_token`. A target's correction is
        never the token it rejected, since p_prime is 0 there."""
        return self.n_accepted < self.k and self.next_token == self.draft_tokens[self.n_accepted]

    @property
    def kinds(self) -> tuple[TokenKind, ...]:
        drafted = TokenKind.PROVISIONAL if self.provisional else TokenKind.ACCEPTED
        if self.last_is_drafted:
            own = drafted
        else:
            own = TokenKind.CORRECTED if self.n_accepted < self.k else TokenKind.TARGET
        kinds = (*([drafted] * self.n_accepted), own)
        return kinds[: len(self.committed_tokens)]

    @property
    def total_ms(self) -> float | None:
        measured = [ms for _, ms in self.legs.items()]
        return sum(measured) if measured else None


@dataclass(frozen=True)
class SessionRecord:
    """One stored session and its rounds in order, detached from the ORM."""

    id: uuid.UUID
    device_id: str
    task_type: str
    prompt: str
    prompt_ids: tuple[int, ...]
    temperature: float
    top_p: float
    seed: int
    max_tokens: int
    mode: Mode
    draft_model: str | None
    k: int
    status: SessionStatus
    committed_ids: tuple[int, ...]  # the generated tokens (the prompt excluded)
    committed_len: int  # prompt plus generated
    created_at: datetime
    finished_at: datetime | None
    rounds: tuple[RoundRecord, ...]

    @classmethod
    def from_rows(cls, row: DecodingSession, rounds: Sequence[Round]) -> SessionRecord:
        return cls(
            id=row.id,
            device_id=row.device_id,
            task_type=row.task_type,
            prompt=row.prompt,
            prompt_ids=tuple(row.prompt_ids),
            temperature=row.temperature,
            top_p=row.top_p,
            seed=row.seed,
            max_tokens=row.max_tokens,
            mode=row.mode,
            draft_model=row.draft_model,
            k=row.k,
            status=row.status,
            committed_ids=tuple(row.committed_ids),
            committed_len=row.committed_len,
            created_at=row.created_at,
            finished_at=row.finished_at,
            rounds=tuple(RoundRecord.from_row(r) for r in rounds),
        )


def load_session(sessions: sessionmaker[Session], session_id: uuid.UUID) -> SessionRecord:
    with sessions() as db:
        read_one_snapshot(db)  # the row and its rounds as of one moment
        row = db.get(DecodingSession, session_id)
        if row is None:
            raise SessionNotFoundError(session_id)
        rounds = db.scalars(
            sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
        ).all()
        return SessionRecord.from_rows(row, rounds)


def find_session(sessions: sessionmaker[Session], prefix: str) -> uuid.UUID:
    """A session id from its full text or a unique prefix of it (as operators copy them)."""
    text = prefix.strip().lower()
    try:
        return uuid.UUID(text)
    except ValueError:
        pass
    if not 4 <= len(text) <= 36 or any(c not in "0123456789abcdef-" for c in text):
        raise ReplayError(f"{prefix!r} is not a session id (a UUID, or 4+ of its first digits)")
    with sessions() as db:
        ids = [
            session_id
            for session_id in db.scalars(sa.select(DecodingSession.id))
            if str(session_id).startswith(text)
        ]
    if not ids:
        raise ReplayError(f"no session id starts with {text!r}")
    if len(ids) > 1:
        raise ReplayError(f"{len(ids)} sessions start with {text!r}; give more of the id")
    return ids[0]
