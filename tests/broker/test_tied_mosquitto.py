"""A private Mosquitto dies with the process that started it, even one killed by SIGKILL (which
no handler of that process sees), and not before: a broker started from a worker thread outlives
the thread. Real Mosquitto processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from broker.mosquitto import PrivateMosquitto
from tests.processes import alive

GONE_S = 5.0

# Starts a broker from a thread that then ends, says the broker's pid, and sleeps.
OWNER = textwrap.dedent(
    """
    import threading, time
    from broker.mosquitto import PrivateMosquitto

    brokers = []
    starter = threading.Thread(target=lambda: brokers.append(PrivateMosquitto().__enter__()))
    starter.start()
    starter.join()
    print(brokers[0]._process.pid, brokers[0].port, flush=True)
    time.sleep(600)
    """
)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_sigkill_of_the_owner_takes_its_mosquitto_along() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    broker_pid = 0
    try:
        assert owner.stdout is not None
        broker_pid = int(owner.stdout.readline().split()[0])
        assert parent_of(broker_pid) == owner.pid
        # The thread that started it has ended; the broker still runs.
        time.sleep(1.0)
        assert alive(broker_pid)

        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + GONE_S
        while alive(broker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(broker_pid), f"mosquitto {broker_pid} outlived its SIGKILLed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if broker_pid and alive(broker_pid):
            os.kill(broker_pid, signal.SIGKILL)


def test_a_broker_stops_and_restarts_as_asked() -> None:
    """Tying it to us changes nothing about stopping it ourselves."""
    with PrivateMosquitto() as broker:
        assert broker._process is not None
        first = broker._process.pid
        broker.restart()
        assert broker._process is not None and broker._process.pid != first
        assert alive(broker._process.pid) and not alive(first)
        second = broker._process.pid
    assert not alive(second)
