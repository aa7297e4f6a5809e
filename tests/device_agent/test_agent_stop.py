"""`specfleet-agent run` stops on SIGTERM or Ctrl-C even while its broker is out of reach (its
reconnect loop used to outlive the signal, and only SIGKILL stopped it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.mosquitto import free_port

START_S = 60.0
STOP_S = 15.0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_agent_stops_on_a_signal_while_the_broker_is_unreachable(
    signum: signal.Signals, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "SPECFLEET_CREDENTIAL": "unused",
        "SPECFLEET_HOME": str(tmp_path / "home"),
    }
    with log.open("w") as out:
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "device_agent.cli", "run",
                "--device-id", "pi-stop",
                "--broker-url", f"mqtt://127.0.0.1:{free_port()}",  # nothing listens there
                "--no-local-api",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + START_S
            while "reconnecting in" not in log.read_text():
                assert agent.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            agent.send_signal(signum)
            assert agent.wait(STOP_S) == 0, log.read_text()
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
