"""A simulated device's battery and heat, and the telemetry its agent sends of them.

An agent sends a `Telemetry` every `telemetry_interval_s` (5 s by default) with its battery's
charge and its temperature; the coordinator's `AdaptivePolicy.observe_telemetry` keeps a
`DeviceCondition` from it (with its hysteresis), and a decision for a device past a limit (too
hot, battery low and not charging) moves the drafting off it (`coordinator.runtime.
device_conditions`). The simulator runs that same code: before the policy decides for a
session, its device's reading goes in, once per telemetry interval. The policy consults a
device's condition only when it decides, so the reading is taken at the first decision after
each tick rather than at the tick itself: the policy hears a reading per interval, as from the
agent, up to an interval fresher than the agent's would be, with no event per device and tick
(10,000 devices at 5 s would be 2,000 events a second of fleet time).

Both models are advanced lazily, from the device's drafting time (its CPU's busy time, every
draft it ran) between two looks: the charge falls by the drafting's rate and the idle rate; the
temperature moves towards ambient + rise x duty with its time constant, the duty being the
share of the interval the device drafted (the exact first-order step for a constant duty).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from broker import messages as m
from sim.inputs import BatterySpec, ThermalSpec


@dataclass(slots=True)
class Battery:
    """A device's charge, in percent, as of `at` (fleet ms) and `busy_ms` of drafting."""

    percent: float
    draft_per_ms: float  # percent per ms of drafting
    idle_per_ms: float  # percent per ms of fleet time
    charging: bool
    floor_percent: float | None
    at: float = 0.0
    busy_ms: float = 0.0

    @classmethod
    def drawn(cls, spec: BatterySpec, rng: random.Random) -> Battery:
        low, high = spec.start_percent
        return cls(
            percent=rng.uniform(low, high),
            draft_per_ms=spec.draft_percent_per_min / 60_000.0,
            idle_per_ms=spec.idle_percent_per_min / 60_000.0,
            charging=rng.random() < spec.charging_share,
            floor_percent=spec.floor_percent,
        )

    def advance(self, now: float, busy_ms: float) -> None:
        if not self.charging:  # plugged in: held where it is
            drain = (busy_ms - self.busy_ms) * self.draft_per_ms
            drain += (now - self.at) * self.idle_per_ms
            self.percent = max(0.0, self.percent - drain)
        self.at, self.busy_ms = now, busy_ms


@dataclass(slots=True)
class Heat:
    """A device's temperature, in °C, as of `at` (fleet ms) and `busy_ms` of drafting."""

    celsius: float
    ambient_c: float
    rise_c: float
    time_constant_ms: float
    limit_c: float | None
    throttle_c: float | None
    throttle_factor: float
    at: float = 0.0
    busy_ms: float = 0.0

    @classmethod
    def of(cls, spec: ThermalSpec) -> Heat:
        return cls(
            celsius=spec.ambient_c if spec.start_c is None else spec.start_c,
            ambient_c=spec.ambient_c,
            rise_c=spec.rise_c,
            time_constant_ms=spec.time_constant_s * 1e3,
            limit_c=spec.limit_c,
            throttle_c=spec.throttle_c,
            throttle_factor=spec.throttle_factor,
        )

    def advance(self, now: float, busy_ms: float) -> None:
        elapsed = now - self.at
        if elapsed <= 0.0:
            return
        duty = min(1.0, max(0.0, (busy_ms - self.busy_ms) / elapsed))
        settled = self.ambient_c + self.rise_c * duty
        self.celsius = settled + (self.celsius - settled) * math.exp(
            -elapsed / self.time_constant_ms
        )
        self.at, self.busy_ms = now, busy_ms

    @property
    def throttling(self) -> bool:
        return self.throttle_c is not None and self.celsius >= self.throttle_c

    @property
    def factor(self) -> float:
        """How much slower a draft runs now."""
        return self.throttle_factor if self.throttling else 1.0


@dataclass(slots=True)
class Conditions:
    """What a device's agent reports of its power and heat, and when its next report is due."""

    battery: Battery | None
    heat: Heat | None
    interval_ms: float
    phase_ms: float  # its ticks fall at phase_ms + n interval_ms (agents start at other times)
    due: float = 0.0  # fleet ms of its next tick (its first reading is there from the start)

    def advance(self, now: float, busy_ms: float) -> None:
        if self.battery is not None:
            self.battery.advance(now, busy_ms)
        if self.heat is not None:
            self.heat.advance(now, busy_ms)

    def reading(self, device_id: str, now: float, busy_ms: float) -> m.Telemetry | None:
        """The telemetry the agent sent at its last tick, when that tick is past and not yet
        read (taken as of now); else None."""
        if now < self.due:
            return None
        interval = self.interval_ms
        self.due = self.phase_ms + interval * (1 + (now - self.phase_ms) // interval)
        self.advance(now, busy_ms)
        battery, heat = self.battery, self.heat
        return m.Telemetry(
            device_id=device_id,
            at=now / 1e3,
            battery_percent=None if battery is None else battery.percent,
            charging=None if battery is None else battery.charging,
            battery_floor_percent=None if battery is None else battery.floor_percent,
            thermal_c=None if heat is None else heat.celsius,
            thermal_limit_c=None if heat is None else heat.limit_c,
        )


def conditions(
    battery: BatterySpec | None,
    thermal: ThermalSpec | None,
    telemetry_s: float,
    rng: random.Random,
) -> Conditions | None:
    """A device's conditions, drawn for one device of its class; None when its class has
    neither a battery nor a temperature (it sends no such telemetry)."""
    if battery is None and thermal is None:
        return None
    interval_ms = telemetry_s * 1e3
    return Conditions(
        battery=None if battery is None else Battery.drawn(battery, rng),
        heat=None if thermal is None else Heat.of(thermal),
        interval_ms=interval_ms,
        phase_ms=rng.uniform(0.0, interval_ms),
    )
