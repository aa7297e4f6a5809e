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


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for `url`; a SQLite file's parent directory is created."""
    parsed = normalize_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
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
