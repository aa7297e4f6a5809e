"""Real parts for the deployment tests: a draft, HTTP servers, a private Mosquitto, databases."""

from __future__ import annotations

import getpass
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from deploy_support import FileServer, Lab, run_cli
from psycopg import sql
from sqlalchemy.engine import Engine

from broker.mosquitto import PrivateMosquitto
from coordinator.db import migrate
from coordinator.db.engine import make_engine, make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from inference.artifacts import default_models_dir
from inference.drafts import list_drafts
from modelbuild.distill import ensure_drafts
from modelbuild.target_build import ensure_target

REPO_ROOT = Path(__file__).resolve().parents[2]
PG_HOST, PG_PORT, PG_USER, PG_ADMIN_DATABASE = "127.0.0.1", 5432, "postgres", "test"


# --- models --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def draft_dir() -> Path:
    """The smallest real ONNX draft, built into the default models directory once."""
    models_dir = default_models_dir()
    ensure_drafts(models_dir, ensure_target(models_dir))
    drafts = [d for d in list_drafts(models_dir) if d.format == "onnx"]
    assert drafts, "no ONNX draft could be built"
    return min(drafts, key=lambda d: d.manifest.size_bytes).directory


# --- HTTP ----------------------------------------------------------------------------------------


@pytest.fixture
def file_server(tmp_path: Path) -> Iterator[tuple[FileServer, Path]]:
    root = tmp_path / "www"
    root.mkdir()
    with FileServer(root) as server:
        yield server, root


# --- databases -----------------------------------------------------------------------------------


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    engine = make_engine(url)
    migrate.upgrade(engine)
    yield url, engine
    engine.dispose()


@pytest.fixture
def pg_db() -> Iterator[tuple[str, Engine]]:
    """A fresh, migrated PostgreSQL database, dropped afterwards."""
    name = f"specfleet_deploy_{secrets.token_hex(6)}"
    admin = {"host": PG_HOST, "port": PG_PORT, "user": PG_USER, "dbname": PG_ADMIN_DATABASE}
    with psycopg.connect(**admin, autocommit=True) as conn:  # type: ignore[arg-type]
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = f"postgresql+psycopg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    engine = make_engine(url)
    migrate.upgrade(engine)
    yield url, engine
    engine.dispose()
    with psycopg.connect(**admin, autocommit=True) as conn:  # type: ignore[arg-type]
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


# --- the broker ----------------------------------------------------------------------------------


@pytest.fixture
def broker_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "broker"
    directory.mkdir()
    return directory


@pytest.fixture
def secured_mosquitto(broker_dir: Path) -> Iterator[Callable[[], PrivateMosquitto]]:
    """A factory: a private Mosquitto reading `broker_dir`'s passwords and acl, with a pid file."""
    started: list[PrivateMosquitto] = []

    def start() -> PrivateMosquitto:
        config = "\n".join(
            [
                "allow_anonymous false",
                f"password_file {broker_dir / 'passwords'}",
                f"acl_file {broker_dir / 'acl'}",
                f"pid_file {broker_dir / 'mosquitto.pid'}",
                # As root, mosquitto would drop to its own user, which cannot read our files.
                f"user {getpass.getuser()}",
            ]
        )
        broker = PrivateMosquitto(config + "\n")
        broker.start()
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


# --- packaging -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def agent_wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent's wheel of this checkout (specfleet-agent) and its dependencies for this
    machine."""
    from coordinator.ops.packaging import DevicePlatform, build_agent_wheel, build_wheelhouse

    root = tmp_path_factory.mktemp("wheelhouse")
    wheel = build_agent_wheel(root / "built")
    build_wheelhouse(wheel, "onnx", DevicePlatform.local(), root / "onnx")
    return root / "onnx"


# --- a lab for flashing ---------------------------------------------------------------------------


@pytest.fixture
def lab(
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    broker_dir: Path,
    secured_mosquitto: Callable[[], PrivateMosquitto],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Lab]:
    url, engine = sqlite_db
    monkeypatch.setenv("SPECFLEET_HOME", str(tmp_path / "home"))
    assert run_cli(["broker", "write-config", "--out", str(broker_dir), "--database-url", url]) == 0
    found = re.search(r"user coordinator: credential (\S+)", capsys.readouterr().out)
    assert found is not None
    broker = secured_mosquitto()
    monkeypatch.setenv("SPECFLEET_BROKER_URL", broker.url)
    monkeypatch.setenv("SPECFLEET_BROKER_USERNAME", "coordinator")
    monkeypatch.setenv("SPECFLEET_BROKER_PASSWORD", found.group(1))
    registry = DeviceRegistry(make_sessionmaker(engine))
    coordinator = ("coordinator", found.group(1))
    lab = Lab(url, registry, broker, coordinator, broker_dir, tmp_path / "bundles", [])
    yield lab
    for root in lab.roots:  # stop the agents this test started, by their pid files
        agentctl = root / "current" / "bin" / "agentctl"
        if agentctl.exists():
            subprocess.run([str(agentctl), "stop"], check=False, timeout=30)
