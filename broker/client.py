"""The MQTT boundary: the one module that imports the MQTT client library.

Everything above it sees `BusClient` (publish, subscribe, an async iterator of `Incoming`) and
`run_with_reconnect`, which keeps a session alive with jittered exponential backoff. TCP_NODELAY
is set on every socket: without it Nagle's algorithm and delayed ACKs turn a QoS 1 round trip of
a fraction of a millisecond into tens of milliseconds. The first publish of an event-loop turn goes
onto the socket when it is made (`_started`, `_write_at_once`), not turns later behind whatever
else is ready then.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
import socket
import ssl
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast
from urllib.parse import urlsplit

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

log = logging.getLogger(__name__)

T = TypeVar("T")

# Module-level so tests can shrink them.
RECONNECT_MIN_S = 0.2
# The ceiling of the jittered backoff. A link back after a long outage is found within this;
# full jitter spreads a fleet's reconnects over it (10k devices: ~2k connects/s at most).
RECONNECT_MAX_S = 5.0
# Refused credentials are retried this slowly: an operator may fix the registry meanwhile.
AUTH_RETRY_S = 15.0
# A connection that lasted this long resets the backoff: the broker was healthy.
STABLE_CONNECTION_S = 10.0
CONNECT_TIMEOUT_S = 10.0
# A 3.1.1-only broker may never answer an MQTT 5 CONNECT; don't wait long for it.
V5_PROBE_TIMEOUT_S = 2.0
# MQTT 5 session expiry for persistent sessions: QoS 1 messages queued while a client is away
# survive a drop of this length.
SESSION_EXPIRY_S = 3600

Protocol = Literal["auto", "5", "3.1.1"]


class BusConnectionError(Exception):
    """The broker could not be reached, refused us, or dropped the connection."""


class BusAuthError(BusConnectionError):
    """The broker refused our credentials: retrying will not help."""


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker listens: `mqtt://host:port` or `mqtts://host:port` (TLS)."""

    host: str
    port: int
    tls: bool = False
    ca_file: Path | None = None

    @classmethod
    def from_url(cls, url: str, ca_file: Path | None = None) -> BrokerAddress:
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        tls = parts.scheme in ("mqtts", "ssl")
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"broker URL {url!r} has an invalid port") from None
        return cls(parts.hostname, port, tls, ca_file)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Will:
    """Published by the broker when the client vanishes without a clean disconnect."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class ConnectOptions:
    client_id: str
    username: str | None = None
    password: str | None = None
    keepalive_s: int = 10
    will: Will | None = None
    # A persistent session keeps subscriptions and queued QoS 1 messages across short drops.
    persistent: bool = False
    protocol: Protocol = "auto"
    tcp_nodelay: bool = True
    # Which incoming messages jump the queue: topic -> rank, lower first (None: arrival order).
    # Messages of one topic keep their order, as MQTT orders them only within a topic.
    priority: Callable[[str], int] | None = None


def _ranked_queue(rank: Callable[[str], int]) -> type[asyncio.Queue[aiomqtt.Message]]:
    """A queue of incoming messages that hands out the lowest rank first and, within a rank,
    the oldest: what a busy reader must not leave waiting behind a backlog (a verifier's
    heartbeat behind a thousand device statuses) comes next."""

    class RankedQueue(asyncio.Queue[aiomqtt.Message]):
        # asyncio.Queue's own methods count and test `self._queue`: the heap is kept there.
        def _init(self, maxsize: int) -> None:
            self._queue: list[tuple[int, int, aiomqtt.Message]] = []
            self._arrived = 0

        def _put(self, item: aiomqtt.Message) -> None:
            self._arrived += 1
            heapq.heappush(self._queue, (rank(item.topic.value), self._arrived, item))

        def _get(self) -> aiomqtt.Message:
            return heapq.heappop(self._queue)[2]

    return RankedQueue


@dataclass(frozen=True)
class Incoming:
    topic: str
    payload: bytes
    retain: bool = False


@dataclass
class BusClient:
    """A connected MQTT session."""

    _client: aiomqtt.Client
    protocol: Literal["5", "3.1.1"]
    connected_at: float = field(default_factory=time.monotonic)
    _lost: asyncio.Event = field(default_factory=asyncio.Event)
    _lost_waiter: asyncio.Task[bool] | None = None

    def mark_lost(self) -> None:
        """The connection is gone: publishes still waiting for their PUBACK fail now, instead
        of at the client's timeout, so that their callers go on to reconnect and resend."""
        self._lost.set()

    async def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        await self.published(topic, self.start_publish(topic, payload, qos, retain))

    def start_publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False
    ) -> asyncio.Future[Any]:
        """Queue the packet now, and write it now where it can (`_write_at_once`): in the
        caller's step, not when the loop next runs a new task, behind every other callback
        ready by then. `published` waits for its acknowledgement; raises BusConnectionError
        when the connection is known lost."""
        if self._lost.is_set():
            raise BusConnectionError(f"publish to {topic} failed: the connection was lost")
        return _started(self._client.publish(topic, payload, qos=qos, retain=retain))

    async def published(self, topic: str, publishing: asyncio.Future[Any]) -> None:
        """Until the broker has acknowledged what `start_publish` started (at once for QoS 0);
        BusConnectionError if the connection is lost first."""
        lost = self._lost_waiter
        if lost is None:
            lost = self._lost_waiter = asyncio.ensure_future(self._lost.wait())
        await asyncio.wait((publishing, lost), return_when=asyncio.FIRST_COMPLETED)
        if not publishing.done():
            publishing.cancel()
            raise BusConnectionError(f"publish to {topic} failed: the connection was lost")
        try:
            publishing.result()
        except aiomqtt.MqttError as exc:
            raise BusConnectionError(f"publish to {topic} failed: {exc}") from exc

    async def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        try:
            granted = await self._client.subscribe(topic_filter, qos=qos)
        except aiomqtt.MqttError as exc:
            raise BusConnectionError(f"subscribe to {topic_filter} failed: {exc}") from exc
        # A broker signals a refused subscription (e.g. by ACL) with a failure code >= 0x80.
        codes = [code.value if isinstance(code, ReasonCode) else int(code) for code in granted]
        if any(code >= 0x80 for code in codes):
            raise BusConnectionError(f"subscription to {topic_filter} refused (codes {codes})")

    async def messages(self) -> AsyncIterator[Incoming]:
        try:
            async for message in self._client.messages:
                payload = message.payload
                yield Incoming(
                    topic=message.topic.value,
                    payload=payload if isinstance(payload, bytes) else str(payload).encode(),
                    retain=message.retain,
                )
        except aiomqtt.MqttError as exc:
            raise BusConnectionError(f"connection lost: {exc}") from exc


# aiomqtt warns past 10 publishes awaiting their PUBACK; a batch of 32 sessions' verdicts is
# normal here, and a backlog worth a warning is one of several passes.
PENDING_PUBLISHES_WARNING = 256


def _tls_context(address: BrokerAddress) -> ssl.SSLContext | None:
    if not address.tls:
        return None
    context = ssl.create_default_context(cafile=str(address.ca_file) if address.ca_file else None)
    return context


def _make_client(
    address: BrokerAddress, options: ConnectOptions, protocol: Literal["5", "3.1.1"]
) -> aiomqtt.Client:
    will = None
    if options.will is not None:
        will = aiomqtt.Will(
            options.will.topic, options.will.payload, options.will.qos, options.will.retain
        )
    socket_options = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),) if options.tcp_nodelay else ()
    if protocol == "5":
        properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        properties.SessionExpiryInterval = SESSION_EXPIRY_S if options.persistent else 0
        return aiomqtt.Client(
            address.host,
            address.port,
            identifier=options.client_id,
            username=options.username,
            password=options.password,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=not options.persistent,
            properties=properties,
            will=will,
            keepalive=options.keepalive_s,
            timeout=V5_PROBE_TIMEOUT_S if options.protocol == "auto" else CONNECT_TIMEOUT_S,
            tls_context=_tls_context(address),
            socket_options=socket_options,
            queue_type=None if options.priority is None else _ranked_queue(options.priority),
        )
    return aiomqtt.Client(
        address.host,
        address.port,
        identifier=options.client_id,
        username=options.username,
        password=options.password,
        protocol=aiomqtt.ProtocolVersion.V311,
        clean_session=not options.persistent,
        will=will,
        keepalive=options.keepalive_s,
        timeout=CONNECT_TIMEOUT_S,
        tls_context=_tls_context(address),
        socket_options=socket_options,
        queue_type=None if options.priority is None else _ranked_queue(options.priority),
    )


def _started(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """`coro` run up to its first wait in the caller's step, the rest as a task of its own.

    What Python 3.12's eager tasks do, for 3.10 and 3.11, whose tasks start at the loop's next
    turn. On 3.12 and later this is an eager task. Before, the first step runs here and a task
    adopts the coroutine where it stopped (`_Adopted`), waiting on what it yielded as if it had
    run it from the start. Meant for a coroutine whose first step does not ask for the current
    task (aiomqtt's publish on 3.10-3.11, whose `wait_for` does not).
    """
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg,unused-ignore]
    try:
        blocker = coro.send(None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except Exception as exc:
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return loop.create_task(_adopt(_Adopted(coro, blocker)))


class _Adopted(Generic[T]):
    """A coroutine suspended on `blocker` (the future it awaits, or None for a bare yield), to
    be awaited by a task: each step yields what the coroutine yielded, so the task waits on it
    (and cancels it) exactly as it would for the coroutine itself; what the task sends or throws
    in goes on to the coroutine. A first version waited with `asyncio.wait` at each step: the
    verifier of `bench fleet` then took 0.73 ms of CPU a round at saturation, 0.68-0.69 now."""

    def __init__(self, coro: Coroutine[Any, Any, T], blocker: Any) -> None:
        self._coro = coro
        self._blocker = blocker

    def __await__(self) -> Generator[Any, None, T]:
        coro, blocker = self._coro, self._blocker
        while True:
            try:
                yield blocker
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as thrown:  # the task's cancellation, as it throws it
                try:
                    blocker = coro.throw(thrown)
                except StopIteration as stop:
                    return cast(T, stop.value)
                continue
            try:
                blocker = coro.send(None)
            except StopIteration as stop:
                return cast(T, stop.value)


async def _adopt(adopted: _Adopted[T]) -> T:
    return await adopted


class _TurnWrite:
    """One packet a turn of an event loop goes onto its socket at once; the rest of that turn's
    wait for the writers, after the next select, and go out together."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._taken = False

    def take(self) -> bool:
        if self._taken:
            return False
        self._taken = True
        self._loop.call_soon(self._free)  # runs in the loop's next turn
        return True

    def _free(self) -> None:
        self._taken = False


_TURN_WRITES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _TurnWrite] = (
    weakref.WeakKeyDictionary()
)


def _first_write_of_turn() -> bool:
    """On an event loop's thread, and no packet of its current turn written at once yet (this
    one takes the turn's slot)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False  # paho connecting, on aiomqtt's worker thread
    turn = _TURN_WRITES.get(loop)
    if turn is None:
        turn = _TURN_WRITES[loop] = _TurnWrite(loop)
    return turn.take()


def _wrote_all(mqttc: Any) -> bool:
    """Write what paho has queued now; whether the socket took it all. When it did, paho marks
    the writer unregistered again (and asks aiomqtt to remove one it never added: a no-op)."""
    try:
        mqttc.loop_write()
    except Exception as exc:
        log.debug("immediate write failed (%s); left to the loop's writer", exc)
        return False
    return not mqttc.want_write()


def _write_at_once(client: aiomqtt.Client) -> None:
    """Write the first outgoing packet of each event-loop turn when it is queued, instead of
    loop turns later.

    aiomqtt hands paho the event loop: a packet paho queues asks for the socket as a writer,
    aiomqtt adds the writer at the loop's next turn (`call_soon_threadsafe`), and the packet is
    written after the select of the turn after, behind every callback ready by then. In an agent,
    whose verdict also wakes its local API's stream, that put 1-2 ms between building a draft
    and its leaving (`bench e2e`: uplink p50 2.7 ms with the hybrid drafter, 1.5 with draft-l1,
    whose drafting thread let the stream go first). So the packet is written at once, as paho
    does itself without an external loop, and with its guard: never from inside one of paho's
    callbacks, whose lock the write may take, and only on the event loop's thread (aiomqtt
    connects from a worker thread). Only the turn's first packet, of all the loop's clients:
    with every one written at once `bench fleet`'s broker was 0.10-0.11 busy at saturation
    against 0.07-0.08, woken for each packet where the writers' burst after a select woke it
    once for many (and the run served 6-10% fewer rounds, part of it the cost `_Adopted` took
    away). What the socket does not take, a packet after the turn's first, or a
    write that failed (whose error the writer then meets and ends the connection with) waits
    for the writer, registered as before. The names of the paho client and of that lock are
    private to the two libraries: where they are missing, writes wait for the writer as before.
    """
    paho = getattr(client, "_client", None)
    register = getattr(paho, "on_socket_register_write", None)
    in_callback = getattr(paho, "_in_callback_mutex", None)
    if paho is None or register is None or in_callback is None:
        log.debug("writes wait for the event loop's writer: no paho client or lock found")
        return

    def write_or_register(mqttc: Any, userdata: Any, sock: Any) -> None:
        # paho's guard first, so that a packet queued inside a callback takes no turn's slot.
        if in_callback.acquire(False):
            in_callback.release()
            if _first_write_of_turn() and _wrote_all(mqttc):
                return
        register(mqttc, userdata, sock)

    paho.on_socket_register_write = write_or_register


def _is_auth_refusal(exc: aiomqtt.MqttError) -> bool:
    rc = getattr(exc, "rc", None)
    # 3.1.1: 4 bad credentials, 5 not authorised; MQTT 5: 0x86 bad credentials, 0x87 not authorised.
    return rc is not None and int(getattr(rc, "value", rc)) in (4, 5, 0x86, 0x87)


# Brokers known to speak only 3.1.1 are remembered, so reconnects skip the MQTT 5 attempt.
_V311_ONLY: set[tuple[str, int]] = set()


@contextlib.asynccontextmanager
async def connect(address: BrokerAddress, options: ConnectOptions) -> AsyncIterator[BusClient]:
    """Connect once, with MQTT 5 where the broker offers it and 3.1.1 otherwise."""
    attempts: list[Literal["5", "3.1.1"]]
    if options.protocol == "auto":
        attempts = ["3.1.1"] if (address.host, address.port) in _V311_ONLY else ["5", "3.1.1"]
    else:
        attempts = [options.protocol]
    last_error: aiomqtt.MqttError | None = None
    for protocol in attempts:
        client = _make_client(address, options, protocol)
        _write_at_once(client)
        # A verifier's pass or a coordinator's group commit answers dozens of sessions at once;
        # that many publishes in flight is the design, not a backlog worth a warning each.
        client.pending_calls_threshold = PENDING_PUBLISHES_WARNING
        try:
            await client.__aenter__()
        except aiomqtt.MqttError as exc:
            last_error = exc
            if _is_auth_refusal(exc):
                raise BusAuthError(f"{address.url} refused the credentials: {exc}") from exc
            if protocol == "5" and len(attempts) > 1:
                log.debug("MQTT 5 refused by %s (%s); trying 3.1.1", address.url, exc)
                continue
            raise BusConnectionError(f"cannot connect to {address.url}: {exc}") from exc
        client.timeout = CONNECT_TIMEOUT_S  # the short MQTT 5 probe timeout was for CONNECT only
        if protocol == "3.1.1" and options.protocol == "auto":
            _V311_ONLY.add((address.host, address.port))
        bus = BusClient(client, protocol)
        try:
            yield bus
        finally:
            # The wait behind every publish ends with the connection: left pending, it was
            # destroyed with the loop, logging 'Task was destroyed but it is pending!'.
            if bus._lost_waiter is not None:
                bus._lost_waiter.cancel()
            with contextlib.suppress(aiomqtt.MqttError):
                await client.__aexit__(None, None, None)
        return
    raise BusConnectionError(f"cannot connect to {address.url}: {last_error}")


class Backoff:
    """Full-jitter exponential backoff: each `next()` waits up to twice as long as the last."""

    def __init__(self, minimum: float | None = None, maximum: float | None = None) -> None:
        self.minimum = RECONNECT_MIN_S if minimum is None else minimum
        self.maximum = RECONNECT_MAX_S if maximum is None else maximum
        self.attempt = 0

    def next(self) -> float:
        ceiling = min(self.maximum, self.minimum * 2.0**self.attempt)
        self.attempt += 1
        return random.uniform(self.minimum, max(self.minimum, ceiling))

    def reset(self) -> None:
        self.attempt = 0


async def run_with_reconnect(
    address: BrokerAddress,
    options: ConnectOptions,
    session: Callable[[BusClient], Awaitable[None]],
    on_disconnect: Callable[[Exception], Awaitable[None]] | None = None,
) -> None:
    """Run `session` on a connected client; reconnect with jittered backoff when it drops.

    Returns when `session` returns. Refused credentials are retried too, slowly, since an
    operator may fix the registry while the device keeps trying.
    """
    backoff = Backoff()
    while True:
        connected_at: float | None = None
        try:
            async with connect(address, options) as client:
                connected_at = time.monotonic()
                log.info(
                    "connected to %s as %s (MQTT %s)",
                    address.url,
                    options.client_id,
                    client.protocol,
                )
                try:
                    await session(client)
                finally:
                    client.mark_lost()
                return
        except BusConnectionError as exc:
            if connected_at is not None and time.monotonic() - connected_at >= STABLE_CONNECTION_S:
                backoff.reset()
            if on_disconnect is not None:
                await on_disconnect(exc)
            wait = backoff.next()
            if isinstance(exc, BusAuthError):
                wait = max(wait, AUTH_RETRY_S)
            log.warning("bus: %s; reconnecting in %.2fs", exc, wait)
            await asyncio.sleep(wait)
