"""Engines for SQLite (quickstart) and PostgreSQL (production), and the session factory."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.engine.url import URL
from sqlalchemy.orm import Session, sessionmaker

# Concurrent writers (the coordinator and a CLI command) wait this long for SQLite's write lock.
SQLITE_BUSY_TIMEOUT_MS = 5000


def normalize_url(url: str | URL) -> URL:
    """`postgresql://` and `postgres://` become psycopg 3 URLs; anything else is left alone."""
    if isinstance(url, str) and url.startswith("postgres://"):
        url = "postgresql://" + url.removeprefix("postgres://")
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    if not isinstance(dbapi_connection, sqlite3.Connection):
        return
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets readers (the dashboard) run while the coordinator writes rounds.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # Safe with WAL (a power cut may lose the last commits, never corrupt the file).
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


class NoSuchDatabase(Exception):
    """A SQLite file that does not exist, where it must not be created (a read, a mistyped path)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"no such database: {path}")
        self.path = path


def sqlite_file(url: str | URL) -> Path | None:
    """The file a SQLite URL names; None for in-memory databases and other backends."""
    parsed = normalize_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    if database.startswith("file:"):
        return None  # a URI filename: SQLite's own options decide (mode=ro, memory, ...)
    return Path(database).expanduser()


def make_engine(url: str | URL, *, create: bool = True, **kwargs: Any) -> Engine:
    """An engine for `url`. A SQLite file (and its directory) is created on first use, unless
    `create` is false: then a missing file raises NoSuchDatabase and nothing is written."""
    parsed = normalize_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        path = sqlite_file(parsed)
        if path is not None and not create and not path.exists():
            raise NoSuchDatabase(path)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(parsed, **kwargs)
        sa.event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    if backend == "postgresql":
        # A database restart or a failover leaves dead connections in the pool.
        kwargs.setdefault("pool_pre_ping", True)
        return sa.create_engine(parsed, **kwargs)
    raise ValueError(f"unsupported database {parsed.drivername!r}: use sqlite or postgresql")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    # Objects stay readable after commit, so registry calls can return them detached.
    return sessionmaker(engine, expire_on_commit=False)


def read_one_snapshot(db: Session) -> None:
    """Make the reads of `db`'s transaction, from here on, see one state of the database. Call
    it before the first statement. Without it, each statement sees what was committed when it
    began: a session row read, then its rounds read a moment later, may disagree by a round
    committed in between (a finished session with a round missing).

    PostgreSQL reads at REPEATABLE READ (one snapshot for the transaction); SQLite's driver
    starts no transaction for a SELECT, so a deferred BEGIN makes the reads one transaction,
    which in WAL mode reads one snapshot. The transaction only reads: it ends in a rollback."""
    dialect = db.get_bind().dialect.name
    if dialect == "postgresql":
        db.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    elif dialect == "sqlite":
        db.connection().exec_driver_sql("BEGIN")
