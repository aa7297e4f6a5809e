"""The round writer: rounds persisted by group commit before their verdicts may leave.

Used by whoever answers a round: the coordinator, and a verifier that holds a session's lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from broker.messages import Mode
from coordinator.db.engine import read_one_snapshot
from coordinator.db.events import SYSTEM_ACTOR
from coordinator.db.models import DecodingSession, Event, JsonDict, Round, SessionStatus, utcnow
from coordinator.db.prepared import Prepared

log = logging.getLogger(__name__)

# SQLite commits on the event loop's own thread, without the hop to the writer's thread and back
# (two thread wake-ups, which cost several ms on a loaded host where the commit itself costs
# ~0.2 ms: WAL with synchronous=NORMAL writes no fsync per commit). It waits at most this long
# for another writer's lock; past it, the batch goes to the writer's thread as on PostgreSQL.
INLINE_BUSY_TIMEOUT_MS = 20
# The inline connection never checkpoints the WAL itself (a checkpoint writes the database file
# and syncs it, which can take seconds on a busy disk: the event loop would miss heartbeats);
# the writer's thread runs a passive checkpoint after this many inline batches instead.
INLINE_CHECKPOINT_EVERY = 256
# The rounds of one target pass (its results for many host streams) reach the writer event-loop
# turns apart: each message is read, decoded and handed on in turns of its own. Committed inline
# at once, every round was a transaction of its own (`bench e2e` at 32 sessions: not one batch
# of two rounds in a run). A round whose pass verified other rows too (`write(gather=True)`)
# lets the loop run a few turns more before the inline commit, and what they queue goes with
# it: the writer stops after GATHER_QUIET_TURNS turns that queue nothing, or after
# GATHER_MAX_TURNS. A round that was its pass's only row commits at once, as before.
GATHER_QUIET_TURNS = 4
GATHER_MAX_TURNS = 256


# Bound by name once, executed for every batch: the round rows, the sessions' committed tokens,
# and the downlink leg of the round before (it is known only when the next draft comes).
# Inline: no RETURNING of the new ids, which nothing reads, and which a pipeline cannot await.
_INSERT_ROUNDS = sa.insert(Round).inline()
_UPDATE_SESSION = (
    sa.update(DecodingSession)
    .where(DecodingSession.id == sa.bindparam("b_session"))
    .values(
        committed_ids=sa.bindparam("b_committed_ids"),
        committed_len=sa.bindparam("b_committed_len"),
        status=sa.bindparam("b_status"),
        updated_at=sa.bindparam("b_at"),
        finished_at=sa.bindparam("b_finished_at"),
    )
)
_UPDATE_DOWNLINK = (
    sa.update(Round)
    .where(Round.session_id == sa.bindparam("b_session"))
    .where(Round.round_index == sa.bindparam("b_round"))
    .values(t_downlink_ms=sa.bindparam("b_downlink_ms"))
)
_INSERT_EVENTS = sa.insert(Event).inline()
SESSION_FINISHED = "session.finished"
_ROUND_COLUMNS = tuple(column for column in sa.inspect(Round).columns if column.key != "id")
# The same insert with a named parameter per column, for a dialect's `Prepared` form.
_INSERT_ROUND_VALUES = sa.insert(Round).values(
    {column.key: sa.bindparam(column.key, type_=column.type) for column in _ROUND_COLUMNS}
)


@dataclass(frozen=True)
class _PreparedRounds:
    """A batch's three statements compiled once for SQLite (coordinator.db.prepared): its
    commit runs tens of ms after the last, on cold caches, where SQLAlchemy's per-call work was
    most of its time."""

    insert_rounds: Prepared
    update_session: Prepared
    update_downlink: Prepared

    @classmethod
    def of(cls, engine: Engine) -> _PreparedRounds | None:
        if engine.dialect.name != "sqlite":
            return None
        return cls(
            Prepared(_INSERT_ROUND_VALUES, engine.dialect),
            Prepared(_UPDATE_SESSION, engine.dialect),
            Prepared(_UPDATE_DOWNLINK, engine.dialect),
        )


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A round to store, as plain values: what a verifier answering a device hands the writer.

    Its fields are the `rounds` table's columns (less the id), with the model's defaults. A
    Round instance does as well (the coordinator's rounds, which its observers read too); this
    one costs no ORM instrumentation on the way of a verdict: building a Round and reading its
    values back took 0.18 ms one round every 30 ms on this project's 2-vCPU host, where the
    CPU's caches go cold between rounds (0.03 ms back to back)."""

    session_id: uuid.UUID
    round_index: int
    base_len: int
    draft_tokens: list[int]
    k: int
    n_accepted: int
    next_token: int
    committed_len: int
    draft_model: str | None = None
    verifier_id: str | None = None
    policy: JsonDict | None = None
    mode: Mode = Mode.DISTRIBUTED
    provisional: bool = False
    q_ids: list[list[int]] | None = None
    q_probs: list[list[float]] | None = None
    t_draft_ms: float | None = None
    t_uplink_ms: float | None = None
    t_queue_ms: float | None = None
    t_verify_ms: float | None = None
    t_downlink_ms: float | None = None
    created_at: datetime | None = None  # None: when the writer takes its values


_RECORD_FIELDS = tuple(field.name for field in fields(RoundRecord))


def _round_values(row: Round | RoundRecord) -> dict[str, Any]:
    """The INSERT parameters of a round: a record's fields, or what is set on a transient
    Round, else the column's default."""
    if isinstance(row, RoundRecord):
        recorded = {name: getattr(row, name) for name in _RECORD_FIELDS}
        if recorded["created_at"] is None:
            recorded["created_at"] = utcnow()
        return recorded
    assigned = sa.inspect(row).dict
    values: dict[str, Any] = {}
    for column in _ROUND_COLUMNS:
        default = column.default
        if column.key in assigned:
            values[column.key] = assigned[column.key]
        elif isinstance(default, sa.ColumnDefault) and default.is_scalar:
            values[column.key] = default.arg
        elif isinstance(default, sa.ColumnDefault) and default.is_callable:
            values[column.key] = default.arg(None)  # SQLAlchemy's wrapper takes a context
        else:
            values[column.key] = None
    return values


@dataclass
class _Write:
    row: Round | RoundRecord
    generated: list[int]
    status: SessionStatus
    device_id: str
    downlink_ms: float | None  # the downlink of round row.round_index - 1, when reported
    done: asyncio.Future[None]
    gather: bool = False  # its pass verified other rows, whose rounds may follow it


class RoundWriter:
    """Persists rounds, by group commit, before their verdicts may leave.

    A commit starts as soon as a round is queued (no timer); the rounds queued while it runs
    go together into the next one. The writer has a thread and a database connection of its
    own, and each batch is one transaction of a few prepared statements, each executed once for
    all its rounds, sent in one round trip on PostgreSQL (`_pipelined`). Durability:
    PostgreSQL keeps synchronous_commit on; SQLite runs in WAL with
    synchronous=NORMAL (coordinator.db.engine), so a commit that returned survives a crash of
    the coordinator process (the fault model), while a power cut of the host may lose the last
    ones (never corrupting the file).

    On SQLite a batch commits inline, on the event loop's thread (`INLINE_BUSY_TIMEOUT_MS`);
    one that fails there (another writer holds the lock, or anything else) goes to the writer's
    thread, which retries it as PostgreSQL's batches always go.
    """

    def __init__(self, engine: Engine, *, inline: bool | None = None) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[_Write] = asyncio.Queue()
        self._connection: Connection | None = None  # used only from the writer's thread
        # None: inline exactly when the database is SQLite.
        self.inline = engine.dialect.name == "sqlite" if inline is None else inline
        self._inline_connection: Connection | None = None  # the event loop's thread only
        self.batches = 0
        self.inline_batches = 0  # of `batches`, those committed on the event loop's thread
        self._prepared = _PreparedRounds.of(engine)

    def stored(self, session_id: uuid.UUID) -> tuple[list[int], int, SessionStatus] | None:
        """What the database holds of a session: its committed ids (prompt included), the next
        round and its status; None when there is no such session. Blocking: call it in a
        thread."""
        with Session(self._engine) as db:
            # The row and its last round as of one moment: a round committed between the two
            # reads would give a next round ahead of the committed ids.
            read_one_snapshot(db)
            session = db.get(DecodingSession, session_id)
            if session is None:
                return None
            last = db.scalar(
                sa.select(sa.func.max(Round.round_index)).where(Round.session_id == session_id)
            )
            next_round = 0 if last is None else last + 1
            return [*session.prompt_ids, *session.committed_ids], next_round, session.status

    async def write(
        self,
        row: Round | RoundRecord,
        generated: list[int],
        status: SessionStatus,
        *,
        device_id: str,
        downlink_ms: float | None = None,
        gather: bool = False,
    ) -> None:
        """Return once the round, the session's tokens and the downlink before are committed.
        `gather`: the round's pass verified other rows too, whose rounds may be on their way:
        on SQLite the commit waits a few loop turns for them (`GATHER_QUIET_TURNS`)."""
        if isinstance(row, Round) and row.created_at is None:
            row.created_at = utcnow()  # a record's is set with its values
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        write = _Write(row, generated, status, device_id, downlink_ms, done, gather)
        self._queue.put_nowait(write)
        await done

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        # A thread of its own keeps the connection on one thread, and commits off the default
        # executor, where slower database work of the API and the book would delay them.
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-writer")
        batch: list[_Write] = []
        try:
            while True:
                batch = [await self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                if self.inline and any(item.gather for item in batch):
                    await self._gather(batch)
                if self.inline and self._commit_inline(batch):
                    failures: list[Exception | None] = [None] * len(batch)
                    self.inline_batches += 1
                    if self.inline_batches % INLINE_CHECKPOINT_EVERY == 0:
                        thread.submit(self._checkpoint)
                else:
                    failures = await loop.run_in_executor(thread, self._commit_batch, batch)
                self.batches += 1
                for item, failure in zip(batch, failures, strict=True):
                    if item.done.done():
                        continue
                    if failure is None:
                        item.done.set_result(None)
                    else:
                        item.done.set_exception(failure)
                batch = []
        finally:
            for item in [*batch, *_drain(self._queue)]:
                item.done.cancel()
            self._close_inline()
            thread.submit(self._close)
            thread.shutdown(wait=False)

    # --- the event loop's thread (SQLite) -----------------------------------------------------

    async def _gather(self, batch: list[_Write]) -> None:
        """Add to `batch` what the next loop turns queue, until GATHER_QUIET_TURNS turns in a
        row queue nothing (or GATHER_MAX_TURNS have run). On PostgreSQL the writer's thread
        gathers without this: what queues while it commits goes together in the next batch."""
        quiet = 0
        for _ in range(GATHER_MAX_TURNS):
            await asyncio.sleep(0)
            if self._queue.empty():
                quiet += 1
                if quiet >= GATHER_QUIET_TURNS:
                    return
                continue
            quiet = 0
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())

    def _commit_inline(self, batch: list[_Write]) -> bool:
        """Commit the batch here, waiting at most INLINE_BUSY_TIMEOUT_MS for a lock; False (and
        nothing committed) when it failed, for the writer's thread to take it."""
        try:
            connection = self._inline_connection
            if connection is None:
                connection = self._inline_connection = self._engine.connect()
                connection.exec_driver_sql(f"PRAGMA busy_timeout={INLINE_BUSY_TIMEOUT_MS}")
                connection.exec_driver_sql("PRAGMA wal_autocheckpoint=0")
                connection.commit()
            self._commit(batch, connection)
            return True
        except Exception as exc:
            log.debug(
                "inline commit of %d rounds failed (%s); the writer's thread retries",
                len(batch),
                exc,
            )
            self._close_inline()
            return False

    def _close_inline(self) -> None:
        connection, self._inline_connection = self._inline_connection, None
        if connection is not None:
            try:
                # Not back to the pool: its short busy timeout is this writer's alone.
                connection.invalidate()
                connection.close()
            except Exception:
                log.debug("closing the inline connection failed", exc_info=True)

    # --- the writer's thread ------------------------------------------------------------------

    def _commit_batch(
        self, batch: list[_Write], *, pipelined: bool = True
    ) -> list[Exception | None]:
        """Commit the batch as one transaction; if that fails, each round alone, so that one bad
        round (or a connection lost mid-batch) fails no other. One failure per round, or None.
        The rounds alone go unpipelined: in a pipeline, the statements after a failed one fail
        as 'pipeline aborted', and a round already stored must fail as what it is (an
        IntegrityError, which its caller answers with the stored state)."""
        try:
            self._commit_reconnecting(batch, pipelined)
            return [None] * len(batch)
        except Exception as exc:
            self._close()
            if len(batch) == 1 and not pipelined:
                if isinstance(exc, IntegrityError):
                    # Stored already by another answerer (the verifier holding the lease, or a
                    # coordinator before a takeover): the caller resumes from what is stored.
                    log.warning(
                        "round %d of %s is stored already: %s",
                        batch[0].row.round_index,
                        batch[0].row.session_id,
                        str(exc.orig).splitlines()[0] if exc.orig else exc,
                    )
                else:
                    log.exception(
                        "could not persist round %d of %s",
                        batch[0].row.round_index,
                        batch[0].row.session_id,
                    )
                return [exc]
            if len(batch) > 1:
                log.warning(
                    "could not persist %d rounds together (%s); writing them one by one",
                    len(batch),
                    exc,
                )
        failures: list[Exception | None] = []
        for item in batch:
            failures += self._commit_batch([item], pipelined=False)
        return failures

    def _commit_reconnecting(self, batch: list[_Write], pipelined: bool) -> None:
        """A connection the database dropped (a restart, a failover, an administrator) is
        noticed only when used: then the batch goes again, once, on a new one."""
        try:
            self._commit(batch, pipelined=pipelined)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            log.warning("the database dropped the writer's connection (%s); reconnecting", exc.orig)
            self._close()
            self._commit(batch, pipelined=pipelined)

    def _commit(
        self, batch: list[_Write], connection: Connection | None = None, *, pipelined: bool = False
    ) -> None:
        """One transaction for the batch, on `connection` (default: the writer thread's own);
        `pipelined`: in one round trip where the driver can (PostgreSQL, `_pipelined`)."""
        if connection is None:
            if self._connection is None:
                self._connection = self._engine.connect()
            connection = self._connection
        now = utcnow()
        pipeline = _pipelined(connection) if pipelined else contextlib.nullcontext()
        rounds = [_round_values(item.row) for item in batch]
        states = [
            {
                "b_session": item.row.session_id,
                "b_committed_ids": item.generated,
                "b_committed_len": item.row.committed_len,
                "b_status": item.status,
                "b_at": now,
                "b_finished_at": now if item.status is SessionStatus.FINISHED else None,
            }
            for item in batch
        ]
        downlinks = [
            {
                "b_session": item.row.session_id,
                "b_round": item.row.round_index - 1,
                "b_downlink_ms": item.downlink_ms,
            }
            for item in batch
            if item.downlink_ms is not None and item.row.round_index > 0
        ]
        prepared = self._prepared
        with pipeline, connection.begin():
            # The rounds' foreign key makes a session that vanished fail the insert.
            if prepared is not None:
                prepared.insert_rounds.execute(connection, rounds)
                prepared.update_session.execute(connection, states)
                prepared.update_downlink.execute(connection, downlinks)
            else:
                connection.execute(_INSERT_ROUNDS, rounds)
                connection.execute(_UPDATE_SESSION, states)
                if downlinks:
                    connection.execute(_UPDATE_DOWNLINK, downlinks)
            finished = [
                {
                    "at": now,
                    "kind": SESSION_FINISHED,
                    "device_id": item.device_id,
                    "session_id": item.row.session_id,
                    "actor": SYSTEM_ACTOR,
                    "detail": {"tokens": len(item.generated), "rounds": item.row.round_index + 1},
                }
                for item in batch
                if item.status is SessionStatus.FINISHED
            ]
            if finished:
                # In the rounds' transaction: the event commits with the session's end.
                connection.execute(_INSERT_EVENTS, finished)

    def _checkpoint(self) -> None:
        """A passive WAL checkpoint on the writer thread's connection (SQLite): it copies what
        no reader needs back into the database file, without waiting on anyone."""
        try:
            if self._connection is None:
                self._connection = self._engine.connect()
            self._connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
            self._connection.commit()
        except Exception:
            log.warning("WAL checkpoint failed; the next one retries", exc_info=True)
            self._close()

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception:
                log.debug("closing the round writer's connection failed", exc_info=True)


def _pipelined(connection: Connection) -> contextlib.AbstractContextManager[Any]:
    """psycopg's pipeline mode on PostgreSQL: BEGIN, the statements and COMMIT go to the server
    together and are answered together, one round trip instead of one each (four or five). On a
    loaded host each round trip is a wake-up of the server's process, then of this thread, that
    waits for the CPU. Errors still raise, at the commit at the latest, and fail the batch."""
    driver = connection.connection.driver_connection
    pipeline = getattr(driver, "pipeline", None)
    if connection.dialect.name != "postgresql" or pipeline is None:
        return contextlib.nullcontext()
    return cast(contextlib.AbstractContextManager[Any], pipeline())


def _drain(queue: asyncio.Queue[_Write]) -> list[_Write]:
    items: list[_Write] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
