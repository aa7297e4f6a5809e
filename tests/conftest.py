"""Real databases for the tests: a PostgreSQL database per run (or per caller), SQLite per test."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.engine import Engine

from coordinator.db import migrate
from coordinator.db.engine import make_engine
from coordinator.db.models import Base

# The PostgreSQL server of the test environment; each run creates and drops its own databases.
PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_USER = "postgres"
PG_ADMIN_DATABASE = "test"


def _pg_url(database: str) -> str:
    return f"postgresql+psycopg://{PG_USER}@{PG_HOST}:{PG_PORT}/{database}"


def _admin_connection() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_ADMIN_DATABASE, autocommit=True
    )


@pytest.fixture(scope="session")
def create_pg_database() -> Iterator[Callable[[], str]]:
    """A factory of empty PostgreSQL databases (URLs); all are dropped at the end of the run."""
    created: list[str] = []

    def create() -> str:
        name = f"specfleet_test_{secrets.token_hex(6)}"
        with _admin_connection() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        created.append(name)
        return _pg_url(name)

    yield create
    with _admin_connection() as conn:
        for name in created:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="session")
def pg_engine(create_pg_database: Callable[[], str]) -> Iterator[Engine]:
    """One migrated PostgreSQL database shared by the run; `db_engine` empties it per test."""
    engine = make_engine(create_pg_database())
    migrate.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_clean_engine(pg_engine: Engine) -> Engine:
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    with pg_engine.begin() as conn:
        # TRUNCATE, not DELETE: the events table refuses DELETE by design.
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    return pg_engine


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    # A directory that does not exist yet: make_engine must create it.
    return f"sqlite:///{tmp_path / 'state' / 'specfleet.db'}"


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    engine = make_engine(sqlite_url)
    migrate.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_engine(request: pytest.FixtureRequest) -> Engine:
    """A migrated, empty database of each backend."""
    name = "sqlite_engine" if request.param == "sqlite" else "pg_clean_engine"
    engine: Engine = request.getfixturevalue(name)
    return engine
