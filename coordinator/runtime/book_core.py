"""What every part of the session book shares: its construction, the target's EOS and
vocabulary, sessions by id, and the replies to devices (verdicts, states, refusals)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from broker.topics import DeviceChannel, device_topic
from coordinator.db.models import Round, SessionStatus
from coordinator.db.round_writer import RoundWriter
from coordinator.runtime.draft_fetches import DraftFetches
from coordinator.runtime.policy import AdaptivePolicy
from coordinator.runtime.quotas import Quotas, RateLimiter
from coordinator.runtime.session_state import LiveSession
from coordinator.runtime.session_store import SessionStore
from coordinator.runtime.verifiers import VerifierPool
from inference.artifacts import TargetIdentity

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]
RoundObserver = Callable[["LiveSession", Round], None]


class UnknownTarget(RuntimeError):
    """No verifier has announced the target's EOS, and the coordinator has no manifest of it."""


class BookCore:
    """The session book's state and the helpers its parts share."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        pool: VerifierPool,
        publish: Publish,
        *,
        target: TargetIdentity | None = None,
        admit: Callable[[str], bool],
        quotas: Quotas,
        idle_timeout_s: float,
        vocab_size: int | None = None,
        default_draft: str = "lookup",
    ) -> None:
        self._db = sessions
        self.store = SessionStore(sessions)
        # Whether a device may open sessions (blocking: called in the open's thread).
        self._admit = admit
        self.pool = pool
        self._publish = publish
        # The target as configured here (its manifest), for when no verifier has announced one.
        self.target = target
        self.default_draft = default_draft
        # Active sessions only: a session that ends is let go (the database keeps it).
        self.live: dict[str, LiveSession] = {}
        self.quotas = quotas
        self.idle_timeout_s = idle_timeout_s
        # The target's vocabulary when no live verifier reports it (from its manifest).
        self.vocab_size = vocab_size
        self._open_limit = RateLimiter(quotas.session_opens_per_s, quotas.session_open_burst)
        self._opening: Counter[str] = Counter()  # sessions being created, by device
        self._open_turn = asyncio.Lock()  # SQLite: one open at a time (`SessionBook._open`)
        self.round_observers: list[RoundObserver] = []
        engine = sessions.kw.get("bind")
        if not isinstance(engine, Engine):
            raise TypeError("the session factory must be bound to an engine")
        self._writer = RoundWriter(engine)
        self.policy = AdaptivePolicy()
        # Drafts on demand: sends a device the draft a session asked for and it lacks.
        self.fetches: DraftFetches | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # A shared fleet's fence: whether this coordinator may still act for a device (its
        # shard's lock is held on a live connection). Alone, it always may.
        self.acts_for: Callable[[str], bool] = lambda _device_id: True

    @property
    def eos_id(self) -> int:
        """The target's EOS as its verifiers announce it, else from the configured manifest.

        Work reaches a verifier only after its heartbeat, which names the EOS, so a round never
        waits on this; only a fleet of verifiers that predate it, and no manifest here, fails.
        """
        announced = self.pool.announced_target()
        if announced is not None and announced.eos_id is not None:
            return announced.eos_id
        if self.target is not None:
            return self.target.eos_id
        raise UnknownTarget(
            "the target's EOS is unknown: no verifier announced it and no target manifest here"
        )

    def target_vocab(self) -> str:
        """The target's vocabulary hash, as announced or configured; "" while unknown."""
        announced = self.pool.announced_target()
        if announced is not None and announced.vocab:
            return announced.vocab
        return self.target.vocab_sha256 if self.target is not None else ""

    async def run_writer(self) -> None:
        await self._writer.run()

    async def get(self, session_id: str) -> LiveSession | None:
        """From memory, else from the database (after a coordinator restart)."""
        live = self.live.get(session_id)
        if live is not None:
            return live
        live = await asyncio.to_thread(self.store.load, session_id)
        if live is not None and live.status is SessionStatus.ACTIVE:
            live = self.live.setdefault(session_id, live)  # another load may have won
        return live

    def _let_go(self, live: LiveSession) -> None:
        """An ended session leaves memory, and the policy forgets it."""
        if self.live.get(live.id) is live:
            del self.live[live.id]
        self.policy.forget_session(live.id)

    def can_draft(self, draft_model: str) -> bool:
        """Whether a live verifier drafts cloud rounds with this drafter (True with none live:
        the round then waits for a verifier, as any round does)."""
        live = self.pool.live()
        return not live or any(draft_model in v.status.drafts for v in live)

    def host_drafts(self) -> tuple[str, ...]:
        """The drafters the live verifiers draft cloud rounds with."""
        return tuple(sorted({d for v in self.pool.live() for d in v.status.drafts}))

    def _hosted(self, live: LiveSession) -> bool:
        """Whether the session's next rounds run as a host stream (cloud or plain mode)."""
        policy = live.policy
        if live.status is not SessionStatus.ACTIVE or policy.mode not in m.HOST_MODES:
            return False
        return policy.mode is m.Mode.PLAIN or (policy.k > 0 and self.can_draft(policy.draft_model))

    def _agent_policy(self, live: LiveSession) -> m.Policy:
        """The policy as the agent reads it: plain mode is cloud mode to an agent that predates
        it (both stream; a plain round's window is empty)."""
        policy = live.policy
        if policy.mode is m.Mode.PLAIN and m.Mode.PLAIN not in live.modes:
            return policy.model_copy(update={"mode": m.Mode.CLOUD})
        return policy

    async def _reconciled(
        self, live: LiveSession, round_index: int, tail: tuple[int, ...], n_accepted: int, last: int
    ) -> None:
        """Log what the target kept of a provisional tail (the stop rules may end the output on
        one of its tokens, which then comes as the round's next token)."""
        confirmed = n_accepted
        if confirmed < len(tail) and last == tail[confirmed]:
            confirmed += 1
        await asyncio.to_thread(
            self.store.event,
            "session.reconciled",
            live,
            {
                "round": round_index,
                "provisional": len(tail),
                "kept": confirmed,
                "replaced": len(tail) - confirmed,
            },
        )

    async def _send_verdict(self, live: LiveSession, verdict: m.Verdict) -> None:
        """Publish a verdict stamped as it leaves; the agent's next draft reports its downlink."""
        stamped = verdict.model_copy(update={"sent_at": time.time()})
        await self._publish(device_topic(live.device_id, DeviceChannel.VERDICT), m.encode(stamped))

    async def _send_state(self, live: LiveSession, *, streaming: bool = False) -> None:
        state = m.encode(live.state(streaming=streaming))
        await self._publish(device_topic(live.device_id, DeviceChannel.VERDICT), state)

    async def _error(
        self,
        device_id: str,
        refused: m.Refused,
        session_id: str | None,
        round_index: int | None,
        reason: str,
    ) -> None:
        log.warning(
            "refused %s from %s (session %s round %s): %s",
            refused,
            device_id,
            session_id,
            round_index,
            reason,
        )
        reply = m.ErrorReply(
            refused_type=refused, session_id=session_id, round=round_index, reason=reason
        )
        await self._publish(device_topic(device_id, DeviceChannel.VERDICT), m.encode(reply))
