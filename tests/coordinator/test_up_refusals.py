"""`specfleet up` refuses what it cannot run with one line and a non-zero exit (a port in use, a
home another stack holds), stops cleanly on SIGTERM, and both binaries tell their version."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.mosquitto import free_port

START_S = 60.0


def specfleet(home: Path, *argv: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(SPECFLEET_HOME=str(home), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "specfleet", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def up(home: Path, *argv: str) -> subprocess.Popen[str]:
    return specfleet(
        home, "up", "--mqtt-port", str(free_port()), "--http-port", str(free_port()), *argv
    )


@pytest.fixture
def listener() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("flag", ["--mqtt-port", "--http-port"])
def test_a_port_in_use_is_one_line_and_exit_2(flag: str, listener: int, tmp_path: Path) -> None:
    other = "--http-port" if flag == "--mqtt-port" else "--mqtt-port"
    stack = specfleet(tmp_path, "up", flag, str(listener), other, str(free_port()))
    out, err = stack.communicate(timeout=START_S)
    assert stack.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"127.0.0.1:{listener} is in use" in lines[0] and flag in lines[0]
    assert "Traceback" not in out + err


def test_a_second_stack_on_one_home_is_refused_and_sigterm_stops_the_first(
    tmp_path: Path,
) -> None:
    first = up(tmp_path)
    try:
        deadline = time.monotonic() + START_S
        assert first.stdout is not None
        for line in first.stdout:
            if line.startswith("coordinator  connected"):
                break
            assert time.monotonic() < deadline
        second = up(tmp_path)
        _, err = second.communicate(timeout=START_S)
        assert second.returncode == 2, err
        assert len(err.strip().splitlines()) == 1, err
        assert "is in use by another specfleet stack (specfleet up, pid " in err
        assert f"pid {first.pid}" in err
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 128 + signal.SIGTERM
        assert "Traceback" not in first.communicate()[1]
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
            try:
                first.wait(30)
            except subprocess.TimeoutExpired:
                first.kill()
                first.wait()
    # The lock goes with its holder: the home serves a new stack.
    again = up(tmp_path)
    try:
        assert again.stdout is not None
        if not any(line.startswith("coordinator  connected") for line in again.stdout):
            # Its output ended first: what it said on the way out is the failure's reason.
            _, err = again.communicate(timeout=30)
            raise AssertionError(f"the new stack stopped (exit {again.returncode}): {err}")
    finally:
        # SIGTERM, so that the stack stops the private broker it may have started.
        again.send_signal(signal.SIGTERM)
        try:
            again.wait(30)
        except subprocess.TimeoutExpired:
            again.kill()
            again.wait()


@pytest.mark.parametrize(
    ("module", "name"), [("specfleet", "specfleet"), ("device_agent.cli", "specfleet-agent")]
)
def test_both_binaries_tell_their_version(module: str, name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == f"{name} 0.1.0"
