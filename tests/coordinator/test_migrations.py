"""Migrations on fresh SQLite and PostgreSQL databases: up, check against the models, down."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from coordinator.db import migrate
from coordinator.db.engine import make_engine, normalize_url
from coordinator.db.models import Base

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_TABLES = {table.name for table in Base.metadata.sorted_tables}


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_engine(
    request: pytest.FixtureRequest, sqlite_url: str, create_pg_database: Callable[[], str]
) -> Engine:
    url = sqlite_url if request.param == "sqlite" else create_pg_database()
    engine = make_engine(url)
    request.addfinalizer(engine.dispose)
    return engine


def _tables(engine: Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_upgrade_head_matches_models_and_downgrade_base_removes_everything(
    fresh_engine: Engine,
) -> None:
    assert migrate.current_revision(fresh_engine) is None

    migrate.upgrade(fresh_engine)
    assert migrate.current_revision(fresh_engine) == migrate.head_revision()
    assert _tables(fresh_engine) == APP_TABLES | {"alembic_version"}
    migrate.check(fresh_engine)  # autogenerate finds no difference

    migrate.downgrade(fresh_engine, "base")
    assert migrate.current_revision(fresh_engine) is None
    assert _tables(fresh_engine) == {"alembic_version"}

    # The downgrade left nothing behind (triggers, functions) that blocks a second upgrade.
    migrate.upgrade(fresh_engine)
    migrate.check(fresh_engine)


def test_check_refuses_a_database_behind_head(fresh_engine: Engine) -> None:
    with pytest.raises(migrate.SchemaOutOfDateError, match="specfleet db upgrade"):
        migrate.check(fresh_engine)


@pytest.mark.parametrize(
    "drift_sql",
    ["DROP INDEX ix_devices_status", "ALTER TABLE rounds DROP COLUMN t_queue_ms"],
)
def test_check_reports_drift_from_the_models(fresh_engine: Engine, drift_sql: str) -> None:
    migrate.upgrade(fresh_engine)
    with fresh_engine.begin() as conn:
        conn.execute(sa.text(drift_sql))
    with pytest.raises(migrate.SchemaDriftError) as caught:
        migrate.check(fresh_engine)
    assert caught.value.differences


def test_upgrade_accepts_a_url_and_creates_the_sqlite_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "specfleet.db"
    migrate.upgrade(f"sqlite:///{path}")
    assert path.exists()
    assert migrate.current_revision(f"sqlite:///{path}") == migrate.head_revision()


def test_sqlite_connections_get_wal_foreign_keys_and_busy_timeout(sqlite_engine: Engine) -> None:
    with sqlite_engine.connect() as conn:
        assert conn.execute(sa.text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(sa.text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(sa.text("PRAGMA busy_timeout")).scalar() == 5000
        with pytest.raises(sa.exc.IntegrityError):
            conn.execute(
                sa.text(
                    "INSERT INTO deployment_devices (deployment_id, device_id, wave, state,"
                    " updated_at) VALUES (1, 'nobody', 0, 'pending', '2026-01-01')"
                )
            )


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("postgresql://u@h/db", "postgresql+psycopg"),
        ("postgres://u@h/db", "postgresql+psycopg"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg"),
        ("sqlite:///x.db", "sqlite"),
    ],
)
def test_normalize_url_picks_psycopg_3(url: str, driver: str) -> None:
    assert normalize_url(url).drivername == driver


def test_make_engine_refuses_other_databases() -> None:
    with pytest.raises(ValueError, match="unsupported database"):
        make_engine("mysql://u@h/db")


def test_the_wheel_ships_migrations_and_broker_configs(tmp_path: Path) -> None:
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    shutil.copytree(
        REPO_ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".*", "__pycache__", "build", "dist", "*.egg-info", "artifacts", "test-artifacts",
            "bench-results", "*.db", "*.onnx", "*.gguf",
        ),
    )  # fmt: skip
    subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--quiet", "--wheel-dir", str(tmp_path), str(source),
        ],
        check=True,
        cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("specfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "migrations/alembic.ini",
        "migrations/env.py",
        "migrations/script.py.mako",
        "migrations/versions/0001_initial.py",
        "migrations/versions/0002_admins_and_round_audit.py",
        "broker/config/mosquitto.conf",
        "broker/config/mosquitto-tls.conf",
        "coordinator/web/dashboard/templates/session.html",
        "coordinator/web/dashboard/static/app.js",
    ):
        assert required in names
