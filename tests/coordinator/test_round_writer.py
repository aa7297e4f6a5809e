"""The round writer on both databases: group commit, one failure failing one round, the downlink
of the round before, and the finished session's end and event."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker.messages import Mode
from coordinator.db import round_writer
from coordinator.db.engine import make_sessionmaker, read_one_snapshot
from coordinator.db.models import DecodingSession, Event, Round, SessionStatus
from coordinator.db.registry import DeviceRegistry
from coordinator.db.round_writer import RoundRecord, RoundWriter

DEVICE = "writer-pi"
PROMPT_IDS = [1, 2, 3, 4]
T = TypeVar("T")


@pytest.fixture
def sessions(db_engine: Engine) -> sessionmaker[Session]:
    sessions = make_sessionmaker(db_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    return sessions


def open_session(sessions: sessionmaker[Session]) -> uuid.UUID:
    session_id = uuid.uuid4()
    with sessions.begin() as db:
        db.add(
            DecodingSession(
                id=session_id,
                device_id=DEVICE,
                task_type="chat",
                prompt="p",
                prompt_ids=PROMPT_IDS,
                temperature=0.0,
                top_p=1.0,
                seed=0,
                max_tokens=64,
                mode=Mode.DISTRIBUTED,
                draft_model="lookup",
                k=2,
                status=SessionStatus.ACTIVE,
                committed_ids=[],
                committed_len=len(PROMPT_IDS),
            )
        )
    return session_id


def round_row(session_id: uuid.UUID, index: int, committed: int) -> Round:
    """Round `index` of a session that had `committed` generated tokens; it commits two more."""
    base_len = len(PROMPT_IDS) + committed
    return Round(
        session_id=session_id,
        round_index=index,
        base_len=base_len,
        draft_tokens=[7, 8],
        draft_model="lookup",
        k=2,
        n_accepted=1,
        next_token=9,
        committed_len=base_len + 2,
        verifier_id="v1",
        t_draft_ms=0.5,
        t_verify_ms=3.0,
    )


def run_writer(
    sessions: sessionmaker[Session], body: Callable[[RoundWriter], Awaitable[T]]
) -> tuple[T, int]:
    """Run `body` against a running writer; its result and the writer's batch count."""
    engine = sessions.kw["bind"]
    batches = 0

    async def main() -> T:
        nonlocal batches
        writer = RoundWriter(engine)
        running = asyncio.create_task(writer.run(), name="test-round-writer")
        try:
            return await asyncio.wait_for(body(writer), 30)
        finally:
            batches = writer.batches
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running

    result = asyncio.run(main())
    return result, batches


def test_rounds_queued_together_commit_in_one_transaction(
    sessions: sessionmaker[Session],
) -> None:
    session_ids = [open_session(sessions) for _ in range(8)]

    async def body(writer: RoundWriter) -> None:
        await asyncio.sleep(0)  # the writer waits for its first round
        await asyncio.gather(
            *(
                writer.write(round_row(s, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE)
                for s in session_ids
            )
        )

    _, batches = run_writer(sessions, body)
    # Every write was queued before the writer ran again: one transaction took them all.
    assert batches == 1
    with sessions() as db:
        for session_id in session_ids:
            row = db.get(DecodingSession, session_id)
            assert row is not None
            assert (row.committed_ids, row.committed_len) == ([7, 9], len(PROMPT_IDS) + 2)
            stored = db.scalars(sa.select(Round).where(Round.session_id == session_id)).one()
            assert (stored.round_index, stored.next_token, stored.provisional) == (0, 9, False)
            assert stored.created_at is not None and stored.t_downlink_ms is None


def test_two_rounds_of_one_session_in_one_batch_commit_in_order(
    sessions: sessionmaker[Session],
) -> None:
    """A batch never holds two rounds of a session in the coordinator (the next round waits for
    this one's verdict), but the writer must not depend on it: in one transaction (pipelined on
    PostgreSQL) the later round's tokens and the earlier one's downlink are what stays."""
    session_id = open_session(sessions)
    other = open_session(sessions)

    async def body(writer: RoundWriter) -> None:
        await asyncio.sleep(0)  # the writer waits for its first round
        await asyncio.gather(
            writer.write(round_row(session_id, 0, 0), [7, 9], SessionStatus.ACTIVE,
                         device_id=DEVICE),
            writer.write(round_row(other, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE),
            writer.write(round_row(session_id, 1, 2), [7, 9, 7, 9], SessionStatus.ACTIVE,
                         device_id=DEVICE, downlink_ms=2.5),
        )  # fmt: skip

    _, batches = run_writer(sessions, body)
    assert batches == 1
    with sessions() as db:
        row = db.get(DecodingSession, session_id)
        assert row is not None
        assert (row.committed_ids, row.committed_len) == ([7, 9, 7, 9], len(PROMPT_IDS) + 4)
        rounds = db.scalars(
            sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
        ).all()
        assert [(r.round_index, r.t_downlink_ms) for r in rounds] == [(0, 2.5), (1, None)]
        assert db.scalar(sa.select(sa.func.count()).select_from(Round)) == 3


def test_a_round_that_cannot_be_stored_fails_alone(sessions: sessionmaker[Session]) -> None:
    good = open_session(sessions)
    stored_twice = open_session(sessions)

    async def body(writer: RoundWriter) -> list[BaseException | None]:
        await writer.write(
            round_row(stored_twice, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE
        )
        outcomes = await asyncio.gather(
            writer.write(round_row(good, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE),
            # Round 0 again: the unique (session, round) refuses it.
            writer.write(
                round_row(stored_twice, 0, 2), [7, 9, 7, 9], SessionStatus.ACTIVE, device_id=DEVICE
            ),
            # A session nobody opened: the foreign key refuses it.
            writer.write(
                round_row(uuid.uuid4(), 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE
            ),
            return_exceptions=True,
        )
        return [o if isinstance(o, BaseException) else None for o in outcomes]

    outcomes, _ = run_writer(sessions, body)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], sa.exc.IntegrityError)
    assert isinstance(outcomes[2], sa.exc.IntegrityError)
    with sessions() as db:
        good_row = db.get(DecodingSession, good)
        twice_row = db.get(DecodingSession, stored_twice)
        assert good_row is not None and twice_row is not None
        assert good_row.committed_ids == [7, 9]
        assert twice_row.committed_ids == [7, 9]  # the refused round changed nothing
        assert db.scalar(sa.select(sa.func.count()).select_from(Round)) == 2


def test_the_next_round_records_the_downlink_of_the_one_before(
    sessions: sessionmaker[Session],
) -> None:
    session_id = open_session(sessions)

    async def body(writer: RoundWriter) -> None:
        await writer.write(
            round_row(session_id, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE
        )
        await writer.write(
            round_row(session_id, 1, 2),
            [7, 9, 7, 9],
            SessionStatus.ACTIVE,
            device_id=DEVICE,
            downlink_ms=1.25,
        )

    run_writer(sessions, body)
    with sessions() as db:
        rounds = db.scalars(
            sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
        ).all()
        assert [r.t_downlink_ms for r in rounds] == [1.25, None]


@pytest.mark.parametrize("one_snapshot", [True, False], ids=["one-snapshot", "each-statement"])
def test_a_reader_sees_a_session_and_its_rounds_as_of_one_moment(
    sessions: sessionmaker[Session], one_snapshot: bool
) -> None:
    """What the API and replay read (the row, then its rounds) while the writer commits a round
    between the two reads: with read_one_snapshot the rounds agree with the row; without it, the
    round shows up beside a row that has none of its tokens (the race the API had)."""
    session_id = open_session(sessions)
    with sessions() as reader:
        if one_snapshot:
            read_one_snapshot(reader)
        row = reader.get(DecodingSession, session_id)
        assert row is not None and row.committed_ids == []

        async def body(writer: RoundWriter) -> None:
            await writer.write(
                round_row(session_id, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE
            )

        run_writer(sessions, body)
        rounds = reader.scalars(sa.select(Round).where(Round.session_id == session_id)).all()
        assert len(rounds) == (0 if one_snapshot else 1)
    with sessions() as later:
        read_one_snapshot(later)
        row = later.get(DecodingSession, session_id)
        assert row is not None and row.committed_ids == [7, 9]
        assert later.scalar(sa.select(sa.func.count()).where(Round.session_id == session_id)) == 1


def test_a_finished_session_gets_its_end_and_event_with_its_last_round(
    sessions: sessionmaker[Session],
) -> None:
    session_id = open_session(sessions)

    async def body(writer: RoundWriter) -> None:
        await writer.write(
            round_row(session_id, 0, 0), [7, 9], SessionStatus.FINISHED, device_id=DEVICE
        )

    run_writer(sessions, body)
    with sessions() as db:
        row = db.get(DecodingSession, session_id)
        assert row is not None
        assert row.status is SessionStatus.FINISHED and row.finished_at is not None
        event = db.scalars(sa.select(Event).where(Event.session_id == session_id)).one()
        assert (event.kind, event.device_id) == ("session.finished", DEVICE)
        assert event.detail == {"tokens": 2, "rounds": 1}


def test_sqlite_commits_inline_and_a_locked_database_goes_to_the_writer_thread(
    sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On SQLite a round commits on the event loop's thread; while another connection holds the
    write lock past the inline wait, the round goes to the writer's thread, which waits for the
    lock and commits it. The WAL is checkpointed on the writer's thread, never inline."""
    monkeypatch.setattr(round_writer, "INLINE_CHECKPOINT_EVERY", 1)
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = open_session(sessions)
    counts: dict[str, int] = {}

    async def main() -> None:
        writer = RoundWriter(sqlite_engine)
        assert writer.inline
        running = asyncio.create_task(writer.run(), name="test-round-writer")
        try:
            await writer.write(
                round_row(session_id, 0, 0), [7, 9], SessionStatus.ACTIVE, device_id=DEVICE
            )
            counts["inline_after_first"] = writer.inline_batches
            # Another writer holds the lock for 0.3 s, far past the inline wait.
            blocker = sqlite_engine.raw_connection()
            blocker.execute("BEGIN IMMEDIATE")
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, blocker.commit)
            await asyncio.wait_for(
                writer.write(
                    round_row(session_id, 1, 2),
                    [7, 9, 7, 9],
                    SessionStatus.ACTIVE,
                    device_id=DEVICE,
                ),
                10,
            )
            blocker.close()
            counts["inline_after_second"] = writer.inline_batches
            counts["batches"] = writer.batches
        finally:
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running

    asyncio.run(main())
    assert counts == {"inline_after_first": 1, "inline_after_second": 1, "batches": 2}
    assert "WAL checkpoint failed" not in caplog.text
    with sessions() as db:
        row = db.get(DecodingSession, session_id)
        assert row is not None and row.committed_ids == [7, 9, 7, 9]
        stored = db.scalars(sa.select(Round.round_index).where(Round.session_id == session_id))
        assert sorted(stored) == [0, 1]


def test_sqlite_gathers_the_rounds_of_a_burst_queued_loop_turns_apart(
    sqlite_engine: Engine,
) -> None:
    """A pass's results reach the coordinator as messages read and handed on in loop turns of
    their own, so their rounds queue turns apart, not together. Inline, the writer lets the loop
    run on while each few turns queue another round of such a pass (`gather=True`), and commits
    them as one transaction."""
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_ids = [open_session(sessions) for _ in range(8)]
    gap = round_writer.GATHER_QUIET_TURNS - 1  # turns between two rounds, all but quiet

    async def body(writer: RoundWriter) -> None:
        async def write(turns: int, session_id: uuid.UUID) -> None:
            for _ in range(turns):
                await asyncio.sleep(0)
            row = round_row(session_id, 0, 0)
            status = SessionStatus.ACTIVE
            await writer.write(row, [7, 9], status, device_id=DEVICE, gather=True)

        await asyncio.gather(*(write(i * gap, s) for i, s in enumerate(session_ids)))

    _, batches = run_writer(sessions, body)
    assert batches == 1
    with sessions() as db:
        stored = db.scalars(sa.select(Round.session_id).where(Round.round_index == 0)).all()
        assert sorted(stored) == sorted(session_ids)


@pytest.mark.parametrize("gather", [True, False])
def test_sqlite_commits_a_lone_round_after_the_quiet_turns_or_at_once(
    sqlite_engine: Engine, gather: bool
) -> None:
    """A round of a pass of several rows with none behind it waits GATHER_QUIET_TURNS turns of
    the loop before its commit; a round that was its pass's only row commits at once (a
    direct round at one session pays no wait). Rounds that come later go in batches of their
    own."""
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = open_session(sessions)
    turns: list[int] = []

    async def body(writer: RoundWriter) -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        try:
            for index in range(3):
                before = ticks
                row, generated = round_row(session_id, index, 2 * index), [7, 9] * (index + 1)
                status = SessionStatus.ACTIVE
                await writer.write(row, generated, status, device_id=DEVICE, gather=gather)
                turns.append(ticks - before)
        finally:
            ticker.cancel()

    _, batches = run_writer(sessions, body)
    assert batches == 3
    # Queued, the writer woken, (the quiet turns,) committed, the write woken: 3 turns at once.
    quiet = round_writer.GATHER_QUIET_TURNS if gather else 0
    assert all(quiet + 1 <= n <= quiet + 3 for n in turns), turns


def test_sqlite_writes_through_its_prepared_statements_what_sqlalchemy_writes(
    sqlite_engine: Engine,
) -> None:
    """The SQLite writer's statements run on the driver's cursor (coordinator.db.prepared):
    every column of every row they store is what `Connection.execute` stores for the same
    batch, None and JSON and enums and the finished session's end included."""
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    prepared_session, plain_session = open_session(sessions), open_session(sessions)

    def rows(session_id: uuid.UUID) -> list[tuple[Round, list[int], SessionStatus]]:
        first = round_row(session_id, 0, 0)
        second = round_row(session_id, 1, 2)
        second.mode = Mode.CLOUD
        second.provisional = True
        second.policy = {"k": 3, "reason": 'é, "quoted"'}
        second.q_ids = [[7, 1], [8, 2]]
        second.q_probs = [[0.75, 0.25], [0.5, 0.5]]
        second.t_queue_ms = None
        return [
            (first, [7, 9], SessionStatus.ACTIVE),
            (second, [7, 9, 7, 9], SessionStatus.FINISHED),
        ]

    async def write_all(writer: RoundWriter, session_id: uuid.UUID) -> None:
        for row, generated, status in rows(session_id):
            await writer.write(row, generated, status, device_id=DEVICE, downlink_ms=1.25)

    async def main() -> None:
        for session_id, prepared in ((prepared_session, True), (plain_session, False)):
            writer = RoundWriter(sqlite_engine)
            assert writer._prepared is not None
            if not prepared:
                writer._prepared = None  # SQLAlchemy's own execution, as on PostgreSQL
            running = asyncio.create_task(writer.run(), name="test-round-writer")
            try:
                await asyncio.wait_for(write_all(writer, session_id), 30)
            finally:
                running.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await running

    asyncio.run(main())

    def stored(table: str, key: str, session_id: uuid.UUID) -> list[dict[str, object]]:
        with sqlite_engine.connect() as connection:
            result = connection.exec_driver_sql(
                f"SELECT * FROM {table} WHERE {key} = ? ORDER BY rowid", (session_id.hex,)
            )
            found = [dict(row._mapping) for row in result]
        for row in found:  # what differs by design: the row's own id and when it was written
            for column in ("id", "session_id", "created_at", "updated_at", "at"):
                row.pop(column, None)
            if "finished_at" in row:
                row["finished_at"] = row["finished_at"] is not None
        return found

    for table, key in (("rounds", "session_id"), ("events", "session_id")):
        assert stored(table, key, prepared_session) == stored(table, key, plain_session)
    assert stored("sessions", "id", prepared_session) == stored("sessions", "id", plain_session)
    with sessions() as db:
        ended = db.get(DecodingSession, prepared_session)
        assert ended is not None and ended.status is SessionStatus.FINISHED
        assert ended.finished_at is not None and ended.committed_ids == [7, 9, 7, 9]
        second = db.scalars(
            sa.select(Round).where(Round.session_id == prepared_session, Round.round_index == 1)
        ).one()
        assert second.mode is Mode.CLOUD and second.q_probs == [[0.75, 0.25], [0.5, 0.5]]
        assert second.policy == {"k": 3, "reason": 'é, "quoted"'}
        first = db.scalars(
            sa.select(Round).where(Round.session_id == prepared_session, Round.round_index == 0)
        ).one()
        assert first.t_downlink_ms == 1.25  # the next round's downlink, updated in place


def test_a_round_record_names_every_column_with_the_models_defaults() -> None:
    """The writer's plain record of a round (a verifier's direct rounds) stays the table's
    twin: a column added to Round and not to RoundRecord fails here."""
    columns = {column.key: column for column in sa.inspect(Round).columns if column.key != "id"}
    record_fields = {field.name: field for field in dataclasses.fields(RoundRecord)}
    assert set(record_fields) == set(columns)
    for name, column in columns.items():
        default = column.default
        if isinstance(default, sa.ColumnDefault) and default.is_scalar:
            assert record_fields[name].default == default.arg, name


def test_a_record_stores_the_row_a_round_stores(sessions: sessionmaker[Session]) -> None:
    as_round, as_record = open_session(sessions), open_session(sessions)

    def record_of(row: Round) -> RoundRecord:
        """What is set on the Round; the record's defaults for the rest (as the model's)."""
        names = {field.name for field in dataclasses.fields(RoundRecord)}
        return RoundRecord(**{k: v for k, v in sa.inspect(row).dict.items() if k in names})

    async def body(writer: RoundWriter) -> None:
        for index, (committed, status) in enumerate(
            [(0, SessionStatus.ACTIVE), (2, SessionStatus.FINISHED)]
        ):
            generated = [7, 9] * (committed // 2 + 1)
            first, second = round_row(as_round, index, committed), round_row(as_record, index, 0)
            await writer.write(first, generated, status, device_id=DEVICE, downlink_ms=2.5)
            second.base_len, second.committed_len = first.base_len, first.committed_len
            await writer.write(
                record_of(second), generated, status, device_id=DEVICE, downlink_ms=2.5
            )

    run_writer(sessions, body)
    with sessions() as db:

        def stored(session_id: uuid.UUID) -> list[dict[str, object]]:
            rows = db.scalars(
                sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
            ).all()
            assert all(row.created_at is not None for row in rows)
            skip = {"id", "session_id", "created_at"}
            return [
                {c.key: getattr(row, c.key) for c in sa.inspect(Round).columns if c.key not in skip}
                for row in rows
            ]

        assert len(stored(as_record)) == 2
        assert stored(as_record) == stored(as_round)
        ended = db.get(DecodingSession, as_record)
        assert ended is not None and ended.status is SessionStatus.FINISHED
