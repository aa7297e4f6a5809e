"""`specfleet up` ends its banner with the dashboard's URL and the commands that add an admin, a
verifier and a device to the stack; run as printed, each works: the admin logs in, the device
and the verifier come online."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.mosquitto import free_port
from inference.artifacts import default_models_dir

START_S = 60.0
ONLINE_S = 120.0  # the verifier loads and profiles the target first
MODULES = {"specfleet": "specfleet", "specfleet-agent": "device_agent.cli"}


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    # The drafts and the target are built once per machine, not per home.
    env.update(
        SPECFLEET_HOME=str(home),
        SPECFLEET_MODELS_DIR=str(default_models_dir()),
        PYTHONUNBUFFERED="1",
    )
    return env


def _argv(command_line: str) -> list[str]:
    """A banner's command line as this interpreter runs it."""
    program, *args = shlex.split(command_line)
    return [sys.executable, "-m", MODULES[program], *args]


# amqtt's banner is in the slow set (the default suite's budget); Mosquitto's, what up runs
# wherever one is installed, runs by default.
@pytest.fixture(params=["mosquitto", pytest.param("amqtt", marks=pytest.mark.slow)])
def stack(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[list[str], dict[str, str]]]:
    env = _env(tmp_path)
    process = subprocess.Popen(
        [
            *_argv("specfleet up"),
            "--mqtt-port",
            str(free_port()),
            "--http-port",
            str(free_port()),
            "--local-broker",
            request.param,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    banner: list[str] = []
    deadline = time.monotonic() + START_S
    assert process.stdout is not None
    for line in process.stdout:
        banner.append(line.rstrip("\n"))
        if "specfleet-agent run" in line or time.monotonic() > deadline:
            break
    try:
        yield banner, env
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _command(banner: list[str], label: str) -> str:
    (line,) = [line for line in banner if line.startswith(f"  {label} ")]
    return line.removeprefix(f"  {label} ").strip()


def _wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + ONLINE_S
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen in {ONLINE_S:g}s"
        time.sleep(0.5)


def test_the_banner_names_the_dashboard_and_commands_that_work(
    stack: tuple[list[str], dict[str, str]],
) -> None:
    banner, env = stack
    text = "\n".join(banner)
    assert banner[0].startswith("broker       mqtt://127.0.0.1:")
    assert any(
        kind in banner[0]
        for kind in (
            "(Mosquitto, MQTT 5, the production config; services on mqtt://127.0.0.1:",
            "(embedded amqtt, MQTT 3.1.1, as asked: for trials; production runs Mosquitto)",
        )
    ), banner[0]
    (dashboard,) = [line.split()[1] for line in banner if line.startswith("dashboard ")]
    assert dashboard.startswith("http://127.0.0.1:") and dashboard.endswith("/")
    with urllib.request.urlopen(dashboard, timeout=10) as page:  # redirected to the login page
        assert page.url == f"{dashboard}login?next=%2Ffleet"
        assert "specfleet" in page.read().decode()
    assert "next, in another shell:" in text

    admin = subprocess.run(
        [*_argv(_command(banner, "an admin")), "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert admin.returncode == 0, admin.stderr
    token = json.loads(admin.stdout)["token"]

    def api(path: str) -> dict[str, object]:
        request = urllib.request.Request(
            f"{dashboard}api/v1{path}", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            document: dict[str, object] = json.loads(answer.read())
            return document

    (run_agent,) = [line.strip() for line in banner if "specfleet-agent run" in line]
    cd, bundle, and_then, agent_command = run_agent.split(" ", 3)
    assert (cd, and_then) == ("cd", "&&")
    provision = subprocess.run(
        _argv(_command(banner, "a device")), env=env, capture_output=True, text=True, timeout=60
    )
    assert provision.returncode == 0, provision.stderr
    children = [
        # (Its local API on any free port: other agents on this host may hold the default.)
        subprocess.Popen(_argv(agent_command), env=env | {"SPECFLEET_LOCAL_API_PORT": "0"},
                         cwd=bundle, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen(_argv(_command(banner, "a verifier")), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    try:
        _wait_for("the device online", lambda: api("/devices/pi-1")["status"] == "online")

        def verifier_online() -> bool:
            verifiers = api("/verifiers")["data"]
            assert isinstance(verifiers, list)
            return any(v["online"] for v in verifiers)

        _wait_for("a verifier online", verifier_online)
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
