"""A session as the coordinator holds it in memory, and as it is rebuilt from the database:
the database row is the truth; the memory holds the round in flight, the lease, the clock."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from broker import messages as m
from coordinator.db.models import DecodingSession, Round, SessionStatus

log = logging.getLogger(__name__)

ADOPTED = "adopted"  # the lease id of a lease learnt from a verifier's heartbeat


@dataclass
class LiveSession:
    """A session as the coordinator holds it in memory; the database row is the truth."""

    id: str
    device_id: str
    prompt_ids: list[int]
    generated: list[int]
    next_round: int
    sampling: m.SamplingSpec
    max_tokens: int
    task_type: str
    policy: m.Policy
    status: SessionStatus
    in_flight_round: int | None = None
    streaming: bool = False  # a host stream of it runs (one at a time)
    # The last device-drafted round: when its draft arrived (coordinator clock), its round, and
    # what verifying it took; the next one's turn beyond compute is measured from them.
    last_draft: tuple[float, int, float] | None = None
    turn_overhead_ms: float | None = None  # of the round being committed, for the policy
    # Direct rounds: the verifier that holds the session's lease, and the lease's id.
    lease: tuple[str, str] | None = None
    # Read back from the database (this process restarted): a verifier may hold a lease that
    # only its heartbeat tells of. A session this process leased or took back knows better.
    adoptable: bool = False
    decision_sent: bool = False  # its verifier has a decision of the policy to record
    # The decision that opened it on the verifier host (Decision.to_json), recorded on its
    # round 0, which its stream runs and no decision follows.
    opening_decision: dict[str, Any] | None = None
    last_verdict: m.Verdict | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    policy_task: str | None = None  # the task type the adaptive policy uses; None: k is fixed
    # The modes the agent runs (SessionOpen.modes): cloud mode only for an agent that streams.
    modes: frozenset[m.Mode] = frozenset({m.Mode.DISTRIBUTED})
    # When the session was last heard of (monotonic): opened, resumed, drafted, a round done.
    last_heard: float = field(default_factory=time.monotonic)

    @property
    def committed_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def state(self, *, streaming: bool = False) -> m.SessionState:
        """What the device is told; `streaming`: that its host stream runs (SessionState)."""
        return m.SessionState(
            session_id=self.id,
            prompt_len=len(self.prompt_ids),
            generated_ids=tuple(self.generated),
            next_round=self.next_round,
            status=self.status.value,
            policy=self.policy,
            streaming=streaming,
        )

    @classmethod
    def from_row(cls, row: DecodingSession, next_round: int) -> LiveSession:
        return cls(
            id=str(row.id),
            device_id=row.device_id,
            prompt_ids=list(row.prompt_ids),
            generated=list(row.committed_ids),
            next_round=next_round,
            sampling=m.SamplingSpec(temperature=row.temperature, top_p=row.top_p, seed=row.seed),
            max_tokens=row.max_tokens,
            task_type=row.task_type,
            policy=m.Policy(
                mode=row.mode,
                draft_model=row.draft_model or "lookup",
                k=row.k,
            ),
            status=row.status,
        )


def busy(live: LiveSession, *, locked: bool = True) -> bool:
    """Whether a session is mid-round (its stream runs, a round is in flight, or, with
    `locked`, a handler holds it): not idle, whatever its clock says."""
    return live.streaming or live.in_flight_round is not None or (locked and live.lock.locked())


def allowed_window(live: LiveSession, row: Round) -> int:
    """The window a round was allowed: a host pass's choice, else the policy's k (an adaptive
    session's first round is the agent's empty window)."""
    chosen = (row.policy or {}).get("pass")
    if isinstance(chosen, dict):
        return int(chosen["k"])
    return live.policy.k if row.round_index > 0 else 0


def restore(db: Session, row: DecodingSession) -> LiveSession:
    """A session as it stood at its last persisted round: the committed tokens, the next round,
    and the policy that round chose. An adaptive session's rounds carry the decision, and with
    it the task type the policy learns under; it stays adaptive after a coordinator restart.
    `db` reads one snapshot (read_one_snapshot), or its last round may be newer than `row`."""
    last = db.scalar(
        sa.select(Round)
        .where(Round.session_id == row.id)
        .order_by(Round.round_index.desc())
        .limit(1)
    )
    live = LiveSession.from_row(row, next_round=0 if last is None else last.round_index + 1)
    live.adoptable = True
    if last is not None and last.policy:
        try:
            live.policy = m.Policy.model_validate(last.policy)
        except ValueError:
            log.warning("session %s: round %d has an unreadable policy", live.id, last.round_index)
        decision = last.policy.get("decision")
        if isinstance(decision, dict) and isinstance(decision.get("task_type"), str):
            live.policy_task = decision["task_type"]
    return live
