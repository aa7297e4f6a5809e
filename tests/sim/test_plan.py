"""Capacity planning: the fewest verifiers that hold the SLO, found by bisection."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from sim.commands import plan_html
from sim.inputs import Calibration, DeviceClassSpec, FleetSpec, LinkSpec, SloSpec, WorkloadSpec
from sim.plan import plan, simulate

FLEET = FleetSpec(devices=[DeviceClassSpec(name="bench", count=400, link=LinkSpec(profile="lan"))])
# Plain decoding: a verifier commits 32 rows per 20 ms pass, 1,600 tokens/s at most; 50 sessions
# of 40 tokens a second offer 2,000, so one verifier falls behind and two keep up.
WORKLOAD = WorkloadSpec(sessions_per_s=50.0, duration_s=12.0, warmup_s=4.0, mode="plain")
SLO = SloSpec(tbt_p95_ms=50.0, max_verifiers=16)


def test_one_verifier_falls_behind_and_two_hold(calibration: Calibration) -> None:
    one = simulate(calibration, FLEET, WORKLOAD, "cpu", 1)
    two = simulate(calibration, FLEET, WORKLOAD, "cpu", 2)
    assert not one.holds(SLO)
    assert one.bottleneck == "verifiers" and one.utilisation["verifiers"] > 0.9
    assert two.holds(SLO)
    assert two.tokens_per_s == two.tokens_per_s  # not NaN
    assert two.tbt_ms[1] <= SLO.tbt_p95_ms


def test_plan_answers_the_smallest_count(calibration: Calibration, tmp_path: Path) -> None:
    (answer,) = plan(calibration, FLEET, WORKLOAD, SLO)
    assert answer.verifiers == 2
    assert answer.holds(SLO)
    page = plan_html([answer], SLO)
    assert page.startswith("<!doctype html>") and "<svg" in page and "2 x cpu" in page


def test_a_run_tells_its_progress_each_fleet_second_and_runs_the_same(
    calibration: Calibration,
) -> None:
    seen: list[float] = []
    told = simulate(calibration, FLEET, WORKLOAD, "cpu", 2, progress=seen.append)
    assert seen == [float(s) for s in range(1, 13)]
    assert told == simulate(calibration, FLEET, WORKLOAD, "cpu", 2)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cycle_collector_is_off_during_a_run_and_as_it_was_after(
    calibration: Calibration, enabled: bool
) -> None:
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        during: list[bool] = []
        simulate(
            calibration, FLEET, WORKLOAD, "cpu", 2, progress=lambda _: during.append(gc.isenabled())
        )
        assert during and not any(during)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
