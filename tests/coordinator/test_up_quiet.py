"""`specfleet up` prints its banner on stdout and its own log on stderr, and nothing else: no
library narrates into them (amqtt's warnings did), and a normal run warns of nothing, from the
start to a stop by SIGTERM."""

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

START_S = 60.0
LOG_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): ", re.M)
OURS = ("coordinator", "broker", "core", "specfleet", "verifier", "inference")


@pytest.mark.parametrize(
    ("broker", "named"),
    [
        pytest.param(
            "mosquitto",
            "(Mosquitto, MQTT 5, the production config",
            marks=pytest.mark.skipif(mosquitto_binary() is None, reason="no mosquitto installed"),
        ),
        ("amqtt", "(embedded amqtt, MQTT 3.1.1, as asked"),
    ],
)
def test_the_banner_is_all_up_prints(broker: str, named: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(SPECFLEET_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    up = subprocess.Popen(
        [sys.executable, "-m", "specfleet", "up", "--local-broker", broker,
         "--mqtt-port", str(free_port()), "--http-port", str(free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        banner = []
        deadline = time.monotonic() + START_S
        for line in up.stdout:
            banner.append(line)
            if "specfleet-agent run" in line:
                break
            assert time.monotonic() < deadline, "".join(banner)
        time.sleep(2.0)  # a broker warns as clients come and go; the coordinator is connected
        up.send_signal(signal.SIGTERM)
        rest, err = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    out = "".join(banner) + rest
    assert up.returncode == 128 + signal.SIGTERM
    assert named in out
    assert not LOG_LINE.search(out), out
    logged = LOG_LINE.findall(err)
    assert logged, err  # our own log is there (INFO)
    assert all(name.split(".")[0] in OURS for _, name in logged), err
    assert all(level in ("DEBUG", "INFO") for level, _ in logged), err
    assert len(logged) == len([line for line in err.splitlines() if line]), err
    assert "amqtt" not in err and "Traceback" not in err, err
