"""The emulator proper: an asyncio TCP proxy whose link takes a profile, and can stall or be cut."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from netem.profiles import LinkShape, Profile, get_profile

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
ACCEPTS_KEPT = 64  # client connections whose acceptance time is kept (`connected_since`)
UP = "up"
DOWN = "down"


@dataclass
class _Direction:
    """One direction of the emulated link, shared by all its connections like a real radio."""

    busy_until: float = 0.0  # monotonic: when the last chunk finished its serialisation
    bytes: int = 0


@dataclass(eq=False)  # kept in a set by identity
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in (self.client, self.upstream):
            writer.transport.abort()


class NetworkEmulator:
    """`async with NetworkEmulator(listen_port, host, port, profile="4g") as link:` proxies TCP.

    Clients connect to `listen_host:port`; each connection gets its own upstream connection.
    `stall` holds bytes in both directions while connections stay open; `cut` closes every
    connection and refuses new ones until it ends. A listen_port of 0 takes a free port.
    """

    def __init__(
        self,
        listen_port: int,
        upstream_host: str,
        upstream_port: int,
        *,
        listen_host: str = "127.0.0.1",
        profile: str | Profile = "lan",
        seed: int | None = None,
    ) -> None:
        self.listen_host = listen_host
        self.port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self._random = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._directions = {UP: _Direction(), DOWN: _Direction()}
        self._link_up = asyncio.Event()
        self._link_up.set()
        self._cut = False
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._reopening: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[object]] = set()
        # When the latest client connections were accepted (monotonic), the oldest dropped.
        self._accepted: deque[float] = deque(maxlen=ACCEPTS_KEPT)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self._serve(self._bind())
        log.info(
            "netem %s:%d -> %s:%d (%s)",
            self.listen_host,
            self.port,
            self.upstream_host,
            self.upstream_port,
            self.profile.name,
        )
        if self.profile.offline:
            self.cut(None)

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._reopening is not None:
            await self._reopening
        self._stop_listening()
        self._drop_all()
        # Handlers still connecting upstream finish now, before their loop goes away.
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def __aenter__(self) -> NetworkEmulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    # --- control ---------------------------------------------------------------------------

    def set_profile(self, profile: str | Profile) -> None:
        """Shape the link from now on; `offline` cuts it, and any other profile restores it."""
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        log.info("netem: profile %s", self.profile.name)
        if self.profile.offline:
            self.cut(None)
        elif self._cut:
            self._end_cut()

    def cut(self, seconds: float | None) -> None:
        """Close every connection and refuse new ones for `seconds` (None: until restored)."""
        self._cut = True
        self._stop_listening()
        self._drop_all()
        self._schedule("cut", seconds, self._end_cut)
        log.info("netem: link cut for %s", "ever" if seconds is None else f"{seconds:.2f}s")

    def stall(self, seconds: float | None) -> None:
        """Hold all bytes for `seconds` (None: until restored); connections stay open."""
        self._link_up.clear()
        self._schedule("stall", seconds, self._end_stall)
        log.info("netem: link stalled for %s", "ever" if seconds is None else f"{seconds:.2f}s")

    def restore(self) -> None:
        """End any cut or stall; the profile stays (an `offline` profile becomes `lan`)."""
        if self.profile.offline:
            self.profile = get_profile("lan")
        self._end_cut()
        self._end_stall()

    @property
    def is_cut(self) -> bool:
        return self._cut

    @property
    def is_stalled(self) -> bool:
        return not self._link_up.is_set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def bytes_carried(self, direction: str) -> int:
        return self._directions[direction].bytes

    def connected_since(self, since: float) -> float | None:
        """When the first client connection accepted at or after `since` (time.monotonic) was
        accepted: after a cut, when the client got through again. None if none was (or it is
        older than the last ACCEPTS_KEPT)."""
        return next((at for at in self._accepted if at >= since), None)

    def _schedule(self, name: str, seconds: float | None, end: Callable[[], None]) -> None:
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        if seconds is not None:
            self._timers[name] = asyncio.get_running_loop().call_later(max(0.0, seconds), end)

    def _end_cut(self) -> None:
        timer = self._timers.pop("cut", None)
        if timer is not None:
            timer.cancel()
        if self._cut:
            log.info("netem: link restored")
            # Bound and listening before we return, so a client may connect at once; the
            # accepting starts when the event loop next runs.
            self._reopening = asyncio.get_running_loop().create_task(
                self._serve(self._bind()), name=f"netem-listen-{self.port}"
            )
        self._cut = False
        if self.profile.offline:
            self.profile = get_profile("lan")

    def _end_stall(self) -> None:
        timer = self._timers.pop("stall", None)
        if timer is not None:
            timer.cancel()
        self._link_up.set()

    def _bind(self) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.listen_host, self.port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self.port = listener.getsockname()[1]
        return listener

    async def _serve(self, listener: socket.socket) -> None:
        self._server = await asyncio.start_server(self._on_client, sock=listener)

    def _stop_listening(self) -> None:
        # Closing the listening socket makes new connections fail with ECONNREFUSED at once,
        # which clients notice sooner than a connection accepted and then dropped.
        if self._server is not None:
            self._server.close()
            self._server = None

    def _drop_all(self) -> None:
        for connection in list(self._connections):
            connection.abort()
        self._connections.clear()

    # --- the proxy ---------------------------------------------------------------------------

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted.append(time.monotonic())
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._relay(reader, writer)
        finally:
            self._handlers.discard(handler)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError as exc:
            log.warning("netem: upstream %s:%d: %s", self.upstream_host, self.upstream_port, exc)
            writer.transport.abort()
            return
        connection = _Connection(writer, up_writer)
        if self._cut:  # cut while we were connecting upstream
            connection.abort()
            return
        self._connections.add(connection)
        up = self._pipe(reader, up_writer, UP, connection)
        down = self._pipe(up_reader, writer, DOWN, connection)
        connection.tasks = [
            asyncio.create_task(up, name=f"netem-up-{self.port}"),
            asyncio.create_task(down, name=f"netem-down-{self.port}"),
        ]
        await asyncio.gather(*connection.tasks, return_exceptions=True)
        self._connections.discard(connection)
        connection.abort()

    def _shape(self, direction: str) -> LinkShape:
        return self.profile.up if direction == UP else self.profile.down

    def _delivery_time(self, direction: str, size: int, previous: float) -> float:
        """When a chunk read now reaches the far end: serialisation, then latency and jitter."""
        shape = self._shape(direction)
        now = time.monotonic()
        state = self._directions[direction]
        sent = now
        if shape.rate_kbit_s is not None:
            sent = max(now, state.busy_until) + size * 8 / (shape.rate_kbit_s * 1000.0)
            state.busy_until = sent
        jitter = self._random.uniform(-shape.jitter_ms, shape.jitter_ms) if shape.jitter_ms else 0
        delay_s = max(0.0, shape.latency_ms + jitter) / 1000.0
        # TCP delivers bytes in order, so jitter may delay a chunk but never overtake one.
        return max(sent + delay_s, previous)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: str,
        connection: _Connection,
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            previous = 0.0
            try:
                while chunk := await reader.read(CHUNK_BYTES):
                    previous = self._delivery_time(direction, len(chunk), previous)
                    queue.put_nowait((previous, chunk))
            except (ConnectionError, OSError):
                pass  # the other end vanished; the writer finishes what it holds, then closes
            queue.put_nowait(None)

        async def write() -> None:
            while (item := await queue.get()) is not None:
                deliver_at, chunk = item
                await self._link_up.wait()
                delay = deliver_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._link_up.wait()  # a stall that began while this chunk was in flight
                writer.write(chunk)
                await writer.drain()
                self._directions[direction].bytes += len(chunk)
            if writer.can_write_eof():
                writer.write_eof()

        reading = asyncio.create_task(read(), name=f"netem-read-{direction}")
        try:
            await write()
        except (ConnectionError, OSError):
            connection.abort()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
