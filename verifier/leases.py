"""Direct rounds: a verifier that holds a session's lease answers its device itself.

The coordinator leases a distributed session to one verifier (`SessionLease`). From then on the
verifier reads the device's drafts from the device's own draft topic, verifies them in its
batches, persists each round (group commit) and only then publishes the verdict to the device:
one bus round trip and one commit a round, with the coordinator off the path. The coordinator
hears of each round afterwards (`RoundDone`), for the policy and the dashboard, and takes the
session back (`LeaseEnd`) to close it, to move it to a host stream, or when this verifier dies.

The database stays the one truth: a round is persisted before its verdict leaves, rounds are
idempotent (the last verdict is re-sent for a re-sent draft; an older or mismatched round gets
the session's state), and whoever takes a session over starts from what the database holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import IntegrityError

from broker import messages as m
from broker.topics import DRAFT_CHANNELS, DeviceChannel, parse_device_topic
from coordinator.db.models import SessionStatus
from coordinator.db.round_writer import RoundRecord, RoundWriter
from inference.speculative import apply_stop_rules

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    """A leased round as the worker's batch verified it: what the round needs, and no message
    (no `VerifyResult` is built or validated for a round that never leaves the verifier)."""

    n_accepted: int
    next_token: int | None
    error: str = ""
    queue_ms: float = 0.0  # received until its batch went to the inference process
    verify_ms: float = 0.0  # the pass, inside the inference process
    pipe_ms: float = 0.0  # to the inference process and back, beyond the pass
    batch_size: int = 1
    batch_prefilled: int = 0
    features: str | None = None


# Verify one request (received at a perf_counter time) in the worker's batches; its result says
# the error, if any.
VerifyFn = Callable[[m.VerifyRequest, float], Awaitable[Verified]]
# Device id, then the message, or its payload encoded already: queued for the bus.
ToDevice = Callable[[str, m.Message | bytes], None]
ToCoordinator = Callable[[m.Message], None]


@dataclass
class LeasedSession:
    """A session as the verifier holding its lease knows it; the database row is the truth."""

    lease_id: str
    session_id: str
    device_id: str
    prompt_len: int
    context: list[int]  # the committed sequence, prompt included
    next_round: int
    sampling: m.SamplingSpec
    max_tokens: int
    eos_id: int
    policy: m.Policy
    # The policy column of its rounds: the decision in force (the last one the coordinator sent).
    policy_record: dict[str, Any] | None = None
    finished: bool = False
    last_verdict: m.Verdict | None = None
    last_draft: tuple[float, int, float] | None = None  # (arrived, round, verify ms)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def from_lease(cls, lease: m.SessionLease) -> LeasedSession:
        return cls(
            lease_id=lease.lease_id,
            session_id=lease.session_id,
            device_id=lease.device_id,
            prompt_len=lease.prompt_len,
            context=list(lease.context_ids),
            next_round=lease.next_round,
            sampling=lease.sampling,
            max_tokens=lease.max_tokens,
            eos_id=lease.eos_id,
            policy=lease.policy,
            policy_record=lease.policy_record,
        )

    @property
    def generated(self) -> int:
        return len(self.context) - self.prompt_len

    def state(self) -> m.SessionState:
        return m.SessionState(
            session_id=self.session_id,
            prompt_len=self.prompt_len,
            generated_ids=tuple(self.context[self.prompt_len :]),
            next_round=self.next_round,
            status="finished" if self.finished else "active",
            policy=self.policy,
        )


def no_lease(lease: m.SessionLease, verifier_id: str, reason: str) -> m.LeaseAck:
    """The answer of a verifier that takes no leases (it has no database)."""
    return m.LeaseAck(
        lease_id=lease.lease_id,
        session_id=lease.session_id,
        verifier_id=verifier_id,
        held=False,
        next_round=lease.next_round,
        committed_len=len(lease.context_ids),
        reason=reason,
    )


class LeaseBook:
    """The sessions this verifier holds, and their rounds."""

    def __init__(
        self,
        verifier_id: str,
        writer: RoundWriter,
        verify: VerifyFn,
        to_device: ToDevice,
        to_coordinator: ToCoordinator,
        report: ToCoordinator | None = None,
        ended: Callable[[str], None] | None = None,
    ) -> None:
        """`report` sends a round's RoundDone (by default as `to_coordinator` does): the round
        is persisted and answered by then, so it may wait for a quieter moment. `ended` hears
        of each session whose answer ended here (its cache is of no more use)."""
        self.verifier_id = verifier_id
        self.writer = writer
        self._verify = verify
        self._to_device = to_device
        self._to_coordinator = to_coordinator
        self._report = report or to_coordinator
        self._ended = ended
        self.sessions: dict[str, LeasedSession] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- from the bus: each runs as a task of its own, so that the bus keeps flowing ------------

    def on_lease_message(self, message: m.SessionLease | m.LeaseEnd) -> None:
        if isinstance(message, m.SessionLease):
            self._spawn(self.on_lease(message), f"lease-{message.session_id}")
        else:
            self._spawn(self.on_lease_end(message), f"lease-end-{message.session_id}")

    def on_device_message(self, topic: str, payload: bytes) -> None:
        """A device's draft: answered here when its session is leased to this verifier. A
        malformed one on `draft` the coordinator hears too, and refuses with the reason; one on
        `direct`, which it does not read, is refused here (`_refuse_direct`)."""
        received = time.perf_counter()
        parsed = parse_device_topic(topic)
        if parsed is None or parsed.channel not in DRAFT_CHANNELS:
            log.debug("ignoring a message on %s", topic)
            return
        arrived = time.time()
        try:
            draft = m.decode_as(payload, m.Draft)
        except m.BusError as exc:
            if parsed.channel is DeviceChannel.DIRECT:
                self._refuse_direct(parsed.device_id, exc.reason)
            return
        if self.holds(parsed.device_id, draft):
            name = f"draft-{draft.session_id}-{draft.round}"
            self._spawn(self.on_draft(parsed.device_id, draft, arrived, received), name)

    def _refuse_direct(self, device_id: str, reason: str) -> None:
        """A malformed draft on the direct topic, which the coordinator does not read: refused
        here with the reason when this verifier holds a session of the device (a device whose
        sessions no verifier holds hears nothing, and sends again on the draft topic)."""
        if not any(held.device_id == device_id for held in self.sessions.values()):
            return
        log.warning("refused a draft from %s: %s", device_id, reason)
        error = m.ErrorReply(refused_type=m.Refused.DRAFT, reason=reason[:1024])
        self._to_device(device_id, error)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=f"verifier-{self.verifier_id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("direct round work failed", exc_info=task.exception())

    # -- leases ------------------------------------------------------------------------------

    async def on_lease(self, lease: m.SessionLease) -> None:
        """Take (or update) a lease; the ack says where the session stands here."""
        held = self.sessions.get(lease.session_id)
        if held is not None and held.device_id != lease.device_id:
            self._ack(lease.lease_id, held, False, "the session belongs to another device")
            return
        if held is None:
            held = self.sessions[lease.session_id] = LeasedSession.from_lease(lease)
        else:
            async with held.lock:
                held.lease_id = lease.lease_id
                held.policy = lease.policy
                if lease.policy_record is not None:
                    held.policy_record = lease.policy_record
                # This verifier writes the session's rounds: a lease from the database may
                # lag behind it by a round in flight, never lead it.
                if lease.next_round > held.next_round:
                    held.context = list(lease.context_ids)
                    held.next_round = lease.next_round
        if lease.send_state:
            self._to_device(held.device_id, held.state())
        self._ack(lease.lease_id, held, True)

    async def on_lease_end(self, end: m.LeaseEnd) -> None:
        held = self.sessions.get(end.session_id)
        if held is None:
            self._to_coordinator(
                m.LeaseAck(
                    lease_id=end.lease_id,
                    session_id=end.session_id,
                    verifier_id=self.verifier_id,
                    held=False,
                    next_round=0,
                    committed_len=0,
                    reason="not held here",
                )
            )
            return
        async with held.lock:  # after the round in flight, if any
            self.sessions.pop(end.session_id, None)
        self._ack(end.lease_id, held, False, "given back")

    def _ack(self, lease_id: str, held: LeasedSession, taken: bool, reason: str = "") -> None:
        self._to_coordinator(
            m.LeaseAck(
                lease_id=lease_id,
                session_id=held.session_id,
                verifier_id=self.verifier_id,
                held=taken,
                next_round=held.next_round,
                committed_len=len(held.context),
                reason=reason,
            )
        )

    # -- rounds ------------------------------------------------------------------------------

    def holds(self, device_id: str, draft: m.Draft) -> bool:
        """Whether this verifier answers the draft (a cloud request is the coordinator's)."""
        held = self.sessions.get(draft.session_id)
        return held is not None and held.device_id == device_id and not draft.cloud

    async def on_draft(
        self, device_id: str, draft: m.Draft, arrived: float, received: float | None = None
    ) -> None:
        """Answer a draft; `arrived` is its arrival on the unix clock, `received` the same
        moment by `time.perf_counter()` (the start of the round's time here)."""
        if received is None:
            received = time.perf_counter()
        held = self.sessions.get(draft.session_id)
        if held is None or held.device_id != device_id:
            return
        async with held.lock:
            if self.sessions.get(draft.session_id) is not held:
                return  # given back while waiting: the coordinator answers it
            refusal = self._refusal(held, draft)
            if refusal is not None:
                if refusal:
                    self._error(held, draft, refusal)
                return
            # Built without validating again what is validated already (the draft at the
            # boundary, the context from the lease and the verified rounds): a round's context
            # is hundreds of ids, checked one by one.
            request = m.VerifyRequest.model_construct(
                request_id=uuid.uuid4().hex[:16],
                session_id=held.session_id,
                round=draft.round,
                context_ids=tuple(held.context),
                tokens=draft.tokens,
                q_ids=draft.q_ids,
                q_probs=draft.q_probs,
                sampling=held.sampling,
                want_features=draft.want_features,
            )
            result = await self._verify(request, time.perf_counter())
            if result.error or result.next_token is None:
                # Nothing was committed; the device re-sends this round when it hears the state.
                self._error(held, draft, f"not verified: {result.error or 'no next token'}")
                return
            await self._commit(held, draft, result, arrived, received)

    def _refusal(self, held: LeasedSession, draft: m.Draft) -> str | None:
        """None: verify it; "": answered already (a re-sent round); else the reason to refuse."""
        if draft.round < held.next_round:
            verdict = held.last_verdict
            if verdict is not None and verdict.round == draft.round:
                self._to_device(held.device_id, verdict.model_copy(update={"sent_at": time.time()}))
            else:
                self._to_device(held.device_id, held.state())
            return ""
        if held.finished:
            return "session is finished"
        return draft.misfit(held.next_round, len(held.context), held.sampling.greedy)

    async def _commit(
        self,
        held: LeasedSession,
        draft: m.Draft,
        result: Verified,
        arrived: float,
        received: float,
    ) -> None:
        """Stop rules, persist, then the verdict to the device and the round to the coordinator."""
        assert result.next_token is not None
        accepted = list(draft.tokens[: result.n_accepted])
        kept, finished = apply_stop_rules(
            held.generated, accepted, result.next_token, held.max_tokens, held.eos_id
        )
        overhead_ms = None
        if held.last_draft is not None and held.last_draft[1] == draft.round - 1:
            turn_ms = (arrived - held.last_draft[0]) * 1000.0
            overhead_ms = max(0.0, turn_ms - held.last_draft[2] - draft.timings.draft_ms)
        held.last_draft = (arrived, draft.round, result.verify_ms)
        uplink_ms = max(0.0, (arrived - draft.timings.sent_at) * 1000.0)
        policy_record = held.policy_record or held.policy.model_dump(mode="json")
        if draft.drafter_note:  # why the device drafted with another drafter (memory, a fetch)
            policy_record = {**policy_record, "device": {"note": draft.drafter_note}}
        row = RoundRecord(
            session_id=uuid.UUID(held.session_id),
            round_index=draft.round,
            base_len=draft.base_len,
            draft_tokens=list(draft.tokens),
            draft_model=draft.draft_model,
            provisional=draft.provisional,
            q_ids=[list(r) for r in draft.q_ids] if draft.q_ids else None,
            q_probs=[list(r) for r in draft.q_probs] if draft.q_probs else None,
            k=len(draft.tokens),
            mode=m.Mode.DISTRIBUTED,
            n_accepted=len(kept) - 1,
            next_token=kept[-1],
            committed_len=draft.base_len + len(kept),
            verifier_id=self.verifier_id,
            policy=policy_record,
            t_draft_ms=draft.timings.draft_ms,
            t_uplink_ms=uplink_ms if draft.timings.sent_at else None,
            t_queue_ms=result.queue_ms,
            t_verify_ms=result.verify_ms,
            t_downlink_ms=None,
        )
        generated = [*held.context[held.prompt_len :], *kept]
        status = SessionStatus.FINISHED if finished else SessionStatus.ACTIVE
        persisting = time.perf_counter()
        try:
            await self.writer.write(
                row,
                generated,
                status,
                device_id=held.device_id,
                downlink_ms=draft.timings.downlink_ms,
                gather=result.batch_size > 1,  # the pass's other rows may be committing too
            )
        except IntegrityError:
            # The round is in the database already: another answerer (the coordinator, or the
            # verifier that held the lease before a broker outage) persisted it, and this lease
            # lags behind. The database is the truth: take its state and tell the device.
            await self._resync(held, draft.round)
            return
        except Exception as exc:  # nothing persisted: the device re-sends when it hears
            log.error("round %d of %s not persisted: %s", draft.round, held.session_id, exc)
            self._error(held, draft, "the round could not be persisted")
            return
        persisted = time.perf_counter()
        held.context += kept
        held.next_round = draft.round + 1
        held.finished = finished
        verdict = m.Verdict(
            session_id=held.session_id,
            round=draft.round,
            base_len=draft.base_len,
            n_accepted=len(kept) - 1,
            next_token=kept[-1],
            committed_len=len(held.context),
            finished=finished,
            policy=held.policy,
            verifier_id=self.verifier_id,
            # The features belong to next_token's position: only when the stop rules kept it.
            features=None if finished else result.features,
            direct=True,
        )
        held.last_verdict = verdict
        payload = m.encode(verdict.model_copy(update={"sent_at": time.time()}))
        self._to_device(held.device_id, payload)
        queued = time.perf_counter()
        self._report(
            m.RoundDone(
                lease_id=held.lease_id,
                session_id=held.session_id,
                round=draft.round,
                base_len=draft.base_len,
                committed=tuple(kept),
                drafted=len(draft.tokens),
                n_accepted=len(kept) - 1,
                finished=finished,
                draft_model=draft.draft_model,
                provisional=draft.provisional,
                verifier_id=self.verifier_id,
                t_draft_ms=draft.timings.draft_ms,
                t_uplink_ms=row.t_uplink_ms,
                t_queue_ms=result.queue_ms,
                t_verify_ms=result.verify_ms,
                batch_prefilled=result.batch_prefilled,
                batch_size=result.batch_size,
                overhead_ms=overhead_ms,
                t_pipe_ms=result.pipe_ms,
                t_persist_ms=(persisted - persisting) * 1e3,
                t_encode_ms=(queued - persisted) * 1e3,
                t_held_ms=(queued - received) * 1e3,
            )
        )
        if finished:
            self.sessions.pop(held.session_id, None)
            if self._ended is not None:
                self._ended(held.session_id)

    async def _resync(self, held: LeasedSession, round_index: int) -> None:
        """Catch up with the database when it holds rounds this lease had not heard of."""
        try:
            stored = await asyncio.to_thread(self.writer.stored, uuid.UUID(held.session_id))
        except Exception as exc:  # the database is away: the device re-sends when it hears
            log.error("session %s could not be read back: %s", held.session_id, exc)
            stored = None
        if stored is not None:
            context, next_round, status = stored
            if next_round > held.next_round:
                held.context, held.next_round = context, next_round
                held.finished = status is SessionStatus.FINISHED
                held.last_verdict = None
        log.warning(
            "round %d of %s was persisted already; the session resumes from the database at "
            "round %d",
            round_index,
            held.session_id,
            held.next_round,
        )
        self._to_device(held.device_id, held.state())
        if held.finished:
            self.sessions.pop(held.session_id, None)

    def _error(self, held: LeasedSession, draft: m.Draft, reason: str) -> None:
        log.warning(
            "refused draft from %s (session %s round %d): %s",
            held.device_id,
            held.session_id,
            draft.round,
            reason,
        )
        reply = m.ErrorReply(
            refused_type=m.Refused.DRAFT,
            session_id=held.session_id,
            round=draft.round,
            reason=reason,
        )
        self._to_device(held.device_id, reply)
        self._to_device(held.device_id, held.state())
