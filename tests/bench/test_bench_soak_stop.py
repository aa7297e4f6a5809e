"""SIGTERM stops `specfleet bench soak` as Ctrl-C does: its broker, coordinator and verifier
go with it (they run in sessions of their own, so a signal to the parent alone never reaches
them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.processes import alive, children_of

START_S = 180.0
STOP_S = 60.0


def test_sigterm_stops_the_soak_and_every_process_it_started(tmp_path: Path) -> None:
    log = (tmp_path / "soak.log").open("w")
    soak = subprocess.Popen(
        [sys.executable, "-m", "specfleet", "bench", "soak", "--minutes", "5"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + START_S
        # Mosquitto, the coordinator and the verifier; then the first sessions run.
        while time.monotonic() < deadline and soak.poll() is None:
            started = children_of(soak.pid)
            if len(started) >= 3 and "sessions=" in (tmp_path / "soak.log").read_text():
                break
            time.sleep(0.5)
        assert len(started) >= 3, (tmp_path / "soak.log").read_text()[-2000:]

        soak.send_signal(signal.SIGTERM)
        assert soak.wait(STOP_S) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(alive(pid) for pid in started):
            time.sleep(0.1)
        assert not [pid for pid in started if alive(pid)]
    finally:
        if soak.poll() is None:
            soak.kill()
            soak.wait()
        for pid in started:  # what a failed stop left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
