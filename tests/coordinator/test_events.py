"""The append-only event log on real SQLite and PostgreSQL databases."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventLog

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def log(db_engine: Engine) -> EventLog:
    return EventLog(make_sessionmaker(db_engine))


def test_append_then_read_back_with_every_field(log: EventLog) -> None:
    session_id = uuid.uuid4()
    written = log.append(
        "session.resumed",
        device_id="pi-1",
        session_id=session_id,
        actor="coordinator",
        detail={"committed_len": 17, "provisional": [1, 2]},
        at=T0,
    )
    (read,) = log.list()
    assert read.id == written.id
    assert (read.kind, read.device_id, read.session_id, read.actor) == (
        "session.resumed",
        "pi-1",
        session_id,
        "coordinator",
    )
    assert read.detail == {"committed_len": 17, "provisional": [1, 2]}
    assert read.at == T0


def test_pages_go_back_newest_first_and_tail_oldest_first(log: EventLog) -> None:
    ids = [log.append("tick", detail={"i": i}).id for i in range(7)]
    first = log.list(limit=3)
    assert [e.id for e in first] == ids[6:3:-1]
    second = log.list(limit=3, before_id=first[-1].id)
    assert [e.id for e in second] == ids[3:0:-1]
    last = log.list(limit=3, before_id=second[-1].id)
    assert [e.id for e in last] == ids[:1]
    assert [e.id for e in log.list(after_id=ids[4])] == ids[5:]


def test_filters_by_kind_device_session_and_time(log: EventLog) -> None:
    session_id = uuid.uuid4()
    log.append("device.online", device_id="a", at=T0)
    log.append("device.online", device_id="b", at=T0 + timedelta(minutes=1))
    log.append("session.started", device_id="a", session_id=session_id, at=T0)
    assert [e.device_id for e in log.list(kind="device.online")] == ["b", "a"]
    assert [e.kind for e in log.list(device_id="a", after_id=0)] == [
        "device.online",
        "session.started",
    ]
    assert [e.kind for e in log.list(session_id=session_id)] == ["session.started"]
    assert [e.device_id for e in log.list(since=T0 + timedelta(seconds=30))] == ["b"]


@pytest.mark.parametrize("limit", [0, -1, 1001])
def test_list_refuses_a_bad_page_size(log: EventLog, limit: int) -> None:
    with pytest.raises(ValueError, match="limit"):
        log.list(limit=limit)


@pytest.mark.parametrize(
    "statement",
    ["UPDATE events SET actor = 'mallory'", "DELETE FROM events"],
)
def test_the_database_refuses_to_rewrite_the_log(
    log: EventLog, db_engine: Engine, statement: str
) -> None:
    log.append("admin.action", actor="alice")
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db_engine.begin() as conn:
        conn.execute(sa.text(statement))
    (kept,) = log.list()
    assert kept.actor == "alice"
