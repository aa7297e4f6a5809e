"""The bus-facing verifier: batches VerifyRequests for its inference child, publishes the results.

Topics (docs/protocol.md): requests arrive on `verifier/{id}/work`, results leave on
`verifier/{id}/result`, and a retained `VerifierStatus` heartbeat on `verifier/{id}/status`
carries the load; the Last Will there says offline. The MQTT session is clean: work published
while a verifier is away is not queued for it, since the coordinator resends the in-flight
requests of a verifier whose Will fired or whose heartbeats stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from broker.client import (
    BrokerAddress,
    BusClient,
    BusConnectionError,
    ConnectOptions,
    Protocol,
    Will,
    run_with_reconnect,
)
from broker.messages import (
    MAX_BATCHED_RESULTS,
    BusError,
    DeviceState,
    LeaseEnd,
    Message,
    PassChoice,
    SessionLease,
    StreamRedraft,
    StreamStop,
    VerifierStatus,
    VerifyRequest,
    VerifyResult,
    VerifyResults,
    decode,
    encode,
)
from broker.topics import (
    DRAFT_CHANNELS,
    DeviceChannel,
    VerifierChannel,
    device_subscription,
    device_topic,
    validate_device_id,
    verifier_topic,
)
from coordinator.db.engine import make_engine
from coordinator.db.round_writer import RoundWriter
from core.aio import task_group, timeout
from verifier.child import (
    ChildConfig,
    ChildDied,
    ChildReady,
    ChildStartError,
    InferenceChild,
    Step,
    Steps,
)
from verifier.core import Verification
from verifier.goodput import GoodputControl
from verifier.leases import LeaseBook, Verified, no_lease
from verifier.outbox import Outbox, heartbeat
from verifier.streams import HostStream, HostStreams

log = logging.getLogger(__name__)

# Defaults of WorkerConfig and of the command's flags; the restart constants are read at run time.
# The widest pass: DESIGN.md's table goes to 32 rows, and plain serving of 32 sessions batches
# them all; rows past it wait for the next pass.
MAX_BATCH = 32
# After the first request of a batch, wait at most this long for more, and only while another
# session is due back within it (see ReturnTimes).
BATCH_WINDOW_MS = 2.0
HEARTBEAT_S = 1.0
BATCH_TIMEOUT_S = 300.0  # a child that takes longer on one batch is taken for hung and killed
RESTART_ATTEMPTS = 5
RESTART_BACKOFF_S = 0.5
STATUS_ON_EXIT_TIMEOUT_S = 2.0
TIMINGS_KEPT = 1024
# A pass of nothing but plain stream rounds runs on in the child for up to this many passes,
# each row's next round decided there, until anything else arrives (`verifier.child.Steps`).
# On a 2-core host that took 2-6 ms a pass of pipe and worker between two passes of 70-250 ms.
STEPS_PER_CALL = 4
RETURN_TIMES_KEPT = 4096  # sessions whose pace a worker remembers; the longest idle go first


class VerifierError(Exception):
    """The worker cannot go on (its inference process does not start)."""


@dataclass(frozen=True)
class WorkerConfig:
    verifier_id: str
    child: ChildConfig = field(default_factory=ChildConfig)
    max_batch: int = MAX_BATCH
    batch_window_ms: float = BATCH_WINDOW_MS
    heartbeat_s: float = HEARTBEAT_S
    batch_timeout_s: float = BATCH_TIMEOUT_S
    steps_per_call: int = STEPS_PER_CALL  # 1: every pass goes through the worker

    def __post_init__(self) -> None:
        validate_device_id(self.verifier_id)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.heartbeat_s <= 0 or self.batch_timeout_s <= 0:
            raise ValueError("heartbeat_s and batch_timeout_s must be > 0")
        if self.steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {self.steps_per_call}")


@dataclass(frozen=True)
class BatchTiming:
    """One batch through the child: the pipe hop is `roundtrip_ms - compute_ms`."""

    size: int
    roundtrip_ms: float  # send to the child until its reply is read
    compute_ms: float  # verify_batch inside the child


@dataclass(frozen=True)
class _Pending:
    request: VerifyRequest
    received_at: float  # time.perf_counter()
    # A leased session's round: its result goes here, not to the coordinator.
    done: asyncio.Future[Verified] | None = None


class ReturnTimes:
    """When each session is due back: its last result left at `answered`, and it came back
    `gap` after the result before. The batch window is waited only while a session is due
    within it, so a lone session is never held back, and a window that could bring no other
    session costs nothing. Times are `time.perf_counter()` of this process."""

    def __init__(self, kept: int = RETURN_TIMES_KEPT) -> None:
        self.kept = kept
        self._answered: OrderedDict[str, float] = OrderedDict()  # least recent first
        self._gap: dict[str, float] = {}

    def answered(self, session_id: str, at: float) -> None:
        self._answered[session_id] = at
        self._answered.move_to_end(session_id)
        while len(self._answered) > self.kept:
            oldest, _ = self._answered.popitem(last=False)
            self._gap.pop(oldest, None)

    def arrived(self, session_id: str, at: float) -> None:
        answered = self._answered.pop(session_id, None)
        if answered is not None:
            self._gap[session_id] = max(0.0, at - answered)

    def due(self, start: float, end: float, excluding: Container[str]) -> bool:
        """Whether a session not in `excluding` is due back between `start` and `end`.

        A session due before `start` is taken to have ended or gone to another verifier; one
        that has not come back yet has no gap, and is not waited for.
        """
        for session_id, answered in self._answered.items():
            gap = self._gap.get(session_id)
            if gap is None or session_id in excluding:
                continue
            if start <= answered + gap <= end:
                return True
        return False


@dataclass
class WorkerCounters:
    received: int = 0
    refused: int = 0  # payloads on the work topic that the contract refused
    served: int = 0  # results published without error
    failed: int = 0  # results published with `error`
    batches: int = 0
    child_restarts: int = 0
    # The target's time since start: in passes, and idle between them (waiting for work, or
    # for the worker to send the next pass). busy / (busy + idle) is how much of the
    # verifier's compute the fleet used.
    busy_s: float = 0.0
    idle_s: float = 0.0
    rows: int = 0  # rows over all passes
    positions: int = 0  # positions over all passes, padding included: rows x the widest
    timings: deque[BatchTiming] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))


class VerifierWorker:
    """`await VerifierWorker(config, address).run()` serves until cancelled."""

    def __init__(
        self,
        config: WorkerConfig,
        address: BrokerAddress,
        *,
        username: str | None = None,
        password: str | None = None,
        protocol: Protocol = "auto",
        database_url: str | None = None,
    ) -> None:
        self.config = config
        self.address = address
        self.username = username
        self.password = password
        self.protocol: Protocol = protocol
        vid = config.verifier_id
        self.work_topic = verifier_topic(vid, VerifierChannel.WORK)
        self.result_topic = verifier_topic(vid, VerifierChannel.RESULT)
        self.status_topic = verifier_topic(vid, VerifierChannel.STATUS)
        self.child = InferenceChild(config.child, name=f"verifier-{vid}-inference")
        self.counters = WorkerCounters()
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._in_flight: list[_Pending] = []
        self._outbox = Outbox()
        self._returns = ReturnTimes()
        self.streams = HostStreams()
        self.goodput = GoodputControl()
        self._work_ready = asyncio.Event()
        self._passes = 0
        self._sessions_cached = 0
        # What the inference process loaded (the target's identity, its drafters), once up.
        self._loaded: ChildReady | None = None
        # Direct rounds need the database: a verifier without one takes no leases.
        self.leases: LeaseBook | None = None
        self._writer: RoundWriter | None = None
        if database_url is not None:
            self._writer = RoundWriter(make_engine(database_url))
            self.leases = LeaseBook(
                vid,
                self._writer,
                self._verify_leased,
                self._to_device,
                self._to_coordinator,
                report=self._report,
                ended=lambda session_id: self.child.forget(session_id),
            )

    # -- state, for the heartbeat and for tests --------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def in_flight(self) -> int:
        """Requests in the pass under way, and the streams that have a round in every pass."""
        return len(self._in_flight) + len(self.streams)

    @property
    def sessions_cached(self) -> int:
        return self._sessions_cached

    def status(self, state: DeviceState) -> VerifierStatus:
        loaded = self._loaded
        return VerifierStatus(
            verifier_id=self.config.verifier_id,
            state=state,
            at=time.time(),
            queue_depth=self.queue_depth,
            in_flight=self.in_flight,
            sessions_cached=self._sessions_cached,
            max_batch=self.config.max_batch,
            heartbeat_s=self.config.heartbeat_s,
            target="" if loaded is None else loaded.target,
            drafts=() if loaded is None else loaded.drafts,
            leases=self.leases is not None,
            leased=() if self.leases is None else tuple(self.leases.sessions)[:4096],
            vocab_size=None if loaded is None else loaded.vocab_size,
            eos_id=None if loaded is None else loaded.eos_id,
            vocab="" if loaded is None else loaded.vocab,
            passes=self.counters.batches,
            busy_s=self.counters.busy_s,
            idle_s=self.counters.idle_s,
            rows=self.counters.rows,
            positions=self.counters.positions,
            pass_cost=self.goodput.cost.coefficients if self.goodput.cost.samples else None,
            draft_ms=self.goodput.timed_drafts(),
            redraft=True,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Load the target, then serve the bus until cancelled; VerifierError on a dead end."""
        try:
            try:
                ready = await self.child.start()
            except ChildStartError as exc:
                raise VerifierError(f"cannot start the inference process: {exc}") from exc
            self._loaded = ready
            for rows, positions, ms in ready.profile:
                self.goodput.observe_pass(rows, positions, ms)
            options = ConnectOptions(
                client_id=f"specfleet-verifier-{self.config.verifier_id}",
                username=self.username,
                password=self.password,
                will=Will(self.status_topic, encode(self.status(DeviceState.OFFLINE)), retain=True),
                protocol=self.protocol,
            )
            async with task_group() as tasks:
                tasks.create_task(self._serve_batches(), name=f"{self.child.name}-batches")
                if self._writer is not None:
                    tasks.create_task(self._writer.run(), name=f"{self.child.name}-round-writer")
                tasks.create_task(
                    run_with_reconnect(self.address, options, self._session),
                    name=f"verifier-{self.config.verifier_id}-bus",
                )
        finally:
            self.child.stop()

    async def _session(self, client: BusClient) -> None:
        await client.subscribe(self.work_topic)
        if self.leases is not None:
            # Every device's drafts: those of the sessions it holds are its to answer.
            for channel in DRAFT_CHANNELS:
                await client.subscribe(device_subscription(channel))
        await client.publish(
            self.status_topic, encode(self.status(DeviceState.ONLINE)), retain=True
        )
        vid = self.config.verifier_id
        try:
            async with task_group() as tasks:
                tasks.create_task(self._receive(client), name=f"verifier-{vid}-receive")
                tasks.create_task(
                    self._outbox.publish(client, f"verifier-{vid}"), name=f"verifier-{vid}-publish"
                )
                tasks.create_task(self._heartbeat(client), name=f"verifier-{vid}-heartbeat")
        except asyncio.CancelledError:
            # A clean exit says offline itself, at once, rather than leaving it to the Will.
            with contextlib.suppress(BusConnectionError, TimeoutError):
                async with timeout(STATUS_ON_EXIT_TIMEOUT_S):
                    await client.publish(
                        self.status_topic, encode(self.status(DeviceState.OFFLINE)), retain=True
                    )
            raise

    # -- bus tasks ---------------------------------------------------------------------------

    async def _receive(self, client: BusClient) -> None:
        async for incoming in client.messages():
            if incoming.topic != self.work_topic:
                self._on_device_message(incoming.topic, incoming.payload)
                continue
            self.counters.received += 1
            try:
                message = decode(incoming.payload)
                if isinstance(message, StreamStop):
                    if self.streams.stop(message.session_id, message.request_id) is not None:
                        log.debug("stream of %s stopped", message.session_id)
                        self.child.interrupt()
                    continue
                if isinstance(message, StreamRedraft):
                    if self.streams.redraft(message) is None:
                        log.debug("no stream %s to redraft", message.request_id)
                    else:
                        # Rounds run on in the child stop, so that the next pass weighs the
                        # new drafter's windows (or drafts no more with the old one).
                        self.child.interrupt()
                    continue
                if isinstance(message, SessionLease | LeaseEnd):
                    self._on_lease_message(message)
                    continue
                if not isinstance(message, VerifyRequest):
                    expected = "verify_request, stream_stop or stream_redraft"
                    raise BusError(f"expected {expected}, got {message.type}")
                request = message
            except BusError as exc:
                self.counters.refused += 1
                log.warning("refused a payload on %s: %s", incoming.topic, exc.reason)
                reply = refusal_reply(incoming.payload, exc.reason, self.config.verifier_id)
                if reply is not None:
                    self._outbox.put(self.result_topic, encode(reply))
                continue
            received_at = time.perf_counter()
            if request.stream is not None:
                self.streams.open(HostStream.open(request, received_at))
                self._wake()
                continue
            # A device-drafted round of a session ends any stream of it (the coordinator moved
            # it back to distributed mode; the stop may still be on its way).
            self.streams.stop(request.session_id)
            self._returns.arrived(request.session_id, received_at)
            self._queue.put_nowait(_Pending(request, received_at))
            self._wake()
        raise BusConnectionError("the broker ended the message stream")

    # -- direct rounds -----------------------------------------------------------------------

    def _on_lease_message(self, message: SessionLease | LeaseEnd) -> None:
        if self.leases is not None:
            self.leases.on_lease_message(message)
        elif isinstance(message, SessionLease):
            reason = "this verifier has no database: it takes no leases"
            self._to_coordinator(no_lease(message, self.config.verifier_id, reason))

    def _on_device_message(self, topic: str, payload: bytes) -> None:
        if self.leases is not None:
            self.leases.on_device_message(topic, payload)

    async def _verify_leased(self, request: VerifyRequest, received_at: float) -> Verified:
        """A leased session's round through the same batches as every other request."""
        done: asyncio.Future[Verified] = asyncio.get_running_loop().create_future()
        self._returns.arrived(request.session_id, received_at)
        self._queue.put_nowait(_Pending(request, received_at, done))
        self._wake()
        return await done

    def _wake(self) -> None:
        """New work: the batching loop takes it at its next pass, which a child running plain
        stream rounds on by itself makes the one after its current pass."""
        self._work_ready.set()
        self.child.interrupt()

    def _to_device(self, device_id: str, message: Message | bytes) -> None:
        self._outbox.put(device_topic(device_id, DeviceChannel.VERDICT), message)

    def _to_coordinator(self, message: Message) -> None:
        self._outbox.put(self.result_topic, message)

    def _report(self, message: Message) -> None:
        """A round's report to the coordinator, sent once the next pass is under way."""
        self._outbox.report(self.result_topic, message)

    async def _heartbeat(self, client: BusClient) -> None:
        def status() -> bytes:
            return encode(self.status(DeviceState.ONLINE))

        await heartbeat(client, self.status_topic, status, self.config.heartbeat_s)

    # -- batching and the child --------------------------------------------------------------

    async def _collect(self) -> list[_Pending]:
        """Up to max_batch requests: the first, whatever else is queued, and what arrives within
        the batch window while another session is due back within it. With streams open the
        pass goes at once: it has their rounds to run, and they must not wait on devices."""
        if not self.streams:
            await self._wait_for_work()
        batch: list[_Pending] = []
        while len(batch) < self.config.max_batch and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        if self.streams or not batch:
            return batch
        window_s = self.config.batch_window_ms / 1e3
        deadline = batch[0].received_at + window_s
        while len(batch) < self.config.max_batch and not self.streams:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            now = time.perf_counter()
            remaining = deadline - now
            if remaining <= 0:
                break
            sessions = {pending.request.session_id for pending in batch}
            # Due back but late by more than a window: taken to be gone, not waited for.
            if not self._returns.due(now - window_s, deadline, excluding=sessions):
                break
            try:
                async with timeout(remaining):
                    batch.append(await self._queue.get())
            except TimeoutError:
                break
        return batch

    async def _wait_for_work(self) -> None:
        """Until a request is queued or a stream opens."""
        while self._queue.empty() and not self.streams:
            self._work_ready.clear()
            await self._work_ready.wait()

    async def _serve_batches(self) -> None:
        while True:
            batch = await self._collect()
            busy = {pending.request.session_id for pending in batch}
            self._passes += 1
            turn = self.streams.turn(self.config.max_batch - len(batch), self._passes, busy)
            if not batch and not turn:
                continue
            choice = None
            if turn:
                fixed = [len(p.request.tokens) or (p.request.cloud_k or 0) for p in batch]
                fixed += [stream.cap for stream in turn if not stream.adaptive]
                choice = self._choose(turn, fixed)
                if batch and self._apart(batch, turn, choice):
                    # The device-drafted windows first, in a pass of their own: they would
                    # widen every row of the streams' pass to theirs.
                    await self._verify_tracked(batch, [], None)
                    batch, choice = [], self._choose(turn, [])
            await self._verify_tracked(batch, turn, choice)

    async def _verify_tracked(
        self, batch: list[_Pending], turn: list[HostStream], choice: PassChoice | None
    ) -> None:
        self._in_flight = batch
        try:
            await self._verify(batch, turn, choice)
        finally:
            self._in_flight = []

    def _apart(self, batch: list[_Pending], turn: list[HostStream], together: PassChoice) -> bool:
        """Whether the device-drafted rows of `batch` go in a pass of their own before the
        streams of `turn` (`GoodputControl.apart`); never beside a fixed-window stream, as wide
        as a device's window."""
        if any(not stream.adaptive for stream in turn):
            return False
        widths = [len(p.request.tokens) or (p.request.cloud_k or 0) for p in batch]
        try:
            return self.goodput.apart([stream.row() for stream in turn], widths, together)
        except Exception:
            log.exception("goodput control failed; the pass stays whole")
            return False

    def _choose(self, turn: list[HostStream], fixed: list[int]) -> PassChoice:
        """The pass's window; plain, with the reason, when the cost model cannot say (a choice
        that fails must not stop the verifier)."""
        rows = [stream.row() for stream in turn if stream.adaptive]
        try:
            return self.goodput.choose(rows, fixed)
        except Exception as exc:
            log.exception("goodput control failed; this pass runs plain")
            return PassChoice(
                k=0, rows=len(turn) + len(fixed), reason=f"k=0: goodput control failed: {exc}"[:256]
            )

    async def _verify(
        self, batch: list[_Pending], turn: list[HostStream], choice: PassChoice | None
    ) -> None:
        """One pass: the device-drafted requests of `batch` and a round of each stream in
        `turn`, at the window `choice` picked for them."""
        dispatched = time.perf_counter()
        k = 0 if choice is None else choice.k
        requests = [p.request for p in batch] + [stream.request(k) for stream in turn]
        steps = self._steps(batch, turn, requests, choice)
        try:
            reply = await self.child.verify(
                steps or requests,
                timeout_s=self.config.batch_timeout_s,
                sent=self._outbox.release_reports,
            )
        except ChildDied as exc:
            log.error("inference process lost with %d requests in flight: %s", len(requests), exc)
            error = f"verifier lost its inference process: {exc}"
            for pending in batch:
                self._emit(pending, None, dispatched, 0.0, error=error)
            failed = [
                (stream, self._emit_stream(stream, _ran_at(r), None, 0.0, 0, choice, error))
                for stream, r in zip(turn, requests[len(batch) :], strict=True)
            ]
            self._put_results(failed)
            await self._restart_child()
            return
        roundtrip_ms = (time.perf_counter() - dispatched) * 1e3
        self._sessions_cached = reply.stats.sessions_cached
        # Cloud rounds were drafted inside the same call; what the target took is the rest.
        verifications = reply.verifications
        verify_ms = _target_ms(reply.compute_ms, verifications)
        prefilled = sum(v.prefilled for v in verifications)
        widest = max(
            (len(r.tokens) or len(v.draft_tokens or ()))
            for r, v in zip(requests, verifications, strict=True)
        )
        self._count_pass(
            len(requests),
            roundtrip_ms,
            reply.compute_ms,
            reply.idle_ms,
            None if prefilled else (widest + 1, verify_ms - reply.stack_ms),
        )
        pipe_ms = max(0.0, roundtrip_ms - reply.compute_ms)
        for pending, verification in zip(batch, verifications, strict=False):
            self._emit(
                pending, verification, dispatched, verify_ms, prefilled=prefilled, pipe_ms=pipe_ms
            )
        streamed = zip(turn, requests[len(batch) :], verifications[len(batch) :], strict=True)
        results = [
            (stream, self._emit_stream(stream, _ran_at(r), v, verify_ms, prefilled, choice))
            for stream, r, v in streamed
        ]
        self._put_results(results)
        self._observe_drafting(
            turn, [r.cloud_k or 0 for r in requests[len(batch) :]], verifications[len(batch) :]
        )
        if steps is None:
            return
        try:
            number = 1
            horizon = max(steps.limits)  # the passes the call may run, as extended
            async for step in self.child.steps(self.config.batch_timeout_s):
                number += 1
                ran = None
                if choice is not None:
                    reason = f"{choice.reason}; pass {number} run on in the inference process"
                    ran = choice.model_copy(update={"rows": len(step.rows), "reason": reason[:256]})
                self._emit_step(turn, step, ran)
                if number == horizon - 1:  # the child runs the call's last pass now
                    more = self._extension(turn, step, choice)
                    self.child.extend(more)
                    horizon += more
                self._outbox.release_reports()  # the child runs its next pass meanwhile
        except ChildDied as exc:
            # The streams stand at their last round published, and go on from there.
            log.error("inference process lost running stream rounds on: %s", exc)
            await self._restart_child()

    def _observe_drafting(
        self,
        turn: Sequence[HostStream],
        windows: Sequence[int],
        verifications: Sequence[Verification],
    ) -> None:
        """What drafting the streams' windows took, per drafter, for as many rows as it drafted
        together in the pass (a feature head steps them all in one call)."""
        drafted: dict[str, tuple[int, int, float]] = {}  # drafter -> rows, window, ms
        for stream, window, verification in zip(turn, windows, verifications, strict=True):
            draft = stream.draft
            if draft is None or window <= 0 or verification.error:
                continue
            rows, widest, ms = drafted.get(draft, (0, 0, 0.0))
            drafted[draft] = (rows + 1, max(widest, window), ms + verification.draft_ms)
        for draft, (rows, window, ms) in drafted.items():
            self.goodput.observe_draft_ms(draft, window, ms, rows=rows)

    def _steps(
        self,
        batch: list[_Pending],
        turn: list[HostStream],
        requests: list[VerifyRequest],
        choice: PassChoice | None,
    ) -> Steps | None:
        """The pass as a `Steps` call, where the child may run its rounds on by itself, each
        stream's at the window of this pass: every row a round of a stream, with no device
        round waiting and every stream in it (a pass that leaves a stream out takes turns, one
        pass at a time), and plain chosen for more than re-timing plain passes of its size
        (`GoodputControl.retimes_plain`)."""
        if self.config.steps_per_call < 2 or batch or not turn or len(turn) < len(self.streams):
            return None
        if any(request.tokens for request in requests):
            return None
        if choice is not None and self.goodput.retimes_plain(choice):
            return None
        limits = tuple(
            max(1, min(self.config.steps_per_call, stream.rounds_left)) for stream in turn
        )
        if max(limits) < 2:
            return None
        k = 0 if choice is None else choice.k
        return Steps(
            requests,
            limits,
            tuple(stream.spec.eos_id for stream in turn),
            left=tuple(stream.spec.max_new - stream.generated for stream in turn),
            windows=tuple(stream.window(k) for stream in turn),
        )

    def _extension(self, turn: list[HostStream], step: Step, choice: PassChoice | None) -> int:
        """Passes a `Steps` call in flight may run on after its last (0: none): as many as
        the next call would run, where it would be the same call (nothing waiting, no stream
        gained or lost, the same window chosen for the rows still running), within every such
        row's rounds."""
        if not self.child.stepping or not self._queue.empty():
            return 0
        going = [turn[row] for row in step.rows]
        if len(going) != len(self.streams) or not all(map(self.streams.is_current, going)):
            return 0
        # The call's last pass, now running, takes one more round of each.
        rounds = min(stream.spec.rounds - stream.rounds_done - 1 for stream in going)
        more = min(self.config.steps_per_call, rounds)
        if more < 1:
            return 0
        fixed = [stream.cap for stream in going if not stream.adaptive]
        again = self._choose(going, fixed)
        if again.k != (0 if choice is None else choice.k) or self.goodput.retimes_plain(again):
            return 0
        return more

    def _count_pass(
        self,
        rows: int,
        roundtrip_ms: float,
        compute_ms: float,
        idle_ms: float,
        timed: tuple[int, float] | None,
    ) -> None:
        """A pass in the counters; `timed` (positions a row, its time less stacking) also in
        the cost model, for a pass that prefilled nothing. In place, stacking is paid when the
        rows change, whatever the window."""
        counters = self.counters
        counters.batches += 1
        counters.timings.append(BatchTiming(rows, roundtrip_ms, compute_ms))
        counters.busy_s += compute_ms / 1e3
        counters.idle_s += idle_ms / 1e3
        if timed is not None:
            positions, ms = timed
            self.goodput.observe_pass(rows, positions, max(0.0, ms))
            counters.rows += rows
            counters.positions += rows * positions

    def _emit_step(self, turn: list[HostStream], step: Step, choice: PassChoice | None) -> None:
        """The rounds of one pass that the child ran on by itself, as if sent pass by pass: a
        round of a stream stopped or moved meanwhile is dropped (it was never published; its
        session's next round computes it again)."""
        rows, compute_ms = step.rows, step.compute_ms
        windows = step.windows
        verify_ms = _target_ms(compute_ms, step.verifications)
        widest = max((len(v.draft_tokens or ()) for v in step.verifications), default=0)
        self._count_pass(
            len(rows), compute_ms, compute_ms, 0.0, (widest + 1, verify_ms - step.stack_ms)
        )
        results: list[tuple[HostStream, VerifyResult]] = []
        for row, verification, window in zip(rows, step.verifications, windows, strict=True):
            stream = turn[row]
            fits = verification.round == stream.round and verification.base_len == len(
                stream.context
            )
            if not self.streams.is_current(stream) or not fits:
                log.debug("dropped round %d of %s", verification.round, stream.session_id)
                continue
            at = (verification.round, verification.base_len, window)
            results.append(
                (stream, self._emit_stream(stream, at, verification, verify_ms, 0, choice))
            )
        self._put_results(results)
        self._observe_drafting([turn[row] for row in rows], windows, step.verifications)

    def _emit_stream(
        self,
        stream: HostStream,
        at: tuple[int, int, int],
        verification: Verification | None,
        compute_ms: float,
        prefilled: int,
        choice: PassChoice | None,
        error: str = "",
    ) -> VerifyResult:
        """A stream's round for the coordinator (`_put_results`); the stream goes on or ends
        with it. `at`: the round, its base length and its window, as the pass ran it."""
        round_index, base_len, window = at
        error = error or (verification.error if verification is not None else "")
        drafted: tuple[int, ...] = ()
        goes_on = False
        if verification is not None and not error and verification.next_token is not None:
            drafted = verification.draft_tokens or ()
            if stream.draft is not None and window:
                self.goodput.observe_round(
                    stream.draft,
                    stream.spec.task_type,
                    window,
                    len(drafted),
                    verification.n_accepted,
                    stream=stream.session_id,
                )
            goes_on = self.streams.is_current(stream) and stream.advance(
                drafted, verification.n_accepted, verification.next_token
            )
        elif not error:
            error = "the target gave no next token"
        if not goes_on:
            self.streams.stop(stream.session_id, stream.request_id)
            if stream.finished:
                # A stream that ran out of rounds opens again; its session's rounds still count.
                self.goodput.forget_stream(stream.session_id)
                self.child.forget(stream.session_id)
        result = VerifyResult(
            request_id=stream.request_id,
            session_id=stream.session_id,
            round=round_index,
            base_len=base_len,
            n_accepted=verification.n_accepted if verification is not None and not error else 0,
            next_token=None if error or verification is None else verification.next_token,
            verifier_id=self.config.verifier_id,
            verify_ms=compute_ms,
            batch_size=verification.batch_size if verification is not None else 1,
            batch_prefilled=prefilled,
            error=error[:1024],
            draft_tokens=None if error or verification is None else drafted,
            q_ids=None if error or verification is None else verification.q_ids,
            q_probs=None if error or verification is None else verification.q_probs,
            draft_ms=verification.draft_ms if verification is not None else 0.0,
            pass_choice=_row_choice(stream, choice, window),
            stream_ends=not goes_on,
            stream_draft=stream.draft,
        )
        if result.error:
            self.counters.failed += 1
        else:
            self.counters.served += 1
        return result

    def _put_results(self, results: list[tuple[HostStream, VerifyResult]]) -> None:
        """A pass's stream rounds to the coordinator: those of streams opened `batched`, without
        q' or features, in one VerifyResults (MAX_BATCHED_RESULTS at most each); the others,
        and a lone one, each in a message of its own."""
        together: list[VerifyResult] = []
        for stream, result in results:
            if stream.spec.batched and result.q_ids is None and result.features is None:
                together.append(result)
            else:
                self._outbox.put(self.result_topic, result)
        for start in range(0, len(together), MAX_BATCHED_RESULTS):
            chunk = tuple(together[start : start + MAX_BATCHED_RESULTS])
            message = chunk[0] if len(chunk) == 1 else VerifyResults(results=chunk)
            self._outbox.put(self.result_topic, message)

    def _emit(
        self,
        pending: _Pending,
        verification: Verification | None,
        dispatched: float,
        compute_ms: float,
        error: str = "",
        prefilled: int = 0,
        pipe_ms: float = 0.0,
    ) -> None:
        request = pending.request
        if pending.done is not None:
            # A leased round stays here: no VerifyResult is built for it.
            error = error or (verification.error if verification is not None else "")
            verified = Verified(
                n_accepted=verification.n_accepted if verification is not None else 0,
                next_token=verification.next_token if verification is not None else None,
                error=error[:1024],
                queue_ms=max(0.0, (dispatched - pending.received_at) * 1e3),
                verify_ms=compute_ms,
                pipe_ms=pipe_ms,
                batch_size=verification.batch_size if verification is not None else 1,
                batch_prefilled=prefilled,
                features=verification.features if verification is not None else None,
            )
            if error:
                self.counters.failed += 1
            else:
                self.counters.served += 1
            if not pending.done.done():
                pending.done.set_result(verified)
            self._returns.answered(request.session_id, time.perf_counter())
            return
        result = VerifyResult(
            request_id=request.request_id,
            session_id=request.session_id,
            round=request.round,
            base_len=len(request.context_ids),
            n_accepted=verification.n_accepted if verification is not None else 0,
            next_token=verification.next_token if verification is not None else None,
            verifier_id=self.config.verifier_id,
            queue_ms=max(0.0, (dispatched - pending.received_at) * 1e3),
            verify_ms=compute_ms,
            batch_size=verification.batch_size if verification is not None else 1,
            batch_prefilled=prefilled,
            error=(error or (verification.error if verification is not None else ""))[:1024],
            features=verification.features if verification is not None else None,
        )
        if verification is not None and verification.draft_tokens is not None:
            result = result.model_copy(
                update={
                    "draft_tokens": verification.draft_tokens,
                    "q_ids": verification.q_ids,
                    "q_probs": verification.q_probs,
                    "draft_ms": verification.draft_ms,
                }
            )
        if result.error:
            self.counters.failed += 1
        else:
            self.counters.served += 1
        self._outbox.put(self.result_topic, result)
        self._returns.answered(request.session_id, time.perf_counter())

    async def _restart_child(self) -> None:
        self._sessions_cached = 0
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                ready = await self.child.start()
            except ChildStartError as exc:
                log.error(
                    "restart %d/%d of the inference process failed: %s",
                    attempt,
                    RESTART_ATTEMPTS,
                    exc,
                )
                await asyncio.sleep(RESTART_BACKOFF_S * 2 ** (attempt - 1))
                continue
            self.counters.child_restarts += 1
            self._loaded = ready
            return
        raise VerifierError(f"the inference process failed to restart {RESTART_ATTEMPTS} times")


def _target_ms(compute_ms: float, verifications: Sequence[Verification]) -> float:
    """Of a pass's time in the inference process, the target's: its rounds' host drafting
    ran inside the same call."""
    return max(0.0, compute_ms - sum(v.draft_ms for v in verifications))


def _ran_at(request: VerifyRequest) -> tuple[int, int, int]:
    """A stream round's (round, base length, window) as its request put it to the pass."""
    return request.round, len(request.context_ids), request.cloud_k or 0


def _row_choice(stream: HostStream, choice: PassChoice | None, window: int) -> PassChoice:
    """The pass's choice as one stream's round saw it: its own window, cut to what fitted."""
    if not stream.adaptive:
        return PassChoice(
            k=window, rows=1 if choice is None else choice.rows, reason="the session's own window"
        )
    assert choice is not None
    return choice.model_copy(update={"k": window})


def refusal_reply(payload: bytes, reason: str, verifier_id: str) -> VerifyResult | None:
    """An error result for a refused request, when its id, session and round can be read."""
    try:
        document = json.loads(payload)
        # Only a request gets a result; any other message here was misrouted, not ours to answer.
        if not isinstance(document, dict) or document.get("type") != "verify_request":
            return None
        context = document.get("context_ids")
        return VerifyResult(
            request_id=document["request_id"],
            session_id=document["session_id"],
            round=document["round"],
            base_len=len(context) if isinstance(context, list) else 0,
            verifier_id=verifier_id,
            error=f"refused: {reason}"[:1024],
        )
    # Beyond reach of a reply: the refusal is already logged by the caller.
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
