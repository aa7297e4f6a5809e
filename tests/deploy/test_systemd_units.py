"""The systemd units for `specfleet up`, the verifier and the agent: systemd itself finds nothing
wrong in them (`systemd-analyze verify`, with the venv path pointed at this checkout's), and each
command they run is one the CLI accepts, with secrets kept out of argv."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ops.flash.release import TEMPLATES, UNIT_NAME, render_template
from specfleet.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
UNITS = REPO_ROOT / "deploy" / "systemd"
INSTALLED_VENV = "/opt/specfleet/venv"
# What the environment files and systemd's specifiers hold on a real host.
EXPANSIONS = {
    "${SPECFLEET_BROKER_URL}": "mqtt://127.0.0.1:1883",
    "${SPECFLEET_DATABASE_URL}": "postgresql://specfleet@127.0.0.1/specfleet",
    "%i": "verifier-0",
    "%d": "/run/credentials/specfleet-verifier@verifier-0.service",
}
# (unit file, the instance to verify it as)
CASES = [
    ("specfleet-up.service", "specfleet-up.service"),
    ("specfleet-verifier@.service", "specfleet-verifier@verifier-0.service"),
]


def _commands(unit: str) -> dict[str, list[str]]:
    """Each Exec* line of `unit` (continuations joined) as argv, with the host's values in."""
    text = (UNITS / unit).read_text().replace("\\\n", " ")
    commands = {}
    for key, line in re.findall(r"^(Exec\w+)=(.+)$", text, re.M):
        for name, value in EXPANSIONS.items():
            line = line.replace(name, value)
        commands[key] = shlex.split(line)
    return commands


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize(("unit", "instance"), CASES)
def test_systemd_verifies_the_unit(unit: str, instance: str, tmp_path: Path) -> None:
    venv = str(Path(sys.executable).parent.parent)
    (tmp_path / instance).write_text((UNITS / unit).read_text().replace(INSTALLED_VENV, venv))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / instance)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # no key ignored, no command missing


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_verifies_the_agent_unit_as_flash_renders_it(tmp_path: Path) -> None:
    root = tmp_path / "specfleet-agent"
    (root / "current").mkdir(parents=True)
    (root / "state").mkdir()
    (root / "current" / "venv").symlink_to(Path(sys.executable).parent.parent)
    unit = tmp_path / UNIT_NAME
    unit.write_text(render_template(TEMPLATES / UNIT_NAME, {"ROOT": str(root), "USER": "root"}))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr


@pytest.mark.parametrize(("unit", "instance"), CASES)
def test_the_units_run_commands_the_cli_accepts(unit: str, instance: str) -> None:
    commands = _commands(unit)
    assert "ExecStart" in commands
    parser = build_parser()
    for key, argv in commands.items():
        assert argv[0] == f"{INSTALLED_VENV}/bin/specfleet", key
        args = parser.parse_args(argv[1:])
        assert callable(args.func), key
        assert args.log_format == "json" or key != "ExecStart"
        for secret_flag in ("--password", "--credential", "--secret-key"):
            assert secret_flag not in argv, f"{key} puts a secret in argv"


def test_the_verifier_reads_its_password_from_a_systemd_credential() -> None:
    text = (UNITS / "specfleet-verifier@.service").read_text()
    assert "LoadCredential=broker-password:" in text
    argv = _commands("specfleet-verifier@.service")["ExecStart"]
    password_file = argv[argv.index("--password-file") + 1]
    assert password_file == EXPANSIONS["%d"] + "/broker-password"
    assert argv[argv.index("--id") + 1] == "verifier-0"


def test_up_migrates_before_it_starts() -> None:
    commands = _commands("specfleet-up.service")
    assert commands["ExecStartPre"][1:] == ["db", "upgrade"]
    assert commands["ExecStart"][-3:] == ["up", "--broker", EXPANSIONS["${SPECFLEET_BROKER_URL}"]]
