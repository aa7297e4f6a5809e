"""`specfleet sim plan`: how many verifiers a fleet needs to hold a time-between-tokens SLO.

A fleet (device classes, their links and drafters, verifier kinds), a workload (sessions opened
at a Poisson rate on devices picked at random, tokens per session, task mix) and an SLO (time
between tokens, p95) go in. For each verifier kind of the fleet, the plan finds the fewest
verifiers of that kind alone that hold the SLO with the offered load served, by bisection over
simulated runs, and reports the run at that count: committed tokens/s, time between tokens
p50/p95, session time, each component's utilisation, and the bottleneck (the busiest).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker import messages as m
from core.report import percentile
from sim import devices as device_conditions
from sim.engine import Device, Fleet, Link, Session, without_cycle_collection
from sim.inputs import Calibration, FleetSpec, SimInputError, SloSpec, WorkloadSpec

# A run is stable when it served this share of the tokens offered after warm-up: beyond that,
# queues grow without bound and the SLO would fail in a longer run.
SERVED_SHARE = 0.95
PROGRESS_MS = 1000.0  # how often a run tells its progress, in fleet time


@dataclass(frozen=True)
class RunResult:
    """One simulated run of a workload on a fleet."""

    verifier_kind: str
    verifiers: int
    sessions_started: int
    sessions_ended: int
    tokens_per_s: float
    offered_tokens_per_s: float
    tbt_ms: tuple[float, float]  # time between tokens: p50, p95
    session_s: tuple[float, float]  # open to end: p50, p95
    utilisation: dict[str, float]  # busy share: verifiers (mean), coordinator, broker, devices
    rounds_by_mode: dict[str, int]
    wall_events: int
    open_sessions: float = 0.0  # sessions open at a time, on average over the measured window
    # Devices with a battery or a temperature: how many, and how many the policy spared the
    # drafting at the end (`battery low`, `too hot`) or heat throttled (`_limited`).
    devices_limited: dict[str, float] = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        return max(self.utilisation, key=lambda name: self.utilisation[name])

    def holds(self, slo: SloSpec) -> bool:
        served = self.tokens_per_s >= SERVED_SHARE * self.offered_tokens_per_s
        return served and self.tbt_ms[1] <= slo.tbt_p95_ms

    def document(self) -> dict[str, Any]:
        return {
            "verifier_kind": self.verifier_kind,
            "verifiers": self.verifiers,
            "sessions_started": self.sessions_started,
            "sessions_ended": self.sessions_ended,
            "tokens_per_s": self.tokens_per_s,
            "offered_tokens_per_s": self.offered_tokens_per_s,
            "tbt_ms": {"p50": self.tbt_ms[0], "p95": self.tbt_ms[1]},
            "session_s": {"p50": self.session_s[0], "p95": self.session_s[1]},
            "utilisation": self.utilisation,
            "bottleneck": self.bottleneck,
            "rounds_by_mode": self.rounds_by_mode,
            "events": self.wall_events,
            "open_sessions": self.open_sessions,
            "devices_limited": self.devices_limited,
        }


def _devices(
    fleet: Fleet, spec: FleetSpec, calibration: Calibration, seed: int = 0
) -> list[Device]:
    measured = calibration.device_draft_ms_per_token
    fallback = next(iter(measured.values()), {})
    # Batteries and telemetry phases from a generator of their own: a fleet without them draws
    # everything else as it did.
    rng = random.Random(seed + 2)
    devices = []
    for device_class in spec.devices:
        costs = {**measured.get(device_class.name, fallback), **device_class.draft_ms_per_token}
        throttle_after = (
            device_class.throttle_after_s * 1e3 if device_class.throttle_after_s else math.inf
        )
        for i in range(device_class.count):
            devices.append(
                Device(
                    f"{device_class.name}-{i}",
                    device_class.name,
                    Link(device_class.link, fleet.rng),
                    costs,
                    throttle_after_ms=throttle_after,
                    throttle_factor=device_class.throttle_factor,
                    conditions=device_conditions.conditions(
                        device_class.battery,
                        device_class.thermal,
                        device_class.telemetry_s,
                        rng,
                    ),
                )
            )
    return devices


def _limited(fleet: Fleet, devices: list[Device]) -> dict[str, float]:
    """The devices that report a battery or a temperature, and of those, the ones the policy
    spares the drafting at the run's end, by reason (a device may have both), those whose
    drafting is throttled by heat, and the share of a battery (percent) that a device's work
    for the fleet took in the run (the mean over those on battery that did some)."""
    reporting = [(d, d.conditions) for d in devices if d.conditions is not None]
    if not reporting:
        return {}
    counts: dict[str, float] = {
        "reporting": len(reporting),
        "battery low": 0,
        "too hot": 0,
        "throttled": 0,
    }
    drafted: list[float] = []  # percent of its battery a device's work took in the run
    for device, conditions in reporting:
        # The agent's last tick, read as if it had come (the policy reads a device's only as
        # it decides for it, and a device may have had no session since).
        fleet.coordinator.telemetry(device)
        limit = fleet.policy.device_limit(device.id) or ""
        counts["battery low"] += "battery low" in limit
        counts["too hot"] += "too hot" in limit
        counts["throttled"] += conditions.heat is not None and conditions.heat.throttling
        battery = conditions.battery
        if battery is not None and not battery.charging and device.cpu.busy_ms > 0.0:
            drafted.append(device.cpu.busy_ms * battery.draft_per_ms)
    if drafted:
        counts["battery drafting percent"] = sum(drafted) / len(drafted)
    return counts


def simulate(
    calibration: Calibration,
    fleet_spec: FleetSpec,
    workload: WorkloadSpec,
    verifier_kind: str,
    verifiers: int,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
) -> RunResult:
    """One open-loop run: sessions arrive at the workload's rate for its duration.
    `progress` is told the fleet time reached, in seconds, every simulated second."""
    if verifier_kind not in calibration.verifiers:
        known = ", ".join(calibration.verifiers)
        raise SimInputError(
            f"fleet: verifier kind {verifier_kind!r} has no profile; known: {known}"
        )
    fleet = Fleet(
        calibration,
        [verifier_kind] * verifiers,
        seed=seed,
        broker_hop_ms=fleet_spec.broker.hop_ms,
        broker_max_messages_per_s=fleet_spec.broker.max_messages_per_s,
        coordinators=fleet_spec.coordinators,
    )
    rng = random.Random(seed + 1)
    devices = _devices(fleet, fleet_spec, calibration, seed)
    drafters = {d.id: spec.drafters[0] for spec, d in _classes(fleet_spec, devices)}
    tasks = workload.task_mix or {task: 1.0 for task in calibration.answer_tokens}
    for task in tasks:
        if task not in calibration.answer_tokens:
            raise SimInputError(f"workload: task_mix.{task}: the calibration has no such task")
    names, weights = list(tasks), list(tasks.values())
    busy: dict[str, int] = {}
    sessions: list[Session] = []
    ended: list[Session] = []
    warmup_ms, end_ms = workload.warmup_s * 1e3, workload.duration_s * 1e3

    def on_end(session: Session) -> None:
        busy[session.device.id] -= 1
        ended.append(session)

    def arrive() -> None:
        now = fleet.loop.now
        if now >= end_ms:
            return
        fleet.loop.after(rng.expovariate(workload.sessions_per_s / 1e3), arrive)
        device = devices[rng.randrange(len(devices))]
        if busy.get(device.id, 0) >= fleet_spec.sessions_per_device:
            return  # the device is full: the request is refused at the device
        busy[device.id] = busy.get(device.id, 0) + 1
        task = rng.choices(names, weights)[0]
        prompt = rng.choice(calibration.prompt_tokens.get(task) or [32])
        answer = rng.choice(calibration.answer_tokens[task])
        adaptive = workload.mode == "adaptive"
        mode = m.Mode.DISTRIBUTED if adaptive else m.Mode(workload.mode)
        session = Session(
            id=f"s{len(sessions)}",
            device=device,
            task=task,
            prompt_tokens=prompt,
            length=min(answer, workload.tokens_per_session),
            adaptive=adaptive,
            policy=m.Policy(
                mode=mode,
                draft_model=drafters[device.id] if workload.mode != "cloud" else workload.drafter,
                k=0 if adaptive or mode is m.Mode.PLAIN else workload.k,
            ),
            opened_at=now,
            on_end=on_end,
        )
        sessions.append(session)
        fleet.open_session(session)

    fleet.loop.at(0.0, arrive)
    with without_cycle_collection():
        # In slices of fleet time, for the progress: the same events in the same order.
        reached = 0.0
        while reached < end_ms:
            reached = min(end_ms, reached + PROGRESS_MS)
            fleet.loop.run(until=reached)
            if progress is not None:
                progress(reached / 1e3)
    result = _result(fleet, workload, verifier_kind, verifiers, sessions, ended, warmup_ms, end_ms)
    limited = _limited(fleet, devices)
    return dataclasses.replace(result, devices_limited=limited) if limited else result


def _classes(spec: FleetSpec, devices: list[Device]) -> list[tuple[Any, Device]]:
    by_name = {c.name: c for c in spec.devices}
    return [(by_name[d.device_class], d) for d in devices]


def _result(
    fleet: Fleet,
    workload: WorkloadSpec,
    kind: str,
    count: int,
    sessions: list[Session],
    ended: list[Session],
    warmup_ms: float,
    end_ms: float,
) -> RunResult:
    window_ms = max(1.0, end_ms - warmup_ms)
    tokens = sum(t for s in sessions for at, t in s.commits if at >= warmup_ms)
    gaps = [g for s in sessions if s.opened_at >= warmup_ms for g in s.token_gaps_ms()]
    durations = [
        (s.ended_at - s.opened_at) / 1e3 for s in ended if s.opened_at >= warmup_ms and s.ended_at
    ]
    # Offered: what the sessions that arrived after warm-up asked for, over the window.
    offered = sum(s.length for s in sessions if s.opened_at >= warmup_ms) / window_ms * 1e3
    elapsed = max(fleet.loop.now, 1.0)
    # A verifier's busy share: with host streams it passes back to back, so at 100% it is
    # what sets the time between their tokens (its rows per pass are in the JSON's runs).
    used = [v.busy_ms / elapsed for v in fleet.verifiers]
    utilisation = {
        "verifiers": sum(used) / max(1, len(used)),
        "coordinator": max(cpu.busy_ms for cpu in fleet.coordinator.cpus) / elapsed,
        "broker": fleet.broker.server.busy_ms / elapsed,
    }
    open_ms = sum(
        max(
            0.0,
            min(s.ended_at if s.ended_at is not None else end_ms, end_ms)
            - max(s.opened_at, warmup_ms),
        )
        for s in sessions
    )
    modes: dict[str, int] = {}
    for s in sessions:
        for mode, n in s.rounds_by_mode.items():
            modes[mode] = modes.get(mode, 0) + n
    return RunResult(
        verifier_kind=kind,
        verifiers=count,
        sessions_started=len(sessions),
        sessions_ended=len(ended),
        tokens_per_s=tokens / window_ms * 1e3,
        offered_tokens_per_s=offered,
        tbt_ms=(percentile(gaps, 50), percentile(gaps, 95)),
        session_s=(percentile(durations, 50), percentile(durations, 95)),
        utilisation=utilisation,
        rounds_by_mode=modes,
        wall_events=fleet.loop.events,
        open_sessions=open_ms / window_ms,
    )


def plan(
    calibration: Calibration,
    fleet_spec: FleetSpec,
    workload: WorkloadSpec,
    slo: SloSpec,
    seed: int = 0,
) -> list[RunResult]:
    """Per verifier kind of the fleet: the smallest count that holds the SLO, and its run (or
    the run at slo.max_verifiers when even that fails)."""
    answers = []
    for spec in fleet_spec.verifiers:
        runs: dict[int, RunResult] = {}
        low, high = 1, 1
        while not _run(runs, calibration, fleet_spec, workload, spec.kind, high, seed).holds(slo):
            if high >= slo.max_verifiers:
                break
            low, high = high + 1, min(slo.max_verifiers, high * 2)
        while low < high:
            mid = (low + high) // 2
            if _run(runs, calibration, fleet_spec, workload, spec.kind, mid, seed).holds(slo):
                high = mid
            else:
                low = mid + 1
        answers.append(_run(runs, calibration, fleet_spec, workload, spec.kind, high, seed))
    return answers


def _run(
    runs: dict[int, RunResult],
    calibration: Calibration,
    fleet_spec: FleetSpec,
    workload: WorkloadSpec,
    kind: str,
    verifiers: int,
    seed: int,
) -> RunResult:
    """A count's run, simulated once per plan."""
    if verifiers not in runs:
        runs[verifiers] = simulate(calibration, fleet_spec, workload, kind, verifiers, seed)
    return runs[verifiers]
