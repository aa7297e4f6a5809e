"""Presence on the real Mosquitto and PostgreSQL: online within 2 s, offline after SIGKILL."""

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
AGENT_KEEPALIVE_S = 2


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


def test_agent_online_within_2s_and_offline_after_sigkill(
    coordinator: tuple[str, str, dict[str, str], dict[str, str]],
) -> None:
    api, database_url, env, headers = coordinator
    device_id = f"pi-presence-{secrets.token_hex(4)}"
    added = json.loads(_specfleet("devices", "add", device_id, "--kind", "pi", "--json", env=env))
    credential = added["credential"]

    launched = time.monotonic()
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
            "--keepalive",
            str(AGENT_KEEPALIVE_S),
            "--telemetry-interval",
            "0.5",
        ],
        env=env | {"SPECFLEET_CREDENTIAL": credential},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(lambda: _device_status(api, device_id, headers) == "online", 10)
        online_after = time.monotonic() - launched
        assert online_after <= 2.0, f"online after {online_after:.2f}s"

        killed = time.monotonic()
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=5)
        _wait_for(lambda: _device_status(api, device_id, headers) == "offline", 10)
        offline_after = time.monotonic() - killed
        assert offline_after <= 1.5 * AGENT_KEEPALIVE_S, f"offline after {offline_after:.2f}s"
    finally:
        if agent.poll() is None:
            agent.kill()

    engine = make_engine(database_url)
    try:
        kinds = [
            e.kind for e in reversed(EventLog(make_sessionmaker(engine)).list(device_id=device_id))
        ]
    finally:
        engine.dispose()
    assert kinds[-2:] == ["device.online", "device.offline"], kinds


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
