"""A device's condition from its telemetry (hot, or its battery low), with hysteresis:
such a device is spared the drafting when the host can draft instead."""

from __future__ import annotations

from dataclasses import dataclass

from broker import messages as m

# A device past one of its limits stops drafting: its rounds move to the verifier host, or,
# where no host mode is on offer, to its cheapest drafter. These hold where a device reports no
# limits of its own; a limit is left only this far back on the safe side, so that a reading at
# the edge does not flap the session between modes.
THERMAL_LIMIT_C = 80.0


BATTERY_FLOOR_PERCENT = 20.0


THERMAL_HYSTERESIS_C = 5.0


BATTERY_HYSTERESIS_PERCENT = 5.0


@dataclass
class DeviceCondition:
    """A device's heat and power, from its telemetry, and the limit it is past, if any."""

    thermal_limit_c: float = THERMAL_LIMIT_C
    battery_floor_percent: float = BATTERY_FLOOR_PERCENT
    hot: bool = False
    low: bool = False
    power_saver: bool = False
    reading: str = ""

    def update(self, telemetry: m.Telemetry) -> None:
        if telemetry.thermal_limit_c is not None:
            self.thermal_limit_c = telemetry.thermal_limit_c
        if telemetry.battery_floor_percent is not None:
            self.battery_floor_percent = telemetry.battery_floor_percent
        thermal, battery = telemetry.thermal_c, telemetry.battery_percent
        if thermal is not None:
            edge = self.thermal_limit_c - (THERMAL_HYSTERESIS_C if self.hot else 0.0)
            self.hot = thermal >= edge
        if battery is not None:
            edge = self.battery_floor_percent + (BATTERY_HYSTERESIS_PERCENT if self.low else 0.0)
            self.low = battery <= edge and not telemetry.charging
        elif telemetry.charging:
            self.low = False
        self.power_saver = bool(telemetry.power_saver)
        self.reading = "; ".join(
            part
            for part in (
                f"{thermal:.0f} °C (limit {self.thermal_limit_c:g})" if thermal is not None else "",
                f"battery {battery:.0f}% (floor {self.battery_floor_percent:g}%"
                f"{', charging' if telemetry.charging else ''})"
                if battery is not None
                else "",
            )
            if part
        )

    @property
    def limit(self) -> str | None:
        """Why the device should not draft now, or None."""
        reasons = [
            *(["too hot"] if self.hot else []),
            *(["battery low and not charging"] if self.low else []),
            *(["power saver on"] if self.power_saver else []),
        ]
        if not reasons:
            return None
        reading = f": {self.reading}" if self.reading else ""
        return f"device {', '.join(reasons)}{reading}"
