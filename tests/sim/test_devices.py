"""A simulated device's battery and heat: the models, the agent's telemetry cadence, and the
production policy sparing a device past a limit the drafting, inside a simulated fleet."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from sim.devices import Battery, Conditions, Heat, conditions
from sim.engine import Device, Link
from sim.inputs import (
    BatterySpec,
    Calibration,
    DeviceClassSpec,
    FleetSpec,
    LinkSpec,
    SimInputError,
    ThermalSpec,
    WorkloadSpec,
    parse,
)
from sim.plan import simulate
from specfleet.cli import main
from tests.sim.conftest import make_calibration

# Host drafting dear (20 ms a token), so that the policy drafts on a device it may use.
HOST_DEAR = {"hybrid": 20.0}
WORKLOAD = WorkloadSpec(sessions_per_s=5.0, duration_s=12.0, warmup_s=2.0, mode="adaptive")


def fleet(**device_class: object) -> FleetSpec:
    spec = DeviceClassSpec.model_validate(
        {"name": "bench", "count": 50, "link": LinkSpec(profile="lan"), **device_class}
    )
    return FleetSpec(devices=[spec])


def test_a_battery_drains_by_its_drafting_and_the_clock_and_holds_while_charging() -> None:
    spec = BatterySpec(
        start_percent=(50.0, 50.0), draft_percent_per_min=1.0, idle_percent_per_min=0.5
    )
    battery = Battery.drawn(spec, random.Random(0))
    assert battery.percent == 50.0 and not battery.charging
    battery.advance(now=120_000.0, busy_ms=60_000.0)  # two minutes, one of them drafting
    assert battery.percent == pytest.approx(50.0 - 1.0 - 1.0)
    battery.advance(now=120_000.0 + 600 * 60_000.0, busy_ms=60_000.0)  # ten hours idle
    assert battery.percent == 0.0
    plugged = Battery.drawn(spec.model_copy(update={"charging_share": 1.0}), random.Random(0))
    plugged.advance(now=120_000.0, busy_ms=60_000.0)
    assert plugged.charging and plugged.percent == 50.0


def test_heat_follows_the_drafting_duty_with_its_time_constant_and_throttles() -> None:
    spec = ThermalSpec(ambient_c=30.0, rise_c=40.0, time_constant_s=10.0, throttle_c=40.0)
    heat = Heat.of(spec)
    heat.advance(now=10_000.0, busy_ms=5_000.0)  # half the time drafting, one time constant
    settled = 30.0 + 40.0 * 0.5
    assert heat.celsius == pytest.approx(settled + (30.0 - settled) * math.exp(-1.0))
    assert heat.celsius > 40.0 and heat.throttling and heat.factor == spec.throttle_factor
    heat.advance(now=10_000.0 + 600_000.0, busy_ms=5_000.0)  # ten minutes idle: back to ambient
    assert heat.celsius == pytest.approx(30.0) and not heat.throttling and heat.factor == 1.0


def test_a_hot_device_drafts_slower_by_its_throttle() -> None:
    hot = Conditions(
        battery=None,
        heat=Heat.of(ThermalSpec(start_c=90.0, throttle_c=70.0, throttle_factor=3.0)),
        interval_ms=5_000.0,
        phase_ms=0.0,
    )
    cool = Device("cool", "bench", Link(LinkSpec(), random.Random(0)), {"hybrid": 2.0})
    warm = Device(
        "hot", "bench", Link(LinkSpec(), random.Random(0)), {"hybrid": 2.0}, conditions=hot
    )
    assert cool.draft_ms("hybrid", 4) == 8.0
    assert warm.draft_ms("hybrid", 4) == 24.0


def test_telemetry_comes_once_a_tick_from_the_first_look() -> None:
    drawn = conditions(BatterySpec(), None, 5.0, random.Random(3))
    assert drawn is not None and 0.0 <= drawn.phase_ms < 5_000.0
    phase = drawn.phase_ms
    first = drawn.reading("pi-0", now=1.0, busy_ms=0.0)
    assert first is not None and first.device_id == "pi-0"
    assert first.battery_percent is not None and first.thermal_c is None
    assert drawn.reading("pi-0", now=phase - 1.0 if phase > 2.0 else 1.5, busy_ms=0.0) is None
    assert drawn.reading("pi-0", now=phase + 1.0, busy_ms=0.0) is not None  # a tick passed
    assert drawn.reading("pi-0", now=phase + 2.0, busy_ms=0.0) is None
    # Three ticks missed (no decision for the device meanwhile): one reading, as of now.
    late = drawn.reading("pi-0", now=phase + 3 * 5_000.0 + 10.0, busy_ms=0.0)
    assert late is not None and late.at == pytest.approx((phase + 15_010.0) / 1e3)
    assert drawn.due == pytest.approx(phase + 4 * 5_000.0)
    assert conditions(None, None, 5.0, random.Random(0)) is None


def test_the_policy_spares_devices_with_low_batteries_the_drafting() -> None:
    calibration = make_calibration(host_draft_ms_per_token=HOST_DEAR)
    full = simulate(
        calibration, fleet(battery={"start_percent": (90.0, 100.0)}), WORKLOAD, "cpu", 2
    )
    low = simulate(calibration, fleet(battery={"start_percent": (1.0, 5.0)}), WORKLOAD, "cpu", 2)
    assert full.rounds_by_mode.get("distributed", 0) > 100
    assert full.devices_limited["battery low"] == 0
    assert low.rounds_by_mode.get("distributed", 0) == 0  # every decision moved it off
    assert low.devices_limited["battery low"] > 0
    assert low.devices_limited["reporting"] == 50
    # Plugged in, a low battery is no limit.
    charging = fleet(battery={"start_percent": (1.0, 5.0), "charging_share": 1.0})
    plugged = simulate(calibration, charging, WORKLOAD, "cpu", 2)
    assert plugged.rounds_by_mode == full.rounds_by_mode
    assert plugged.devices_limited["battery low"] == 0


def test_the_policy_spares_hot_devices_until_they_cool() -> None:
    calibration = make_calibration(host_draft_ms_per_token=HOST_DEAR)
    # Hot from the start, cooling with a 1 s time constant: spared at first, drafting again
    # once below the limit less the policy's hysteresis.
    hot = simulate(
        calibration,
        fleet(thermal={"start_c": 95.0, "time_constant_s": 60.0, "rise_c": 0.0}),
        WORKLOAD,
        "cpu",
        2,
    )
    cooling = simulate(
        calibration,
        fleet(thermal={"start_c": 95.0, "time_constant_s": 1.0, "rise_c": 0.0}),
        WORKLOAD,
        "cpu",
        2,
    )
    assert hot.rounds_by_mode.get("distributed", 0) == 0
    assert hot.devices_limited["too hot"] > 0
    assert cooling.rounds_by_mode.get("distributed", 0) > 100
    assert cooling.devices_limited["too hot"] == 0


def test_a_fleet_without_batteries_or_heat_reports_none(calibration: Calibration) -> None:
    result = simulate(calibration, fleet(), WORKLOAD, "cpu", 2)
    assert result.devices_limited == {}
    assert "devices_limited" in result.document()


@pytest.mark.parametrize(
    ("device_class", "field"),
    [
        ({"battery": {"start_percent": [80.0, 20.0]}}, "devices.0.battery"),
        ({"battery": {"start_percent": [0.0, 120.0]}}, "devices.0.battery.start_percent.1"),
        ({"battery": {"charging_share": 2.0}}, "devices.0.battery.charging_share"),
        ({"battery": {"volts": 3.7}}, "devices.0.battery.volts"),
        ({"thermal": {"time_constant_s": 0.0}}, "devices.0.thermal.time_constant_s"),
        ({"telemetry_s": 0.0}, "devices.0.telemetry_s"),
    ],
)
def test_a_bad_battery_or_heat_is_refused_naming_the_field(
    device_class: dict[str, object], field: str
) -> None:
    document = {"devices": [{"name": "phone", "count": 1, **device_class}]}
    with pytest.raises(SimInputError) as refused:
        parse(document, FleetSpec, "fleet.toml")
    message = str(refused.value)
    assert message.startswith(f"fleet.toml: {field}:") and "\n" not in message


def test_sim_run_tells_what_the_batteries_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cal = tmp_path / "cal.json"
    calibration = make_calibration(
        host_draft_ms_per_token=HOST_DEAR, device_draft_ms_per_token={"bench": {"hybrid": 2.0}}
    )
    cal.write_text(calibration.model_dump_json())
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        '[[devices]]\nname = "phone"\ncount = 20\nlink = { profile = "lan" }\n'
        "battery = { start_percent = [90.0, 95.0], draft_percent_per_min = 30.0 }\n"
    )
    workload = tmp_path / "workload.toml"
    workload.write_text("sessions_per_s = 4.0\nduration_s = 6.0\nwarmup_s = 1.0\n")
    out = tmp_path / "run.json"
    files = ["--calibration", str(cal), "--fleet", str(fleet_file), "--workload", str(workload)]
    status = main(["sim", "run", *files, "--verifiers", "1", "--json", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "of 20 devices reporting a battery or heat" in printed
    limited = json.loads(out.read_text())["result"]["devices_limited"]
    # Full batteries: the devices draft, and each that did gave it a share of its charge.
    assert limited["reporting"] == 20 and limited["battery low"] == 0
    assert limited["battery drafting percent"] > 0.0
    assert "drafting took" in printed
