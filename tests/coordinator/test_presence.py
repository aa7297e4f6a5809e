"""Presence on the real Mosquitto and PostgreSQL: an agent comes online, goes offline by its Last
Will when SIGKILLed, and comes back online when it starts again."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from broker.mosquitto import free_port
from coordinator.db.engine import make_engine, make_sessionmaker
from coordinator.db.events import EventLog

SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
# A coordinator on the shared Mosquitto: one such module at a time (tests/conftest.py).
pytestmark = pytest.mark.shared_mosquitto
AGENT_KEEPALIVE_S = 2  # the broker sends the Last Will 1.5 keepalives after the link goes quiet
# How long a presence change may take before the test gives up (process start-up on a loaded
# host included). A deadline for a stuck test, not the property: the property is the sequence.
PRESENCE_DEADLINE_S = 60.0


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(
        SPECFLEET_HOME=str(home),
        SPECFLEET_ENVIRONMENT="production",
        SPECFLEET_SECRET_KEY=secrets.token_urlsafe(24),
        **extra,
    )
    return env


def _specfleet(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def coordinator(
    tmp_path: Path, create_pg_database: Callable[[], str]
) -> Iterator[tuple[str, str, dict[str, str], dict[str, str]]]:
    """`specfleet up` against the shared Mosquitto and a fresh PostgreSQL database."""
    database_url = create_pg_database()
    http_port = free_port()
    env = _env(
        tmp_path,
        SPECFLEET_DATABASE_URL=database_url,
        SPECFLEET_COORDINATOR_ID=f"coordinator-test-{secrets.token_hex(4)}",
    )
    _specfleet("db", "upgrade", env=env)
    viewer = json.loads(_specfleet("admin", "create", "ops", "--role", "viewer", "--json", env=env))
    headers = {"Authorization": f"Bearer {viewer['token']}"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specfleet",
            "up",
            "--broker",
            SHARED_MOSQUITTO,
            "--http-port",
            str(http_port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if line.startswith("coordinator  connected") or process.poll() is not None:
            break
    assert process.poll() is None, "".join(lines)
    try:
        yield f"http://127.0.0.1:{http_port}/api/v1", database_url, env, headers
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def _device_status(api: str, device_id: str, headers: dict[str, str]) -> str | None:
    response = httpx.get(f"{api}/devices/{device_id}", headers=headers, timeout=5)
    return str(response.json()["status"]) if response.status_code == 200 else None


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s")


def _start_agent(device_id: str, credential: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "device_agent.cli",
            "run",
            "--device-id",
            device_id,
            "--broker-url",
            SHARED_MOSQUITTO,
            "--keepalive",
            str(AGENT_KEEPALIVE_S),
            "--telemetry-interval",
            "0.5",
        ],
        env=env | {"SPECFLEET_CREDENTIAL": credential},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_an_agent_comes_online_goes_offline_on_sigkill_and_comes_back(
    coordinator: tuple[str, str, dict[str, str], dict[str, str]],
) -> None:
    api, database_url, env, headers = coordinator
    device_id = f"pi-presence-{secrets.token_hex(4)}"
    added = json.loads(_specfleet("devices", "add", device_id, "--kind", "pi", "--json", env=env))
    credential = added["credential"]

    def status_is(status: str) -> Callable[[], bool]:
        return lambda: _device_status(api, device_id, headers) == status

    engine = make_engine(database_url)
    events = EventLog(make_sessionmaker(engine))
    agent = _start_agent(device_id, credential, env)
    try:
        _wait_for(status_is("online"), PRESENCE_DEADLINE_S)
        before_kill = max(e.id for e in events.list(device_id=device_id))
        agent.send_signal(signal.SIGKILL)  # no clean disconnect: only the Last Will tells
        agent.wait(timeout=5)
        _wait_for(status_is("offline"), PRESENCE_DEADLINE_S)
        agent = _start_agent(device_id, credential, env)
        _wait_for(status_is("online"), PRESENCE_DEADLINE_S)
        logged = list(reversed(events.list(device_id=device_id)))
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        engine.dispose()
    presence = [e for e in logged if e.kind in ("device.online", "device.offline")]
    seen = [(e.id, e.kind, e.detail) for e in presence]
    assert presence[0].kind == "device.online" and presence[-1].kind == "device.online", seen
    # After the kill: offline by the agent's Last Will (not the coordinator's sweep of silent
    # devices), then online again. A loaded host may add a flap before; the order is the property.
    after_kill = [e for e in presence if e.id > before_kill]
    wills = [
        i
        for i, e in enumerate(after_kill)
        if e.kind == "device.offline" and e.detail == {"reason": "connection lost"}
    ]
    assert wills, seen
    assert any(e.kind == "device.online" for e in after_kill[wills[0] + 1 :]), seen


def test_unregistered_device_is_refused_outside_the_quickstart(
    coordinator: tuple[str, str, dict[str, str], dict[str, str]],
) -> None:
    api, database_url, env, headers = coordinator
    device_id = f"pi-stranger-{secrets.token_hex(4)}"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "device_agent.cli",
            "run",
            "--device-id",
            device_id,
            "--broker-url",
            SHARED_MOSQUITTO,
            "--telemetry-interval",
            "0.5",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engine = make_engine(database_url)
    events = EventLog(make_sessionmaker(engine))
    try:
        _wait_for(lambda: bool(events.list(device_id=device_id, kind="device.refused")), 10)
        response = httpx.get(f"{api}/devices/{device_id}", headers=headers, timeout=5)
        assert response.status_code == 404
    finally:
        agent.kill()
        agent.wait()
        engine.dispose()
