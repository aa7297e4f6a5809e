"""`specfleet demo` runs the broker `up` runs: a private Mosquitto with the production config
where one is installed, named in its banner; a normal end warns of nothing (the verifiers leave
in order), SIGTERM stops every process it started, and a home that `up` holds is refused in one
line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.mosquitto import free_port
from coordinator.stack_broker import mosquitto_binary
from inference.artifacts import default_models_dir
from tests.processes import alive, children_of

RUN_S = 600.0
START_S = 300.0
GONE_S = 5.0
LOG_LEVEL = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) ", re.M)

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="no mosquitto installed")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(
        SPECFLEET_HOME=str(home),
        SPECFLEET_MODELS_DIR=str(default_models_dir()),  # built once per machine
        PYTHONUNBUFFERED="1",
    )
    return env


def _demo(*argv: str) -> list[str]:
    return [sys.executable, "-m", "specfleet", "demo", "--agents", "1", "--verifiers", "1", *argv]


def test_the_demo_runs_mosquitto_and_ends_without_a_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        _demo("--limit", "1", "--max-tokens", "8", "--no-baseline"),
        env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (broker,) = [line for line in done.stdout.splitlines() if line.startswith("broker ")]
    assert re.match(
        r"broker +mqtt://127\.0\.0\.1:\d+ +\(Mosquitto, MQTT 5, the production config", broker
    )
    config = (tmp_path / "home" / "broker" / "mosquitto" / "mosquitto.conf").read_text()
    assert "acl_file" in config and "set_tcp_nodelay true" in config

    workdir = Path(re.search(r"logs in (\S+)\)", done.stdout).group(1))  # type: ignore[union-attr]
    log = (workdir / "demo.log").read_text()
    assert "verifier demo-verifier-1 left" in log  # it said goodbye, and was heard
    assert not LOG_LEVEL.findall(log), [line for line in log.splitlines() if LOG_LEVEL.match(line)]


def test_sigterm_stops_the_demo_and_every_process_it_started(tmp_path: Path) -> None:
    out = (tmp_path / "demo.out").open("w")
    demo = subprocess.Popen(
        _demo("--limit", "6", "--max-tokens", "64", "--no-baseline"),
        env=_env(tmp_path / "home"), stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + START_S
        # The banner's database line comes once the broker, verifier and agent are up.
        while "database  " not in (tmp_path / "demo.out").read_text():
            assert demo.poll() is None, (tmp_path / "demo.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the demo did not start"
            time.sleep(0.5)
        started = children_of(demo.pid)
        assert "mosquitto" in started.values(), started
        assert len(started) >= 3, started  # the broker, a verifier and an agent

        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + GONE_S
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {pid: name for pid, name in started.items() if alive(pid)}
        assert "Traceback" not in (tmp_path / "demo.out").read_text()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in started:  # what a failed stop left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        out.close()


def test_a_home_that_up_holds_is_refused_in_one_line(tmp_path: Path) -> None:
    env = _env(tmp_path)
    up = subprocess.Popen(
        [sys.executable, "-m", "specfleet", "up", "--mqtt-port", str(free_port()),
         "--http-port", str(free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("coordinator  connected"):
                break
        demo = subprocess.run(
            _demo("--limit", "1", "--no-baseline"),
            env=env, capture_output=True, text=True, timeout=RUN_S,
        )  # fmt: skip
        assert demo.returncode == 2, demo.stderr[-3000:]
        lines = demo.stderr.strip().splitlines()
        assert len(lines) == 1, demo.stderr
        assert f"is in use by another specfleet stack (specfleet up, pid {up.pid})" in lines[0]
    finally:
        up.send_signal(signal.SIGTERM)  # so that up stops its private broker
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
