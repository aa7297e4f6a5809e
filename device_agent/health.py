"""Device health read from /proc and /sys: CPU, memory, battery and temperature where present."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SYS = Path("/sys")


@dataclass(frozen=True)
class Health:
    cpu_percent: float | None
    memory_percent: float | None
    battery_percent: float | None
    thermal_c: float | None


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


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


def battery_percent() -> float | None:
    for supply in sorted((SYS / "class" / "power_supply").glob("*")):
        capacity = _read_float(supply / "capacity")
        if capacity is not None:
            return capacity
    return None


def thermal_c() -> float | None:
    millidegrees = _read_float(SYS / "class" / "thermal" / "thermal_zone0" / "temp")
    return None if millidegrees is None else millidegrees / 1000.0


def read_health() -> Health:
    return Health(cpu_percent(), memory_percent(), battery_percent(), thermal_c())
