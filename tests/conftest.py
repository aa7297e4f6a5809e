"""Real databases for the tests: a PostgreSQL database per run (or per caller), SQLite per test.

Also what the suite needs on pytest-xdist's workers (scripts/test.sh runs `-n 2 --dist
loadscope`): each worker is a run of its own, with PostgreSQL databases of its own (their names
are random, so advisory locks and tables are never shared), and hands its part of the end-of-run
report to the controller.
"""

from __future__ import annotations

import fcntl
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# --- parallel workers (pytest-xdist) ------------------------------------------------------------

# The key of `config.workeroutput` under which a worker hands sections of the end-of-run report
# (title -> lines) to the controller, which prints them: a worker's own terminal is not shown.
WORKER_SUMMARY = "summary_sections"

_worker_sections: dict[str, list[str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _one_module_on_the_shared_mosquitto(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Modules marked `shared_mosquitto` run one at a time across the workers of a run: each
    runs a coordinator on the system Mosquitto, and a coordinator takes any verifier it hears on
    its broker as one of its own. A lock file in the run's temporary root, which all workers
    share; set up before the module's other fixtures (autouse), held until its last test ends."""
    if request.node.get_closest_marker("shared_mosquitto") is None:
        yield
        return
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker: its basetemp is the run's /gwN
        root = root.parent
    with (root / "shared-mosquitto.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the controller: keep the report sections a worker handed over as it finished."""
    for title, lines in getattr(node, "workeroutput", {}).get(WORKER_SUMMARY, {}).items():
        _worker_sections.setdefault(title, []).extend(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for title, lines in _worker_sections.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
