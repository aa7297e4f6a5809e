"""Coordinators sharing one fleet: devices fall into shards, and each shard has one owner at a
time, the coordinator holding its PostgreSQL advisory lock.

Why advisory locks: PostgreSQL already holds the fleet's truth, and a lock held by a connection
goes when that connection goes. A coordinator that is killed loses its shards as soon as the
server sees its socket close (at once on one host; across hosts, within the server's TCP
keepalive), with no lease clock to tune and no table to migrate. The survivors claim them on
their next step and rebuild those shards' sessions from the database, as a restarted coordinator
does.

Fencing: a lock held by a connection is only as good as that connection. When the server ends
it (a restart, pg_terminate_backend, a dead network seen by keepalives), the lock is free for a
peer at once, while this process learns it only when it next speaks on the connection. So
`owns()` looks at the idle lock connection's socket before answering: the server's farewell (an
error, then end of file) makes it readable, and from that moment this coordinator stops acting
for every shard (no round is persisted or published for them) until its next step gives them up
and claims afresh on a new connection.

Sharing is fair: each coordinator also holds one presence lock, so every one knows how many
share the fleet and claims up to its share; one holding more than its share hands the extra
shards back, after their sessions' in-flight work is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import select
import threading
import zlib
from collections.abc import Awaitable, Callable

import psycopg
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

N_SHARDS = 64
# The classid of our two-key advisory locks: one for shards, one for presence.
SHARD_LOCKS = 0x5F1E_E701
PRESENCE_LOCKS = 0x5F1E_E702
# How often a coordinator renews its view: a dead peer's shards move within about this long.
STEP_S = 1.0
# The lock connection notices a dead server within about 11 s (libpq TCP keepalives).
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3

ShardsChanged = Callable[[frozenset[int]], Awaitable[None]]


def shard_of(device_id: str) -> int:
    """A device's shard: stable across processes and Python versions (not `hash`)."""
    return zlib.crc32(device_id.encode()) % N_SHARDS


class ShardsUnavailable(ValueError):
    """Sharing needs PostgreSQL: SQLite has no advisory locks."""


def _libpq_url(database_url: str) -> str:
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        raise ShardsUnavailable(
            "coordinators share a fleet through PostgreSQL advisory locks: "
            f"{url.get_backend_name()} has none (set shared_fleet only with PostgreSQL)"
        )
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class ShardLeases:
    """This coordinator's shards. `owns(device_id)` is what the bus handlers ask."""

    def __init__(
        self,
        database_url: str,
        *,
        on_gained: ShardsChanged,
        on_released: ShardsChanged,
        n_shards: int = N_SHARDS,
        step_s: float = STEP_S,
    ) -> None:
        self._dsn = _libpq_url(database_url)
        self._on_gained = on_gained
        self._on_released = on_released
        self.n_shards = n_shards
        self.step_s = step_s
        self.held: set[int] = set()
        self._presence_key = secrets.randbits(31)
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        # Held while a thread speaks on the lock connection (its socket is then busy by design).
        self._io = threading.Lock()
        self._fenced = False
        self._wake = asyncio.Event()

    def owns(self, device_id: str) -> bool:
        """Whether this coordinator may act for the device now: its shard is held and the lock
        connection has not been ended by the server (the fence)."""
        return shard_of(device_id) % self.n_shards in self.held and self.lock_connection_alive()

    def lock_connection_alive(self) -> bool:
        """False once the server has ended the lock connection: an idle connection that never
        LISTENs has nothing to read unless the server said goodbye. While a step is talking on
        it, that step finds a break itself (and gives the shards up)."""
        if self._fenced:
            return False
        conn = self._conn
        if conn is None or conn.closed:
            return False
        if not self._io.acquire(blocking=False):
            return True
        try:
            readable, _, _ = select.select([conn.fileno()], [], [], 0)
        except (OSError, ValueError):
            readable = [True]
        finally:
            self._io.release()
        if readable:
            log.warning("shard locks: the lock connection was ended; acting for no shard")
            self._fenced = True
            self._wake.set()  # give the shards up now rather than at the next step
        return not readable

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Claim, balance and renew until cancelled; `ready`: wait for the bus first, so that
        the sessions of gained shards can be announced."""
        if ready is not None:
            await ready.wait()
        try:
            while True:
                await self.step()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.step_s)
        finally:
            await asyncio.to_thread(self._close)

    async def step(self) -> None:
        if self.held and not self.lock_connection_alive():
            await self._lose(frozenset(self.held))
        if self._fenced:
            await asyncio.to_thread(self._close)
            self._fenced = False
        try:
            release, claimable = await asyncio.to_thread(self._plan)
        except psycopg.Error as exc:
            log.warning("shard locks: the database connection failed (%s); shards given up", exc)
            await self._lose(frozenset(self.held))
            await asyncio.to_thread(self._close)
            return
        if release:
            self.held -= release  # no handler takes their messages from now on
            await self._on_released(release)
            await asyncio.to_thread(self._unlock, release)
            log.info("handed back %d shards (%d held)", len(release), len(self.held))
        if claimable:
            gained = frozenset(await asyncio.to_thread(self._lock, claimable))
            if gained:
                self.held |= gained
                log.info("took %d shards (%d held)", len(gained), len(self.held))
                await self._on_gained(gained)

    async def _lose(self, shards: frozenset[int]) -> None:
        if shards:
            self.held -= shards
            await self._on_released(shards)

    # --- on the lock connection (one thread at a time) ----------------------------------------

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self._dsn,
                autocommit=True,
                keepalives=1,
                keepalives_idle=KEEPALIVE_IDLE_S,
                keepalives_interval=KEEPALIVE_INTERVAL_S,
                keepalives_count=KEEPALIVE_COUNT,
            )
            self._conn.execute(
                "SELECT pg_advisory_lock(%s, %s)", (PRESENCE_LOCKS, self._presence_key)
            )
        return self._conn

    def _plan(self) -> tuple[frozenset[int], list[int]]:
        with self._io:
            return self._plan_on_connection()

    def _plan_on_connection(self) -> tuple[frozenset[int], list[int]]:
        """Shards to hand back (over our share) and shards to try (free, up to our share)."""
        conn = self._connection()
        rows = conn.execute(
            "SELECT classid::bigint, objid::bigint, pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND classid::bigint IN (%s, %s) "
            # pg_locks spans the server: another fleet's database is not ours to count.
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (SHARD_LOCKS, PRESENCE_LOCKS),
        ).fetchall()
        sharers = max(1, sum(1 for classid, _, _ in rows if classid == PRESENCE_LOCKS))
        taken = {int(str(objid)) for classid, objid, _ in rows if classid == SHARD_LOCKS}
        share = math.ceil(self.n_shards / sharers)
        if len(self.held) > share:
            extra = sorted(self.held)[share:]
            return frozenset(extra), []
        free = [s for s in range(self.n_shards) if s not in taken and s not in self.held]
        return frozenset(), free[: share - len(self.held)]

    def _lock(self, shards: list[int]) -> list[int]:
        with self._io:
            conn = self._connection()
            gained = []
            for shard in shards:
                row = conn.execute(
                    "SELECT pg_try_advisory_lock(%s, %s)", (SHARD_LOCKS, shard)
                ).fetchone()
                if row is not None and row[0]:
                    gained.append(shard)
            return gained

    def _unlock(self, shards: frozenset[int]) -> None:
        with self._io:
            conn = self._connection()
            for shard in shards:
                conn.execute("SELECT pg_advisory_unlock(%s, %s)", (SHARD_LOCKS, shard))

    def _close(self) -> None:
        with self._io:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
