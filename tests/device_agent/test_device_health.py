"""Device health from a /sys tree (written by the test, as a kernel lays it out) and from
Termux's battery command where /sys has no battery."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from device_agent.health import HealthReader


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _sys(tmp_path: Path, *, status: str, capacity: int, zones: tuple[int, ...]) -> Path:
    root = tmp_path / "sys"
    _write(root / "class/power_supply/BAT0/type", "Battery")
    _write(root / "class/power_supply/BAT0/status", status)
    _write(root / "class/power_supply/BAT0/capacity", str(capacity))
    for i, millidegrees in enumerate(zones):
        _write(root / f"class/thermal/thermal_zone{i}/temp", str(millidegrees))
    return root


@pytest.mark.parametrize(
    ("status", "plugged"), [("Discharging", False), ("Charging", True), ("Full", True)]
)
def test_battery_charging_and_the_hottest_zone(tmp_path: Path, status: str, plugged: bool) -> None:
    health = HealthReader(_sys(tmp_path, status=status, capacity=37, zones=(41000, 78500))).read()
    assert health.battery_percent == 37.0
    assert health.charging is plugged
    assert health.thermal_c == 78.5


def test_a_mains_supply_online_means_charging(tmp_path: Path) -> None:
    root = _sys(tmp_path, status="Unknown", capacity=80, zones=())
    _write(root / "class/power_supply/AC/type", "Mains")
    _write(root / "class/power_supply/AC/online", "1")
    health = HealthReader(root).read()
    assert health.charging is True and health.thermal_c is None


def test_no_power_supply_says_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    health = HealthReader(tmp_path / "nothing").read()
    assert (health.battery_percent, health.charging, health.thermal_c) == (None, None, None)


def test_termux_reports_the_battery_when_sys_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "termux-battery-status"
    status = {
        "percentage": 14,
        "plugged": "UNPLUGGED",
        "status": "DISCHARGING",
        "temperature": 41.5,
    }
    command.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(status)}\nEOF\n")
    command.chmod(command.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    health = HealthReader(tmp_path / "no-sys").read()
    assert health.battery_percent == 14.0
    assert health.charging is False
    assert health.thermal_c == 41.5  # the battery's, where no thermal zone is readable
