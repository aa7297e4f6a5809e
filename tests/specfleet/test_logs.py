"""`--log-format json`: one JSON object a line, from both binaries, before or after the command."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.mosquitto import free_port
from core.logs import JsonFormatter


def _record(**extra: object) -> logging.LogRecord:
    record = logging.makeLogRecord(
        {"name": "coordinator.service", "levelname": "WARNING", "levelno": logging.WARNING,
         "msg": "moved %d sessions", "args": (3,), "created": 1764612000.25, **extra}
    )  # fmt: skip
    return record


def test_a_record_is_one_json_object_with_its_extra_fields() -> None:
    line = JsonFormatter().format(_record(device_id="pi-1", path=Path("/x")))
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2025-12-01T18:00:00.250+00:00",
        "level": "WARNING",
        "logger": "coordinator.service",
        "message": "moved 3 sessions",
        "pid": os.getpid(),
        "device_id": "pi-1",
        "path": "/x",
    }


def test_a_traceback_stays_inside_its_line() -> None:
    try:
        raise ValueError("bad payload")
    except ValueError:
        record = _record(exc_info=sys.exc_info())
    document = json.loads(JsonFormatter().format(record))
    assert document["exception"].startswith("Traceback (most recent call last):")
    assert document["exception"].endswith("ValueError: bad payload")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}


@pytest.mark.parametrize("where", ["before", "after"])
def test_specfleet_logs_json_lines(tmp_path: Path, where: str) -> None:
    command = ["db", "upgrade", "--database-url", f"sqlite:///{tmp_path / 'x.db'}"]
    flag = ["--log-format", "json"]
    argv = [*flag, *command] if where == "before" else [*command, *flag]
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", *argv],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines  # alembic's migration steps, at INFO
    documents = [json.loads(line) for line in lines]
    assert {d["logger"] for d in documents} == {"alembic.runtime.migration"}
    assert any(d["message"].startswith("Running upgrade") for d in documents)
    assert all(d["level"] == "INFO" for d in documents)
    assert done.stdout.startswith("database revision: ")  # output proper stays text


def test_the_agent_logs_json_lines(tmp_path: Path) -> None:
    credential = tmp_path / "credential"
    credential.write_text("not-a-real-secret\n")
    agent = subprocess.Popen(
        [sys.executable, "-m", "device_agent.cli", "--log-format", "json", "run",
         "--device-id", "pi-json", "--credential-file", str(credential),
         "--broker-url", f"mqtt://127.0.0.1:{free_port()}", "--local-api-port", "0"],
        env=_env() | {"SPECFLEET_HOME": str(tmp_path)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert agent.stderr is not None
    try:
        documents = [json.loads(agent.stderr.readline()) for _ in range(3)]
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    assert all({"time", "level", "logger", "message", "pid"} <= d.keys() for d in documents)
    assert any(
        d["logger"] == "broker.client" and "cannot connect" in d["message"] for d in documents
    )
