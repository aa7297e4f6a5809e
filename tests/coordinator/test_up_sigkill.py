"""`specfleet up` killed with SIGKILL (no handler of its own runs) takes its private Mosquitto
along: the broker's pid is gone within seconds and its port is free for the next stack."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.mosquitto import free_port
from coordinator.stack_broker import mosquitto_binary
from tests.processes import alive, children_of

START_S = 60.0
GONE_S = 5.0


def mosquitto_children(parent: int) -> list[int]:
    """The live Mosquitto processes whose parent is `parent`."""
    return [pid for pid, name in children_of(parent).items() if name == "mosquitto"]


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.skipif(mosquitto_binary() is None, reason="no mosquitto installed")
def test_sigkill_of_up_takes_its_mosquitto_along(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(SPECFLEET_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    mqtt_port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "specfleet", "up", "--local-broker", "mosquitto",
         "--mqtt-port", str(mqtt_port), "--http-port", str(free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    brokers: list[int] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + START_S
        for line in up.stdout:
            if line.startswith("coordinator  connected"):
                break
            assert time.monotonic() < deadline, "up did not start"
        brokers = mosquitto_children(up.pid)
        assert len(brokers) == 1, brokers
        assert not port_free(mqtt_port)

        up.send_signal(signal.SIGKILL)
        up.wait(10)
        deadline = time.monotonic() + GONE_S
        while alive(brokers[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(brokers[0]), "the private Mosquitto outlived its SIGKILLed `up`"
        assert port_free(mqtt_port)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in brokers:  # what a failed test left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
