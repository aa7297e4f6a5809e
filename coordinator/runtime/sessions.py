"""Decoding sessions: open and resume, validate drafts, verify, apply stop rules, persist, reply.

Persist before publish: a round and the session's committed tokens are written in one
transaction before its verdict leaves, so a device never holds a token the database cannot
reproduce. A crash between the two loses only the publication; the re-sent draft then finds the
stored round and gets the same verdict back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from broker.client import BusConnectionError
from broker.topics import DeviceChannel, device_topic
from coordinator.db.events import EventKind, append_event
from coordinator.db.models import DecodingSession, Round, SessionMode, SessionStatus, utcnow
from coordinator.db.round_writer import RoundWriter
from coordinator.runtime.policy import (
    CLOUD_STREAM_ROUNDS,
    STREAM_DECISION_EVERY,
    AdaptivePolicy,
    RoundObservation,
    opening_candidate,
    resolve_task,
    verifier_load,
)
from coordinator.runtime.quotas import Quotas, RateLimiter
from coordinator.runtime.verifiers import (
    NoVerifierError,
    StreamLost,
    VerificationFailed,
    VerifierPool,
)
from inference.artifacts import TargetIdentity
from inference.speculative import apply_stop_rules

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]
RoundObserver = Callable[["LiveSession", Round], None]

DEFAULT_K = 4
# Host streams of a session that may break off in a row (a verifier dies, the bus drops) before
# its device is told to ask again.
STREAM_ATTEMPTS = 4
ADOPTED = "adopted"  # the lease id of a lease learnt from a verifier's heartbeat
# How often idle sessions are looked for (at most; a short idle timeout looks more often), and
# finished ones still in memory let go.
SWEEP_INTERVAL_S = 5.0


class UnknownTarget(RuntimeError):
    """No verifier has announced the target's EOS, and the coordinator has no manifest of it."""


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

    def state(self) -> m.SessionState:
        return m.SessionState(
            session_id=self.id,
            prompt_len=len(self.prompt_ids),
            generated_ids=tuple(self.generated),
            next_round=self.next_round,
            status=self.status.value,
            policy=self.policy,
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
                mode=m.Mode(row.mode.value),
                draft_model=row.draft_model or "lookup",
                k=row.k,
            ),
            status=row.status,
        )


class SessionBook:
    """Every session's lifecycle on the coordinator side."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        pool: VerifierPool,
        publish: Publish,
        *,
        target: TargetIdentity | None = None,
        admit: Callable[[str], Awaitable[bool]],
        quotas: Quotas,
        idle_timeout_s: float,
        vocab_size: int | None = None,
        default_draft: str = "lookup",
    ) -> None:
        self._db = sessions
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
        self.round_observers: list[RoundObserver] = []
        engine = sessions.kw.get("bind")
        if not isinstance(engine, Engine):
            raise TypeError("the session factory must be bound to an engine")
        self._writer = RoundWriter(engine)
        self.policy = AdaptivePolicy()
        self._tasks: set[asyncio.Task[None]] = set()
        pool.lost_observers.append(self.on_verifier_lost)

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

    async def run_sweeper(self) -> None:
        """End idle sessions, and let go of ended ones, until cancelled."""
        while True:
            await asyncio.sleep(min(SWEEP_INTERVAL_S, self.idle_timeout_s / 4))
            try:
                await self.sweep()
            except Exception:
                # The database may be briefly away; the next sweep tries again.
                log.exception("session sweep failed")

    async def sweep(self) -> None:
        now = time.monotonic()
        for live in list(self.live.values()):
            if live.status is not SessionStatus.ACTIVE:
                self._let_go(live)
            elif now - live.last_heard >= self.idle_timeout_s and not _busy(live):
                await self._expire(live, now - live.last_heard)

    def open_sessions(self, device_id: str) -> int:
        """The device's active sessions, and those being opened."""
        held = sum(
            1
            for live in self.live.values()
            if live.device_id == device_id and live.status is SessionStatus.ACTIVE
        )
        return held + self._opening[device_id]

    def _let_go(self, live: LiveSession) -> None:
        """An ended session leaves memory, and the policy forgets it."""
        if self.live.get(live.id) is live:
            del self.live[live.id]
        self.policy.forget_session(live.id)

    async def _expire(self, live: LiveSession, idle_s: float) -> None:
        """An idle session ends (cancelled, with a `session.expired` event); its device is told."""
        async with live.lock:
            if live.status is not SessionStatus.ACTIVE or _busy(live, locked=False):
                return
            await self._unlease(live)  # what its verifier persisted stands
            if live.status is SessionStatus.ACTIVE:
                live.status = SessionStatus.CANCELLED
                reason = f"idle for {idle_s:.0f}s (timeout {self.idle_timeout_s:g}s)"
                log.info("session %s expired: %s", live.id, reason)
                await asyncio.to_thread(
                    self._finish,
                    live,
                    SessionStatus.CANCELLED,
                    reason,
                    EventKind.SESSION_EXPIRED.value,
                )
        self._let_go(live)
        try:
            await self._send_state(live)
        except (ConnectionError, BusConnectionError, m.BusError) as exc:
            log.warning("could not tell %s of the expiry of %s: %s", live.device_id, live.id, exc)

    def _open_refusal(self, device_id: str, request: m.SessionOpen) -> str | None:
        """Why a new session may not open (a quota, a prompt the target cannot read), or None."""
        quotas = self.quotas
        if len(request.prompt_ids) > quotas.max_prompt_tokens:
            return (
                f"prompt of {len(request.prompt_ids)} tokens exceeds the quota of "
                f"{quotas.max_prompt_tokens}"
            )
        target_vocab = self.target_vocab()
        if request.vocab and target_vocab and request.vocab != target_vocab:
            return (
                f"the session's vocabulary ({request.vocab[:12]}) is not the target's "
                f"({target_vocab[:12]}): its drafter and tokenizer belong to another target"
            )
        vocab_size = self.pool.vocab_size() or self.vocab_size
        highest = max(request.prompt_ids)
        if vocab_size is not None and highest >= vocab_size:
            return (
                f"prompt token id {highest} is outside the target's vocabulary "
                f"(ids 0..{vocab_size - 1})"
            )
        if self.open_sessions(device_id) >= quotas.max_open_sessions:
            return (
                f"the device has {quotas.max_open_sessions} sessions open, its quota: "
                "close one first"
            )
        return None

    # --- sessions -----------------------------------------------------------------------------

    async def on_session_open(self, device_id: str, request: m.SessionOpen) -> None:
        try:
            session_uuid = uuid.UUID(request.session_id)
        except ValueError:
            await self._error(
                device_id, "session_open", request.session_id, None, "session_id must be a UUID"
            )
            return
        # A resume of a live session is answered from memory and never refused for the rate:
        # refusing it would fail a session the device is running. Anything else (a new session,
        # or one the database must be read for) counts against the device's open rate.
        resuming = self.live.get(request.session_id)
        live_resume = resuming is not None and resuming.device_id == device_id
        if not live_resume and not self._open_limit.allow(device_id):
            limit = self._open_limit
            reason = f"session opens over quota ({limit.rate:g}/s, burst {limit.burst})"
            await self._error(device_id, "session_open", request.session_id, None, reason)
            return
        live = await self.get(request.session_id)
        if live is None:
            if not await self._admit(device_id):
                await self._error(
                    device_id, "session_open", request.session_id, None, "unregistered device"
                )
                return
            refusal = self._open_refusal(device_id, request)
            if refusal is not None:
                await self._error(device_id, "session_open", request.session_id, None, refusal)
                return
            self._opening[device_id] += 1
            try:
                live = await asyncio.to_thread(self._create, device_id, session_uuid, request)
            finally:
                self._opening[device_id] -= 1
                if not self._opening[device_id]:
                    del self._opening[device_id]
            live.modes = frozenset({*request.modes, request.mode})
            # No window asked for: the coordinator chooses, round by round (plain mode asks for
            # no window and wants none).
            if request.k == 0 and request.mode is not m.Mode.PLAIN:
                live.policy_task = resolve_task(request.task_type, request.prompt)
                if live.modes & m.HOST_MODES:
                    self._open_where_best(live)
            self.live[live.id] = live
            log.info(
                "session %s opened on %s (k=%d, draft %s)",
                live.id,
                device_id,
                live.policy.k,
                live.policy.draft_model,
            )
        elif live.device_id != device_id:
            await self._error(
                device_id,
                "session_open",
                request.session_id,
                None,
                "the session belongs to another device",
            )
            return
        else:
            live.last_heard = time.monotonic()
            log.info("session %s resumed by %s at round %d", live.id, device_id, live.next_round)
            live.modes = frozenset({*request.modes, request.mode, live.policy.mode})
            detail: dict[str, Any] = {"next_round": live.next_round}
            if request.resume is not None:
                detail["reason"] = request.resume.value
            await asyncio.to_thread(self._event, "session.resumed", live, detail)
        if request.fallback is not None:
            # The device generated alone while it could not reach us; its provisional tail
            # follows as one long draft.
            log.info(
                "session %s: %s generated %d provisional tokens in %.1fs offline",
                live.id,
                device_id,
                request.fallback.provisional_tokens,
                request.fallback.offline_s,
            )
            await asyncio.to_thread(
                self._event, "session.fallback", live, request.fallback.model_dump(mode="json")
            )
        if await self._leased_here(live, send_state=True):
            return  # the holder tells the device where the session stands
        await self._send_state(live)

    async def on_session_close(self, device_id: str, request: m.SessionClose) -> None:
        live = await self.get(request.session_id)
        if live is None or live.device_id != device_id:
            await self._error(
                device_id, "session_close", request.session_id, None, "unknown session"
            )
            return
        async with live.lock:
            await self._unlease(live)
            if live.status is SessionStatus.ACTIVE:
                live.status = SessionStatus.CANCELLED
                await asyncio.to_thread(self._finish, live, SessionStatus.CANCELLED, request.reason)
        self._let_go(live)
        await self._send_state(live)

    async def get(self, session_id: str) -> LiveSession | None:
        """From memory, else from the database (after a coordinator restart)."""
        live = self.live.get(session_id)
        if live is not None:
            return live
        live = await asyncio.to_thread(self._load, session_id)
        if live is not None and live.status is SessionStatus.ACTIVE:
            live = self.live.setdefault(session_id, live)  # another load may have won
        return live

    async def rebuild(self, owned: Callable[[str], bool] | None = None) -> list[LiveSession]:
        """After a coordinator restart: every active session back in memory from the database,
        each device told its session's state (a draft lost with the old process is re-sent).
        `owned(device_id)`: only those devices' sessions (shards taken over from a peer)."""
        rebuilt = await asyncio.to_thread(self._load_active)
        if owned is not None:
            rebuilt = [live for live in rebuilt if owned(live.device_id)]
        for live in rebuilt:
            self.live.setdefault(live.id, live)
        if rebuilt:
            log.info("rebuilt %d active sessions from the database", len(rebuilt))
        return rebuilt

    async def announce(self, sessions: list[LiveSession]) -> None:
        """Send each session's state to its device; a failed send is retried by the device."""
        for live in sessions:
            if self._holder(live) is not None:
                continue  # its verifier holds it and answers its device meanwhile
            try:
                await self._send_state(live)
            except (ConnectionError, BusConnectionError, m.BusError) as exc:
                log.warning("could not send the state of session %s: %s", live.id, exc)

    def set_k(self, session_id: str, k: int) -> None:
        """The settable, fixed window of a session; the next verdict carries it."""
        live = self.live[session_id]
        live.policy = live.policy.model_copy(update={"k": k})

    # --- rounds -------------------------------------------------------------------------------

    async def on_draft(self, device_id: str, draft: m.Draft) -> None:
        received_at = time.time()
        live = await self.get(draft.session_id)
        if live is None or live.device_id != device_id:
            await self._error(device_id, "draft", draft.session_id, draft.round, "unknown session")
            return
        live.last_heard = time.monotonic()
        if not draft.cloud and self._holder(live) is not None:
            return  # a direct round: the verifier holding the lease answers it
        async with live.lock:
            if draft.cloud:
                await self._unlease(live)  # the coordinator runs a host stream itself
            elif self._holder(live) is not None:
                return
            if draft.round < live.next_round:
                await self._resend_verdict(live, draft)
                return
            if live.status is not SessionStatus.ACTIVE:
                await self._error(
                    device_id, "draft", live.id, draft.round, f"session is {live.status.value}"
                )
                await self._send_state(live)
                return
            misfit = draft.misfit(
                live.next_round,
                live.committed_len,
                live.sampling.greedy,
                self.pool.vocab_size() or self.vocab_size,
            )
            if misfit is not None:
                await self._error(device_id, "draft", live.id, draft.round, misfit)
                if draft.round != live.next_round or draft.base_len != live.committed_len:
                    await self._send_state(live)  # out of step: the state resynchronises it
                return
            if draft.cloud and live.streaming:
                # Re-sent while its stream runs (the agent timed out): the state catches it up.
                await self._send_state(live)
                return
            plain = live.policy.mode is m.Mode.PLAIN
            if draft.cloud and not plain and not self.can_draft(draft.draft_model):
                await self._error(
                    device_id,
                    "draft",
                    live.id,
                    draft.round,
                    f"no live verifier drafts cloud rounds with {draft.draft_model!r}",
                )
                return
            live.in_flight_round = draft.round
            try:
                if draft.cloud:
                    # A cloud request: the verifier host runs the rounds from this one on.
                    if live.policy.mode not in m.HOST_MODES:
                        live.policy = live.policy.model_copy(
                            update={
                                "mode": m.Mode.CLOUD,
                                "draft_model": draft.draft_model,
                                "k": draft.cloud_k or live.policy.k,
                            }
                        )
                    goes_on = True
                else:
                    goes_on = await self._verify_and_commit(live, draft, received_at)
            finally:
                live.in_flight_round = None
        if goes_on and not live.streaming:
            live.streaming = True
            try:
                await self._host_stream(live)
            finally:
                live.streaming = False

    # --- direct rounds ------------------------------------------------------------------------

    def _holder(self, live: LiveSession) -> str | None:
        """The live verifier answering the session's drafts, if one holds its lease. A lease
        this coordinator does not know of (it restarted) is learnt from the heartbeats."""
        if live.lease is None and live.adoptable:
            holder = self.pool.holder(live.id)
            if holder is None:
                return None
            live.lease = (holder, ADOPTED)
        if live.lease is None:
            return None
        holder, lease_id = live.lease
        if lease_id == ADOPTED and self.pool.holder(live.id) != holder:
            live.lease = None  # its heartbeat no longer lists it: given back, or finished
            return None
        if self.pool.is_alive(holder):
            return holder
        return None

    async def _leased_here(self, live: LiveSession, *, send_state: bool = False) -> bool:
        """Lease an active distributed session to a verifier that takes leases, or update the
        lease it has; True when a verifier holds it (and, with send_state, tells the device)."""
        if live.status is not SessionStatus.ACTIVE or live.policy.mode is not m.Mode.DISTRIBUTED:
            return False
        async with live.lock:
            if live.streaming:
                return False
            holder = self._holder(live)
            if holder is not None:
                lease = self._lease_message(live, live.lease[1] if live.lease else ADOPTED)
                await self.pool.tell(holder, lease.model_copy(update={"send_state": send_state}))
                return True
            if live.lease is not None:  # its verifier died: what it persisted stands
                await self._reload(live)
            info = self.pool.lessor(live.id)
            if info is None:
                return False
            lease = self._lease_message(live, secrets.token_hex(8))
            try:
                ack = await self.pool.lease(
                    info.verifier_id, lease.model_copy(update={"send_state": send_state})
                )
            except (TimeoutError, asyncio.TimeoutError, ConnectionError, BusConnectionError):
                log.warning("verifier %s did not take session %s", info.verifier_id, live.id)
                return False
            if not ack.held:
                log.info("verifier %s refused session %s: %s", ack.verifier_id, live.id, ack.reason)
                return False
            live.lease = (info.verifier_id, lease.lease_id)
            live.adoptable = False
            log.info("session %s leased to verifier %s", live.id, info.verifier_id)
            return True

    def _lease_message(self, live: LiveSession, lease_id: str) -> m.SessionLease:
        return m.SessionLease(
            lease_id=lease_id,
            session_id=live.id,
            device_id=live.device_id,
            prompt_len=len(live.prompt_ids),
            context_ids=tuple(live.prompt_ids + live.generated),
            next_round=live.next_round,
            sampling=live.sampling,
            max_tokens=live.max_tokens,
            eos_id=self.eos_id,
            policy=self._agent_policy(live),
        )

    async def _unlease(self, live: LiveSession) -> None:
        """Take a leased session back (the caller holds its lock): the verifier answers after
        the round it has in flight, and the session goes on from what the database holds."""
        if live.lease is None:
            return
        holder, lease_id = live.lease
        live.lease = None
        live.adoptable = False
        if self.pool.is_alive(holder):
            end = m.LeaseEnd(lease_id=lease_id, session_id=live.id)
            try:
                await self.pool.lease(holder, end)
            except (TimeoutError, asyncio.TimeoutError, ConnectionError, BusConnectionError):
                log.warning("verifier %s did not give session %s back in time", holder, live.id)
        await self._reload(live)

    async def _reload(self, live: LiveSession) -> None:
        """The session's committed tokens and next round as the database holds them."""
        stored = await asyncio.to_thread(self._load, live.id)
        live.lease = None
        if stored is None:
            return
        live.generated = stored.generated
        live.next_round = stored.next_round
        if live.status is SessionStatus.ACTIVE:
            live.status = stored.status
        live.last_verdict = None
        live.last_draft = None

    def on_verifier_lost(self, verifier_id: str) -> None:
        """The sessions a dead verifier held: leased again (or answered here), devices told."""
        for live in list(self.live.values()):
            if live.lease is not None and live.lease[0] == verifier_id:
                task = asyncio.create_task(self._take_over(live), name=f"take-over-{live.id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _take_over(self, live: LiveSession) -> None:
        async with live.lock:
            await self._reload(live)
        log.warning("session %s: its verifier died; taking it over", live.id)
        if not await self._leased_here(live, send_state=True):
            await self._send_state(live)

    async def on_round_done(self, verifier_id: str, done: m.RoundDone) -> None:
        """A direct round, persisted and answered by the verifier holding the session."""
        live = await self.get(done.session_id)
        if live is None:
            return
        live.last_heard = time.monotonic()
        async with live.lock:
            if done.round < live.next_round:
                return  # already known (a re-sent report)
            if done.round > live.next_round or done.base_len != live.committed_len:
                await self._reload(live)  # reports were lost: the database has them all
                live.lease = (verifier_id, done.lease_id)
            else:
                live.generated = live.generated + list(done.committed)
                live.next_round = done.round + 1
                if done.finished:
                    live.status = SessionStatus.FINISHED
            if done.finished:
                live.lease = None
            row = self._done_row(live, done)
            if live.policy_task is not None and not done.provisional and not done.finished:
                live.turn_overhead_ms = done.overhead_ms
                before = live.policy
                live.policy, record = self._adapt(live, row, done.batch_prefilled > 0)
                # A decision that changes nothing stays here: the one in force is recorded.
                if live.policy != before or not live.decision_sent:
                    await self._repolicy(live, record)
                    live.decision_sent = True
            live.last_verdict = None
        for observe in self.round_observers:
            observe(live, row)
        if done.provisional:
            tail = tuple(done.committed[:-1])  # what is known of it: the kept prefix
            await self._reconciled(live, done.round, tail, done.n_accepted, done.committed[-1])
        if done.finished:
            self._let_go(live)
            log.info(
                "session %s finished: %d tokens in %d rounds",
                live.id,
                len(live.generated),
                live.next_round,
            )

    async def _repolicy(self, live: LiveSession, record: dict[str, Any]) -> None:
        """A new decision after a direct round: its verifier's next verdicts carry it and its
        rounds record it until the next (the policy runs off the round's path, so it is a round
        or two behind); a host mode takes the session back (the device's next draft then comes
        here, and its verdict starts the stream)."""
        holder = self._holder(live)
        if holder is None:
            return
        if live.policy.mode is not m.Mode.DISTRIBUTED:
            await self._unlease(live)
            # Its next draft may have reached neither (the verifier gave the session back, and
            # here it was still leased): the state makes the device send it again, here.
            await self._send_state(live)
            return
        assert live.lease is not None
        lease = self._lease_message(live, live.lease[1])
        await self.pool.tell(holder, lease.model_copy(update={"policy_record": record}))

    def _done_row(self, live: LiveSession, done: m.RoundDone) -> Round:
        """The round as the verifier stored it, for the policy and the observers."""
        return Round(
            session_id=uuid.UUID(live.id),
            round_index=done.round,
            base_len=done.base_len,
            draft_tokens=list(done.committed[: done.n_accepted]),
            draft_model=done.draft_model,
            provisional=done.provisional,
            k=done.drafted,
            mode=SessionMode.DISTRIBUTED,
            n_accepted=done.n_accepted,
            next_token=done.committed[-1],
            committed_len=done.base_len + len(done.committed),
            verifier_id=done.verifier_id,
            policy=self._agent_policy(live).model_dump(mode="json"),
            t_draft_ms=done.t_draft_ms,
            t_uplink_ms=done.t_uplink_ms,
            t_queue_ms=done.t_queue_ms,
            t_verify_ms=done.t_verify_ms,
        )

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

    async def _verify_and_commit(
        self, live: LiveSession, draft: m.Draft, received_at: float
    ) -> bool:
        """Verify one device-drafted round, persist it, publish its verdict; True when the
        session goes on as a host stream."""
        request = m.VerifyRequest(
            request_id="pending",
            session_id=live.id,
            round=draft.round,
            context_ids=tuple(live.prompt_ids + live.generated),
            tokens=draft.tokens,
            q_ids=draft.q_ids,
            q_probs=draft.q_probs,
            sampling=live.sampling,
            want_features=draft.want_features,
        )
        queued_at = time.perf_counter()
        try:
            result = await self.pool.verify(request)
        except (NoVerifierError, VerificationFailed) as exc:
            # Nothing was committed; the agent re-sends this round when it hears the state.
            log.error("round %d of %s not verified: %s", draft.round, live.id, exc)
            await self._error(live.device_id, "draft", live.id, draft.round, f"not verified: {exc}")
            return False
        round_trip_ms = (time.perf_counter() - queued_at) * 1000.0
        uplink_ms = max(0.0, (received_at - draft.timings.sent_at) * 1000.0)
        live.turn_overhead_ms = None
        if live.last_draft is not None and live.last_draft[1] == draft.round - 1:
            at, _, verify_ms = live.last_draft
            turn_ms = (received_at - at) * 1000.0
            live.turn_overhead_ms = max(0.0, turn_ms - verify_ms - draft.timings.draft_ms)
        live.last_draft = (received_at, draft.round, result.verify_ms)
        row = self._round_row(live, draft.round, draft.base_len, result)
        row.draft_tokens = list(draft.tokens)
        row.draft_model = draft.draft_model
        row.provisional = draft.provisional
        row.q_ids = [list(r) for r in draft.q_ids] if draft.q_ids else None
        row.q_probs = [list(r) for r in draft.q_probs] if draft.q_probs else None
        row.k = len(draft.tokens)
        row.mode = SessionMode.DISTRIBUTED
        row.t_draft_ms = draft.timings.draft_ms
        row.t_uplink_ms = uplink_ms if draft.timings.sent_at else None
        # Everything between handing the draft to the pool and the verifier's compute:
        # transport both ways and the verifier's own queue.
        row.t_queue_ms = max(0.0, round_trip_ms - result.verify_ms)
        return await self._commit(
            live, row, result, draft.tokens, draft.timings.downlink_ms, draft.provisional
        )

    async def _host_stream(self, live: LiveSession) -> None:
        """Run the session on the verifier host while its policy says cloud or plain: each
        stream's rounds are persisted and published one by one as they come, while the verifier
        already runs the next. A stream that breaks off opens again from the last persisted
        round (a result never persisted is computed again, identically)."""
        failures = 0
        while self._hosted(live) and failures < STREAM_ATTEMPTS:
            request = self._stream_request(live)
            stream = self.pool.stream(request)
            try:
                async for result in stream:
                    async with live.lock:
                        if live.next_round != result.round or not self._hosted(live):
                            return  # closed, moved back to distributed, or taken over
                        live.in_flight_round = result.round
                        try:
                            goes_on = await self._commit_streamed(live, request, result)
                        finally:
                            live.in_flight_round = None
                    failures = 0
                    if not goes_on:
                        return
            except StreamLost as exc:
                failures += 1
                log.warning("stream of %s broke off at round %d: %s", live.id, live.next_round, exc)
            except NoVerifierError as exc:
                log.error("no verifier for the stream of %s: %s", live.id, exc)
                failures = STREAM_ATTEMPTS
            finally:
                await stream.aclose()
        if self._hosted(live):
            # The agent re-sends its cloud request when it hears the state.
            await self._error(
                live.device_id, "draft", live.id, live.next_round, "the host stream broke off"
            )
            await self._send_state(live)

    def _stream_request(self, live: LiveSession) -> m.VerifyRequest:
        policy = live.policy
        cloud_k = min(policy.k, m.MAX_CLOUD_K) if policy.mode is m.Mode.CLOUD else 0
        if live.policy_task is not None and cloud_k:
            # The verifier chooses each pass's window for its whole batch, with what it sees
            # of the batch and of the drafter: the policy's k is a per-session guess, and a cap
            # at it kept a lone session's windows at 1-3 where 8 paid.
            cloud_k = max(cloud_k, self.policy.k_max)
        alpha = None
        if live.policy_task is not None and cloud_k:
            alpha = self.policy.alpha(live.device_id, policy.draft_model, live.policy_task)
        return m.VerifyRequest(
            request_id="pending",
            session_id=live.id,
            round=live.next_round,
            context_ids=tuple(live.prompt_ids + live.generated),
            tokens=(),
            sampling=live.sampling,
            cloud_draft=policy.draft_model if cloud_k else None,
            cloud_k=cloud_k or None,
            stream=m.StreamSpec(
                rounds=CLOUD_STREAM_ROUNDS,
                max_new=max(1, live.max_tokens - len(live.generated)),
                eos_id=self.eos_id,
                task_type=live.policy_task or live.task_type or "chat",
                alpha=alpha,
                adaptive=live.policy_task is not None,
            ),
        )

    async def _commit_streamed(
        self, live: LiveSession, request: m.VerifyRequest, result: m.VerifyResult
    ) -> bool:
        drafted = result.draft_tokens or ()
        row = self._round_row(live, result.round, result.base_len, result)
        row.draft_tokens = list(drafted)
        row.draft_model = request.cloud_draft if drafted else None
        row.q_ids = [list(r) for r in result.q_ids] if result.q_ids else None
        row.q_probs = [list(r) for r in result.q_probs] if result.q_probs else None
        window = result.pass_choice.k if result.pass_choice is not None else len(drafted)
        adaptive = request.stream is None or request.stream.adaptive
        row.k = len(drafted)
        # Plain: no drafter was asked for, or the pass chose none (a fixed window cut to 0 at
        # the end of the output is still the session's cloud mode).
        plain = request.cloud_draft is None or (adaptive and window == 0)
        row.mode = SessionMode.PLAIN if plain else SessionMode.CLOUD
        row.t_draft_ms = result.draft_ms
        row.t_queue_ms = result.queue_ms
        if result.pass_choice is not None:
            row.policy = {"pass": result.pass_choice.model_dump(mode="json")}
        return await self._commit(live, row, result, drafted, None, False)

    def _round_row(
        self, live: LiveSession, round_index: int, base_len: int, result: m.VerifyResult
    ) -> Round:
        return Round(
            session_id=uuid.UUID(live.id),
            round_index=round_index,
            base_len=base_len,
            verifier_id=result.verifier_id,
            t_verify_ms=result.verify_ms,
            t_downlink_ms=None,
            n_accepted=result.n_accepted,
            next_token=result.next_token if result.next_token is not None else 0,
            committed_len=base_len,
        )

    async def _commit(
        self,
        live: LiveSession,
        row: Round,
        result: m.VerifyResult,
        drafted: tuple[int, ...],
        downlink_ms: float | None,
        provisional: bool,
    ) -> bool:
        """Apply the stop rules to a verified round, persist it, then publish its verdict.
        True when the session goes on as a host stream."""
        accepted = list(drafted[: result.n_accepted])
        next_token = result.next_token if result.next_token is not None else accepted.pop()
        kept, finished = apply_stop_rules(
            len(live.generated), accepted, next_token, live.max_tokens, self.eos_id
        )
        n_accepted = len(kept) - 1
        row.n_accepted = n_accepted
        row.next_token = kept[-1]
        row.committed_len = row.base_len + len(kept)
        pass_choice = (row.policy or {}).get("pass")
        # A provisional tail is no window the policy chose: it teaches the policy nothing.
        if live.policy_task is not None and not provisional:
            live.policy, row.policy = self._adapt(live, row, result.batch_prefilled > 0)
        else:
            row.policy = live.policy.model_dump(mode="json")
        if pass_choice is not None:
            row.policy = {**row.policy, "pass": pass_choice}
        generated = live.generated + kept
        status = SessionStatus.FINISHED if finished else SessionStatus.ACTIVE
        try:
            await self._writer.write(
                row, generated, status, device_id=live.device_id, downlink_ms=downlink_ms
            )
        except sa.exc.IntegrityError:
            # Someone else answered this round (a verifier holding a lease this coordinator
            # had not heard of yet): the stored round is the answer.
            log.warning("round %d of %s was already stored; resending it", row.round_index, live.id)
            await self._reload(live)
            await self._send_state(live)
            return False
        live.generated = generated
        live.next_round = row.round_index + 1
        live.status = status
        live.last_heard = time.monotonic()
        continues = self._hosted(live)
        hosted_round = row.mode in (SessionMode.CLOUD, SessionMode.PLAIN)
        verdict = m.Verdict(
            session_id=live.id,
            round=row.round_index,
            base_len=row.base_len,
            n_accepted=n_accepted,
            next_token=kept[-1],
            committed_len=live.committed_len,
            finished=finished,
            policy=self._agent_policy(live),
            verifier_id=result.verifier_id,
            draft_tokens=tuple(drafted) if hosted_round else None,
            continues=continues,
            # The features belong to next_token's position: only when the stop rules kept it.
            features=None if finished or hosted_round else result.features,
        )
        live.last_verdict = verdict
        await self._send_verdict(live, verdict)
        for observe in self.round_observers:
            observe(live, row)
        if provisional:
            await self._reconciled(live, row.round_index, drafted, n_accepted, kept[-1])
        if finished:
            self._let_go(live)
            log.info(
                "session %s finished: %d tokens in %d rounds",
                live.id,
                len(live.generated),
                live.next_round,
            )
        return continues

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
            self._event,
            "session.reconciled",
            live,
            {
                "round": round_index,
                "provisional": len(tail),
                "kept": confirmed,
                "replaced": len(tail) - confirmed,
            },
        )

    def _adapt(
        self, live: LiveSession, row: Round, prefilled: bool = False
    ) -> tuple[m.Policy, dict[str, Any]]:
        """Learn from this round, choose the next; the decision and its inputs go on the round."""
        assert live.policy_task is not None
        load = verifier_load(v.load for v in self.pool.live())
        self.policy.observe(
            RoundObservation(
                session_id=live.id,
                device_id=live.device_id,
                draft_model=row.draft_model or live.policy.draft_model,
                task_type=live.policy_task,
                k=row.k,
                n_accepted=row.n_accepted,
                t_draft_ms=row.t_draft_ms or 0.0,
                t_uplink_ms=row.t_uplink_ms,
                t_queue_ms=row.t_queue_ms or 0.0,
                t_verify_ms=row.t_verify_ms or 0.0,
                verifier_load=load,
                mode=m.Mode(row.mode.value),
                # An adaptive session's first round is the agent's empty window (k = 0).
                window=_window(live, row),
                # A pass that also prefilled (this session's first, or another's in the batch)
                # says nothing of what verifying a window costs.
                prefill=prefilled or row.round_index == 0,
                overhead_ms=live.turn_overhead_ms if row.mode is SessionMode.DISTRIBUTED else None,
            )
        )
        hosted = row.mode in (SessionMode.CLOUD, SessionMode.PLAIN)
        if hosted and row.round_index % STREAM_DECISION_EVERY:
            # A host stream's window is the verifier's choice, pass by pass; whether to leave
            # the host is asked every few rounds (a decision costs ~0.4 ms of this process).
            return live.policy, live.policy.model_dump(mode="json")
        return self._decide(live, row.draft_model or live.policy.draft_model, load)

    def _open_where_best(self, live: LiveSession) -> None:
        """An adaptive session starts in the mode the policy rates best for its device now:
        nothing is switched yet, so no margin against flapping is asked of the host modes, and
        a session that does best on the host has no round drafted on the device first."""
        load = verifier_load(v.load for v in self.pool.live())
        host_drafts = self.host_drafts() if m.Mode.CLOUD in live.modes else ()
        decision = self.policy.decide(
            live.id,
            live.device_id,
            live.policy_task or live.task_type,
            live.policy.draft_model,
            load,
            host_drafts=host_drafts,
            plain=True,
        )
        best = opening_candidate(decision)
        if best is None:
            return
        live.policy = m.Policy(
            mode=best.mode,
            draft_model=best.draft_model,
            k=best.k,
            min_confidence=decision.min_confidence,
        )
        log.info(
            "session %s opens in %s mode (%s, k=%d): %.1f tok/s predicted",
            live.id,
            best.mode.value,
            best.draft_model,
            best.k,
            best.tokens_per_s,
        )

    def _decide(
        self, live: LiveSession, draft_model: str, load: float
    ) -> tuple[m.Policy, dict[str, Any]]:
        assert live.policy_task is not None
        decision = self.policy.decide(
            live.id,
            live.device_id,
            live.policy_task,
            draft_model,
            load,
            current_mode=live.policy.mode,
            host_drafts=self.host_drafts() if m.Mode.CLOUD in live.modes else (),
            plain=m.Mode.PLAIN in live.modes or m.Mode.CLOUD in live.modes,
        )
        return decision.policy, decision.to_json()

    async def _resend_verdict(self, live: LiveSession, draft: m.Draft) -> None:
        """A draft for a round already verified: the stored verdict, never a second commit."""
        if draft.cloud:
            # A cloud request re-sent: its stream may have run on, and the state has it all.
            await self._send_state(live)
            return
        verdict = live.last_verdict
        if verdict is None or verdict.round != draft.round:
            verdict = await asyncio.to_thread(self._stored_verdict, live, draft.round)
        if verdict is None:
            await self._error(live.device_id, "draft", live.id, draft.round, "unknown round")
            return
        log.info("re-sent the verdict of round %d of %s", draft.round, live.id)
        await self._send_verdict(live, verdict)

    # --- replies ------------------------------------------------------------------------------

    async def _send_verdict(self, live: LiveSession, verdict: m.Verdict) -> None:
        """Publish a verdict stamped as it leaves; the agent's next draft reports its downlink."""
        stamped = verdict.model_copy(update={"sent_at": time.time()})
        await self._publish(device_topic(live.device_id, DeviceChannel.VERDICT), m.encode(stamped))

    async def _send_state(self, live: LiveSession) -> None:
        await self._publish(
            device_topic(live.device_id, DeviceChannel.VERDICT), m.encode(live.state())
        )

    async def _error(
        self,
        device_id: str,
        refused: str,
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

    # --- database (run in a worker thread) ----------------------------------------------------

    def _create(
        self, device_id: str, session_uuid: uuid.UUID, request: m.SessionOpen
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
                SessionMode(request.mode.value)
                if request.k or request.mode is m.Mode.PLAIN
                else SessionMode.DISTRIBUTED
            ),
            draft_model=request.draft_model or self.default_draft,
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

    def _load(self, session_id: str) -> LiveSession | None:
        try:
            session_uuid = uuid.UUID(session_id)
        except ValueError:
            return None
        with self._db() as db:
            row = db.get(DecodingSession, session_uuid)
            return None if row is None else _restore(db, row)

    def _load_active(self) -> list[LiveSession]:
        with self._db() as db:
            rows = db.scalars(
                sa.select(DecodingSession).where(DecodingSession.status == SessionStatus.ACTIVE)
            ).all()
            return [_restore(db, row) for row in rows]

    def _stored_verdict(self, live: LiveSession, round_index: int) -> m.Verdict | None:
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
            draft_tokens=tuple(row.draft_tokens) if row.mode is SessionMode.CLOUD else None,
        )

    def _finish(
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

    def _event(self, kind: str, live: LiveSession, detail: dict[str, Any]) -> None:
        with self._db.begin() as db:
            append_event(
                db, kind, device_id=live.device_id, session_id=uuid.UUID(live.id), detail=detail
            )


def _busy(live: LiveSession, *, locked: bool = True) -> bool:
    """Whether a session is mid-round (its stream runs, a round is in flight, or, with
    `locked`, a handler holds it): not idle, whatever its clock says."""
    return live.streaming or live.in_flight_round is not None or (locked and live.lock.locked())


def _window(live: LiveSession, row: Round) -> int:
    """The window a round was allowed: a host pass's choice, else the policy's k (an adaptive
    session's first round is the agent's empty window)."""
    chosen = (row.policy or {}).get("pass")
    if isinstance(chosen, dict):
        return int(chosen["k"])
    return live.policy.k if row.round_index > 0 else 0


def _restore(db: Session, row: DecodingSession) -> LiveSession:
    """A session as it stood at its last persisted round: the committed tokens, the next round,
    and the policy that round chose. An adaptive session's rounds carry the decision, and with
    it the task type the policy learns under; it stays adaptive after a coordinator restart."""
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
