"""The verifier pool: who is alive, how loaded, which sessions each holds; routing and fail-over."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from broker import messages as m
from broker.topics import VerifierChannel, verifier_topic

log = logging.getLogger(__name__)

# A verifier silent for this many heartbeats is dead; its work goes elsewhere.
MISSED_HEARTBEATS = 3.0
WATCH_INTERVAL_S = 0.25
# How long one verification may take before it is sent again elsewhere, and how many more such
# spells it is waited for while its verifier heartbeats with work in hand: a host at full load
# takes minutes over a wave of prefills, and resending then only doubles its work.
VERIFY_TIMEOUT_S = 30.0
BUSY_WAITS = 4
MAX_ATTEMPTS = 4
NO_VERIFIER_WAIT_S = 30.0
# How long a verifier has to take or give back a lease (it answers after the round in flight).
LEASE_TIMEOUT_S = 5.0

# How long an offline verifier stays listed (settings: verifier_forget_after_s).
FORGET_AFTER_S = 3600.0

Publish = Callable[[str, bytes], Awaitable[None]]
T = TypeVar("T")


class NoVerifierError(Exception):
    """No live verifier could take the work in time."""


class VerificationFailed(Exception):
    """Every attempt at a verification failed."""


@dataclass
class Pending:
    request: m.VerifyRequest
    verifier_id: str
    future: asyncio.Future[m.VerifyResult]
    sent_at: float


@dataclass
class StreamPending:
    """A host stream in flight on a verifier: its results, in the order they come."""

    request: m.VerifyRequest
    verifier_id: str
    results: asyncio.Queue[m.VerifyResult | _Reroute] = field(default_factory=asyncio.Queue)


@dataclass
class VerifierInfo:
    verifier_id: str
    status: m.VerifierStatus
    last_heartbeat: float  # monotonic, coordinator clock
    sessions: set[str] = field(default_factory=set)
    in_flight: dict[str, Pending] = field(default_factory=dict)  # request_id -> pending
    streams: dict[str, StreamPending] = field(default_factory=dict)  # request_id -> stream

    @property
    def alive(self) -> bool:
        return self.status.state is m.DeviceState.ONLINE

    @property
    def load(self) -> int:
        """What this verifier has to do: our requests in flight, the streams it runs (a round of
        each in every pass) and its own reported queue."""
        return len(self.in_flight) + len(self.streams) + self.status.queue_depth


class VerifierPool:
    def __init__(
        self,
        publish: Publish,
        *,
        forget_after_s: float = FORGET_AFTER_S,
        clear_status: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._publish = publish
        # A verifier offline this long (since this coordinator last heard from it) is dropped,
        # and `clear_status` clears its retained status on the broker.
        self.forget_after_s = forget_after_s
        self._clear_status = clear_status
        self.verifiers: dict[str, VerifierInfo] = {}
        self._changed = asyncio.Event()
        self.failovers = 0
        self._lease_acks: dict[str, asyncio.Future[m.LeaseAck]] = {}  # lease id -> its answer
        # Called with the id of a verifier declared dead, after its requests were moved.
        self.lost_observers: list[Callable[[str], None]] = []
        # Coordinators sharing a fleet see each other's results: unknown ones are not news.
        self.shared = False

    # --- what verifiers tell us ---------------------------------------------------------------

    async def on_status(self, verifier_id: str, status: m.VerifierStatus) -> None:
        if status.verifier_id != verifier_id:
            log.warning("verifier %s spoke as %s; ignored", verifier_id, status.verifier_id)
            return
        info = self.verifiers.get(verifier_id)
        if info is None:
            info = self.verifiers[verifier_id] = VerifierInfo(verifier_id, status, time.monotonic())
            log.info("verifier %s joined (%s)", verifier_id, status.state.value)
        was_alive = info.alive
        previous = info.status
        info.status = status
        info.last_heartbeat = time.monotonic()
        if was_alive and not info.alive:
            # A verifier that stops cleanly says so itself as it leaves, holding its leases at
            # that moment; its Will, the broker's word that it vanished, was written when it
            # connected, so it is older than the heartbeat before it.
            if status.at >= previous.at:
                await self._fail_over(info, "left", leased=len(status.leased), orderly=True)
            else:
                await self._fail_over(info, "went offline", leased=len(previous.leased))
        self._changed.set()

    async def on_result(self, verifier_id: str, result: m.VerifyResult) -> None:
        info = self.verifiers.get(verifier_id)
        stream = info.streams.get(result.request_id) if info else None
        if info is not None and stream is not None:
            info.last_heartbeat = time.monotonic()
            info.sessions.add(result.session_id)
            stream.results.put_nowait(result)
            return
        pending = info.in_flight.pop(result.request_id, None) if info else None
        if pending is None:
            log.log(
                logging.DEBUG if self.shared else logging.INFO,
                "late result %s from %s (already resent, or another coordinator's)",
                result.request_id,
                verifier_id,
            )
            return
        if info is not None:
            info.last_heartbeat = time.monotonic()  # a result proves it is alive
            info.sessions.add(result.session_id)
        if not pending.future.done():
            pending.future.set_result(result)

    async def on_results(self, verifier_id: str, results: m.VerifyResults) -> None:
        """The rounds of one pass for batched streams, each taken as if it had come alone."""
        for result in results.results:
            await self.on_result(verifier_id, result)

    async def on_lease_ack(self, verifier_id: str, ack: m.LeaseAck) -> None:
        waiter = self._lease_acks.get(ack.lease_id)
        if waiter is not None and not waiter.done() and ack.verifier_id == verifier_id:
            waiter.set_result(ack)

    # --- direct rounds ------------------------------------------------------------------------

    def lessor(self, session_id: str) -> VerifierInfo | None:
        """The live verifier that takes leases and suits the session best, if any."""
        candidates = [v for v in self.live() if v.status.leases]
        if not candidates:
            return None
        for info in candidates:
            if session_id in info.sessions:
                return info
        return min(candidates, key=lambda v: (v.load, v.verifier_id))

    def holder(self, session_id: str) -> str | None:
        """The live verifier whose heartbeat says it holds the session's lease (what a
        coordinator that restarted learns from the retained statuses)."""
        for info in self.live():
            if session_id in info.status.leased:
                return info.verifier_id
        return None

    def is_alive(self, verifier_id: str) -> bool:
        info = self.verifiers.get(verifier_id)
        return info is not None and info.alive

    async def lease(self, verifier_id: str, message: m.SessionLease | m.LeaseEnd) -> m.LeaseAck:
        """Send a lease (or its end) and wait for the verifier's answer; TimeoutError if none."""
        waiter: asyncio.Future[m.LeaseAck] = asyncio.get_running_loop().create_future()
        self._lease_acks[message.lease_id] = waiter
        try:
            await self._send_work(verifier_id, message)
            return await asyncio.wait_for(waiter, LEASE_TIMEOUT_S)
        finally:
            self._lease_acks.pop(message.lease_id, None)

    async def tell(self, verifier_id: str, message: m.SessionLease | m.LeaseEnd) -> None:
        """A lease message whose answer is not waited for (a new policy, a state to send, the
        end of a lease taken back from a verifier declared dead)."""
        await self._send_work(verifier_id, message)

    async def _send_work(self, verifier_id: str, message: m.Message) -> None:
        await self._publish(verifier_topic(verifier_id, VerifierChannel.WORK), m.encode(message))

    # --- routing ------------------------------------------------------------------------------

    def live(self) -> list[VerifierInfo]:
        return [v for v in self.verifiers.values() if v.alive]

    def reported_costs(self) -> tuple[tuple[float, float, float] | None, dict[str, float]]:
        """The live verifiers' own cost models, averaged over those that report one: a pass's
        (a, b, c) of a + b rows + c rows positions, and each host drafter's ms a token."""
        live = self.live()
        fits = [v.status.pass_cost for v in live if v.status.pass_cost is not None]
        pass_cost = None
        if fits:
            a, b, c = (sum(fit[i] for fit in fits) / len(fits) for i in range(3))
            pass_cost = (a, b, c)
        timed: dict[str, list[float]] = {}
        for info in live:
            for draft, ms in info.status.draft_ms.items():
                timed.setdefault(draft, []).append(ms)
        return pass_cost, {draft: sum(ms) / len(ms) for draft, ms in timed.items()}

    def vocab_size(self) -> int | None:
        """The target's vocabulary as the live verifiers report it (the smallest, should two
        disagree); None while none reports one."""
        sizes = [v.status.vocab_size for v in self.live() if v.status.vocab_size is not None]
        return min(sizes) if sizes else None

    def announced_target(self) -> m.VerifierStatus | None:
        """The heartbeat of the first live verifier (by id) that names its target's EOS: the
        target as the fleet runs it."""
        for info in sorted(self.live(), key=lambda v: v.verifier_id):
            if info.status.eos_id is not None:
                return info.status
        return None

    def pick(self, session_id: str, exclude: set[str] | None = None) -> VerifierInfo | None:
        """The verifier holding the session's cache, unless far busier than the least loaded."""
        candidates = [v for v in self.live() if v.verifier_id not in (exclude or set())]
        if not candidates:
            return None
        least = min(candidates, key=lambda v: (v.load, v.verifier_id))
        for info in candidates:
            if session_id in info.sessions and info.load <= least.load + info.status.max_batch:
                return info
        return least

    async def verify(self, request: m.VerifyRequest) -> m.VerifyResult:
        """Send to the best verifier; resend elsewhere on death, error or timeout."""
        tried: set[str] = set()
        last_error = "no attempt"
        for _ in range(MAX_ATTEMPTS):
            info = await self._wait_for_verifier(request.session_id, tried)
            attempt = request.model_copy(
                update={"request_id": secrets.token_hex(8), "sent_at": time.time()}
            )
            future: asyncio.Future[m.VerifyResult] = asyncio.get_running_loop().create_future()
            info.in_flight[attempt.request_id] = Pending(
                attempt, info.verifier_id, future, time.monotonic()
            )
            try:
                await self._send_work(info.verifier_id, attempt)
                result = await self._while_busy(info, partial(asyncio.shield, future), request)
            except asyncio.TimeoutError:
                last_error = f"{info.verifier_id} timed out"
                tried.add(info.verifier_id)
                continue
            except _Reroute as reroute:
                last_error = str(reroute)
                continue
            finally:
                info.in_flight.pop(attempt.request_id, None)
            if result.error:
                last_error = f"{info.verifier_id}: {result.error}"
                log.warning(
                    "verification of %s round %d failed on %s: %s; resending",
                    request.session_id,
                    request.round,
                    info.verifier_id,
                    result.error,
                )
                continue
            return result
        raise VerificationFailed(last_error)

    async def stream(self, request: m.VerifyRequest) -> AsyncGenerator[m.VerifyResult, None]:
        """Open a host stream on the best verifier and yield its results as they come, until
        one says the stream ends. StreamLost when the verifier dies, goes silent or the bus
        drops; the caller opens a new stream from what it has persisted."""
        info = await self._wait_for_verifier(request.session_id, set())
        attempt = request.model_copy(
            update={"request_id": secrets.token_hex(8), "sent_at": time.time()}
        )
        pending = StreamPending(attempt, info.verifier_id)
        info.streams[attempt.request_id] = pending
        try:
            await self._send_work(info.verifier_id, attempt)
            ended = False
            while not ended:
                try:
                    item = await self._while_busy(info, pending.results.get, request)
                except asyncio.TimeoutError:
                    raise StreamLost(f"{info.verifier_id} timed out") from None
                if isinstance(item, _Reroute):
                    raise StreamLost(str(item))
                if item.error:
                    raise StreamLost(f"{info.verifier_id}: {item.error}")
                ended = item.stream_ends
                yield item
        finally:
            # A stream left before its end is stopped, so the verifier spends no more on it.
            mine = info.streams.pop(attempt.request_id, None) is not None
            if mine and not ended and info.alive:
                stop = m.StreamStop(request_id=attempt.request_id, session_id=request.session_id)
                try:
                    await self._send_work(info.verifier_id, stop)
                except Exception as exc:  # the stream ends anyway with the stream's rounds
                    log.debug("could not stop stream %s: %s", attempt.request_id, exc)

    async def redraft(
        self, session_id: str, cloud_draft: str | None, cloud_k: int | None, alpha: float | None
    ) -> bool:
        """Give the session's running stream another drafter (None: plain decoding) from the
        verifier's next pass on (StreamRedraft). False where its verifier does not take one or
        no stream of it runs: the caller ends the stream and opens the next."""
        for info in self.live():
            for request_id, pending in info.streams.items():
                if pending.request.session_id != session_id:
                    continue
                if not info.status.redraft:
                    return False
                redraft = m.StreamRedraft(
                    request_id=request_id,
                    session_id=session_id,
                    cloud_draft=cloud_draft,
                    cloud_k=cloud_k,
                    alpha=alpha,
                )
                await self._send_work(info.verifier_id, redraft)
                return True
        return False

    async def _while_busy(
        self, info: VerifierInfo, wait: Callable[[], Awaitable[T]], request: m.VerifyRequest
    ) -> T:
        """`wait()` within VERIFY_TIMEOUT_S, and again (BUSY_WAITS times at most) while the
        verifier heartbeats with work in hand; asyncio.TimeoutError past that. A verifier that
        dies meanwhile is failed over by `watch`, which wakes the wait."""
        for spell in range(BUSY_WAITS + 1):
            try:
                return await asyncio.wait_for(wait(), VERIFY_TIMEOUT_S)
            except asyncio.TimeoutError:
                status = info.status
                busy = info.alive and status.in_flight + status.queue_depth > 0
                if not busy or spell == BUSY_WAITS:
                    raise
                log.warning(
                    "%s has not answered round %d of %s in %.0f s; it is busy (%d in flight, "
                    "%d queued), so it is waited for",
                    info.verifier_id,
                    request.round,
                    request.session_id,
                    (spell + 1) * VERIFY_TIMEOUT_S,
                    status.in_flight,
                    status.queue_depth,
                )
        raise AssertionError("unreachable")

    async def _wait_for_verifier(self, session_id: str, tried: set[str]) -> VerifierInfo:
        deadline = time.monotonic() + NO_VERIFIER_WAIT_S
        while True:
            info = self.pick(session_id, exclude=tried) or self.pick(session_id)
            if info is not None:
                return info
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoVerifierError("no live verifier")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue

    def reroute_all(self, why: str) -> int:
        """Send every request in flight again: after a drop of our own bus connection, any work
        message or result may have been lost with it. A result that still comes is ignored."""
        moved = 0
        for info in self.verifiers.values():
            for pending in list(info.in_flight.values()):
                if not pending.future.done():
                    pending.future.set_exception(_Reroute(why))
                    moved += 1
            info.in_flight.clear()
            for stream in info.streams.values():
                stream.results.put_nowait(_Reroute(why))
                moved += 1
        if moved:
            log.warning("%s; resending %d verifications", why, moved)
        return moved

    # --- liveness -----------------------------------------------------------------------------

    async def watch(self) -> None:
        """Declare dead the verifiers that missed their heartbeats, and move their work."""
        while True:
            slept_at = time.monotonic()
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            # Time this loop could not run (a starved host) is no silence of the verifiers':
            # their heartbeats may sit unread in the socket meanwhile.
            stalled = max(0.0, now - slept_at - 2 * WATCH_INTERVAL_S)
            for info in list(self.verifiers.values()):
                silent = now - info.last_heartbeat - stalled
                if info.alive and silent > MISSED_HEARTBEATS * info.status.heartbeat_s:
                    leased = len(info.status.leased)
                    info.status = info.status.model_copy(update={"state": m.DeviceState.OFFLINE})
                    await self._fail_over(
                        info, f"missed heartbeats for {silent:.1f}s", leased=leased
                    )
                elif not info.alive and now - info.last_heartbeat > self.forget_after_s:
                    await self._forget_long_gone(info, now - info.last_heartbeat)

    async def _forget_long_gone(self, info: VerifierInfo, silent_s: float) -> None:
        """Drop a verifier offline for forget_after_s, and clear its retained status so that no
        coordinator starting later lists it (a broker keeps a retained message for good)."""
        self.forget(info.verifier_id)
        log.info(
            "verifier %s offline for %.0fs: forgotten, its retained status cleared",
            info.verifier_id,
            silent_s,
        )
        if self._clear_status is not None:
            try:
                await self._clear_status(info.verifier_id)
            except Exception as exc:  # the next coordinator to start forgets it again
                log.warning("could not clear verifier %s's status: %s", info.verifier_id, exc)

    def forget(self, verifier_id: str) -> None:
        """Drop an offline verifier (its status was cleared, here or by a peer coordinator);
        one that is online stays: a status cleared as it came back is news to nobody."""
        info = self.verifiers.get(verifier_id)
        if info is not None and not info.alive:
            del self.verifiers[verifier_id]
            self._changed.set()

    async def _fail_over(
        self, info: VerifierInfo, why: str, *, leased: int, orderly: bool = False
    ) -> None:
        """Move a verifier's work elsewhere. A warning, unless it left in order with nothing to
        move (the end of a normal shutdown): its cached sessions only prefill again elsewhere."""
        moving = len(info.in_flight) + len(info.streams) + leased
        log.log(
            logging.INFO if orderly and not moving else logging.WARNING,
            "verifier %s %s; moving %d requests, %d streams and %d leased sessions "
            "(%d sessions cached there prefill again elsewhere)",
            info.verifier_id,
            why,
            len(info.in_flight),
            len(info.streams),
            leased,
            len(info.sessions),
        )
        self.failovers += 1
        info.sessions.clear()
        for pending in list(info.in_flight.values()):
            if not pending.future.done():
                pending.future.set_exception(_Reroute(f"{info.verifier_id} {why}"))
        info.in_flight.clear()
        for stream in info.streams.values():
            stream.results.put_nowait(_Reroute(f"{info.verifier_id} {why}"))
        for observe in self.lost_observers:
            observe(info.verifier_id)


class StreamLost(Exception):
    """A host stream broke off before its end; what it persisted stands."""


class _Reroute(Exception):
    """The verifier holding a request died; send the request elsewhere."""
