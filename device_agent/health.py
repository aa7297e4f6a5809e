"""Device health read from /proc and /sys: CPU, memory, battery, charging and temperature where
present; on Android under Termux, the battery from `termux-battery-status` when /sys has none.

`sys_root` is /sys on a device; a container that mounts the host's at another path, or a test,
passes that path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SYS = Path("/sys")
TERMUX_BATTERY = "termux-battery-status"
TERMUX_TIMEOUT_S = 3.0
# The Termux command starts a Java activity: it is asked at most this often.
TERMUX_EVERY_S = 30.0


@dataclass(frozen=True)
class Health:
    cpu_percent: float | None
    memory_percent: float | None
    battery_percent: float | None
    thermal_c: float | None
    charging: bool | None = None  # None: no battery, or not known


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def cpu_percent() -> float | None:
    """One-minute load average as a share of the cores: cheap, and no sampling interval."""
    load = _read_float(PROC / "loadavg")
    cores = os.cpu_count() or 1
    return None if load is None else round(100.0 * load / cores, 1)


def memory_percent() -> float | None:
    try:
        fields = {
            line.split(":")[0]: float(line.split()[1])
            for line in (PROC / "meminfo").read_text().splitlines()
        }
        return round(100.0 * (1 - fields["MemAvailable"] / fields["MemTotal"]), 1)
    except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError):
        return None


def battery_percent(sys_root: Path = SYS) -> float | None:
    for supply in sorted((sys_root / "class" / "power_supply").glob("*")):
        capacity = _read_float(supply / "capacity")
        if capacity is not None:
            return capacity
    return None


def charging(sys_root: Path = SYS) -> bool | None:
    """True on external power (a battery charging or full, or a mains/USB supply online), False
    on battery, None where no supply says."""
    said: bool | None = None
    for supply in sorted((sys_root / "class" / "power_supply").glob("*")):
        status = _read_text(supply / "status").lower()
        if status in ("charging", "full"):
            return True
        if status in ("discharging", "not charging"):
            said = False
        kind = _read_text(supply / "type").lower()
        if kind in ("mains", "usb", "usb_c", "usb_pd") and _read_float(supply / "online"):
            return True
    return said


def thermal_c(sys_root: Path = SYS) -> float | None:
    """The hottest thermal zone: on a phone zone 0 is not always the one that throttles."""
    zones = (sys_root / "class" / "thermal").glob("thermal_zone*")
    readings = [_read_float(zone / "temp") for zone in zones]
    millidegrees = [r for r in readings if r is not None]
    return max(millidegrees) / 1000.0 if millidegrees else None


class TermuxBattery:
    """`termux-battery-status` (the Termux:API add-on), asked at most every TERMUX_EVERY_S."""

    def __init__(self) -> None:
        self._command = shutil.which(TERMUX_BATTERY)
        self._asked = -float("inf")
        self._last: tuple[float | None, bool | None, float | None] = (None, None, None)

    @property
    def present(self) -> bool:
        return self._command is not None

    def read(self) -> tuple[float | None, bool | None, float | None]:
        """(percent, charging, battery temperature in degrees C), None where not known."""
        now = time.monotonic()
        if self._command is None or now - self._asked < TERMUX_EVERY_S:
            return self._last
        self._asked = now
        try:
            done = subprocess.run(
                [self._command], capture_output=True, text=True, timeout=TERMUX_TIMEOUT_S
            )
            status = json.loads(done.stdout)
        except (OSError, subprocess.SubprocessError, ValueError):
            return self._last
        if not isinstance(status, dict):
            return self._last
        percent = status.get("percentage")
        plugged = status.get("plugged")
        temperature = status.get("temperature")
        self._last = (
            float(percent) if isinstance(percent, (int, float)) else None,
            None if not isinstance(plugged, str) else plugged.upper() != "UNPLUGGED",
            float(temperature) if isinstance(temperature, (int, float)) else None,
        )
        return self._last


class HealthReader:
    """What the agent's telemetry reports, read each time it is asked."""

    def __init__(self, sys_root: Path = SYS) -> None:
        self.sys_root = sys_root
        self.termux = TermuxBattery()

    def read(self) -> Health:
        battery = battery_percent(self.sys_root)
        plugged = charging(self.sys_root)
        thermal = thermal_c(self.sys_root)
        if battery is None and self.termux.present:
            battery, plugged, battery_c = self.termux.read()
            thermal = thermal if thermal is not None else battery_c
        return Health(cpu_percent(), memory_percent(), battery, thermal, plugged)


def read_health(sys_root: Path = SYS) -> Health:
    return HealthReader(sys_root).read()
