"""`specfleet flash` runs from a wheel installed outside the repository: the wheel carries the
files flash renders for a device (package data), and nothing of flash reads a checkout.

The wheel is built from this checkout and installed alone (`--no-deps`) into a fresh virtual
environment, which borrows this environment's libraries through a .pth line (not its editable
install of specfleet: a .pth line adds a path, and the .pth files in that path are not run).
Every command then runs from a directory outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from coordinator.ops import packaging

REPO_ROOT = Path(__file__).resolve().parents[2]
# What flash and the control plane read from the package at run time.
PACKAGE_DATA = (
    "coordinator/ops/flash/templates/agentctl",
    "coordinator/ops/flash/templates/specfleet-agent.service",
    "coordinator/web/dashboard/templates/base.html",
    "coordinator/web/dashboard/static/app.js",
    "migrations/alembic.ini",
    "migrations/env.py",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return packaging.build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the wheel installed and no path into the checkout."""
    venv = tmp_path_factory.mktemp("venv")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "_libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _run(python: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECFLEET_CONFIG")}
    env["SPECFLEET_HOME"] = str(cwd / "home")
    env["SPECFLEET_DATABASE_URL"] = f"sqlite:///{cwd / 'fleet.db'}"
    return subprocess.run(
        [str(python), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_wheel_carries_what_flash_and_the_control_plane_read(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in PACKAGE_DATA if name not in names]
    assert not missing, f"not in {wheel.name}: {missing}"
    assert not any(name.startswith(("tests/", "deploy/")) for name in names)


def test_flash_dry_run_works_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    where = _run(installed, tmp_path, "-c", "import coordinator.ops.flash as f; print(f.__file__)")
    assert where.returncode == 0, where.stderr
    flash_file = Path(where.stdout.strip())
    assert installed.parent.parent in flash_file.parents  # the wheel's copy, not the checkout's
    assert REPO_ROOT not in flash_file.parents

    upgrade = _run(installed, tmp_path, "-m", "specfleet", "db", "upgrade")
    assert upgrade.returncode == 0, upgrade.stderr
    bundle = tmp_path / "bundle"
    provision = _run(
        installed, tmp_path, "-m", "specfleet", "devices", "provision", "pi-wheel",
        "--kind", "pi", "--device-broker-url", "mqtt://127.0.0.1:1883", "--out", str(bundle),
    )  # fmt: skip
    assert provision.returncode == 0, provision.stderr
    target = tmp_path / "device"
    dry = _run(
        installed, tmp_path, "-m", "specfleet", "flash", "pi-wheel",
        "--target-dir", str(target), "--bundle", str(bundle), "--dry-run",
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "[1] probe:" in dry.stdout and "swap:" in dry.stdout
    # The dry run renders the release's service files from the installed package's templates.
    assert "bin/agentctl:" in dry.stdout
    assert "specfleet-agent.service:" in dry.stdout
    assert not target.exists()
