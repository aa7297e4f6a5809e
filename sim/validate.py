"""`specfleet sim validate`: a measured benchmark run replayed in the simulator, side by side.

`bench e2e`: every level with its arms (plain serving, the fixed drafter, adaptive), wave by wave
in the order the benchmark ran them (the arms take turns, reversed every other wave), on one
fleet whose policy and verifier keep what they learn from wave to wave, as the real ones do.
Each wave's sessions are the measured ones: the same task, prompt length and answer length
(the target's answer, which every arm shares); the rest (acceptance, costs, services) comes
from the calibration. The figures compared: committed tokens/s (tokens over the summed wave
times) and the agents' per-round wait, p50 and p99.

`bench adaptive`: each phase's configurations, on links shaped by the phase's netem profile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.report import percentile
from broker import messages as m
from sim.engine import Device, Fleet, Link, Server, Session
from sim.inputs import Calibration, LinkSpec, SimInputError

LOOPBACK = LinkSpec(profile="loopback")


@dataclass(frozen=True)
class Comparison:
    """One configuration, measured against simulated."""

    benchmark: str
    label: str
    measured_tokens_per_s: float
    simulated_tokens_per_s: float
    measured_wait_ms: tuple[float, float]  # p50, p99
    simulated_wait_ms: tuple[float, float]

    @property
    def error(self) -> float:
        """Relative error of the simulated tokens/s."""
        return self.simulated_tokens_per_s / self.measured_tokens_per_s - 1.0

    def document(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "label": self.label,
            "measured_tokens_per_s": self.measured_tokens_per_s,
            "simulated_tokens_per_s": self.simulated_tokens_per_s,
            "error": self.error,
            "measured_wait_ms": {"p50": self.measured_wait_ms[0], "p99": self.measured_wait_ms[1]},
            "simulated_wait_ms": {
                "p50": self.simulated_wait_ms[0],
                "p99": self.simulated_wait_ms[1],
            },
        }


@dataclass(frozen=True)
class _Work:
    """One session of a measured wave."""

    task: str
    prompt_tokens: int
    tokens: int


@dataclass
class _Outcome:
    tokens: int = 0
    wall_ms: float = 0.0
    waits: list[float] | None = None

    def add(self, tokens: int, wall_ms: float, waits: Sequence[float]) -> None:
        self.tokens += tokens
        self.wall_ms += wall_ms
        self.waits = [*(self.waits or []), *waits]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_ms * 1e3 if self.wall_ms > 0 else math.nan


def _waves(sessions: list[dict[str, Any]], size: int) -> list[list[_Work]]:
    work = [
        _Work(str(s["task"]), int(s.get("prompt_len") or 32), max(1, int(s["tokens"])))
        for s in sessions
    ]
    return [work[i : i + size] for i in range(0, len(work), size)]


def _measured_waits(sessions: list[dict[str, Any]]) -> tuple[float, float]:
    waits = [ms for s in sessions for ms in s.get("wait_ms", [])]
    return (percentile(waits, 50), percentile(waits, 99))


def _bus_wave(
    fleet: Fleet, devices: list[Device], arm: str, drafter: str, k: int, work: list[_Work]
) -> tuple[float, list[float]]:
    """One wave on the fleet: its wall time and every round's wait at the agents."""
    loop = fleet.loop
    start = loop.now
    ended: list[Session] = []
    sessions = []
    for i, item in enumerate(work):
        adaptive = arm == "adaptive"
        policy = m.Policy(
            mode=m.Mode.DISTRIBUTED,
            draft_model=drafter,
            k=0 if adaptive else k,
        )
        session = Session(
            id=f"s{fleet.rng.getrandbits(48):012x}",
            device=devices[i % len(devices)],
            task=item.task,
            prompt_tokens=item.prompt_tokens,
            length=item.tokens,
            adaptive=adaptive,
            policy=policy,
            opened_at=start,
            on_end=ended.append,
        )
        sessions.append(session)
        fleet.open_session(session)
    while len(ended) < len(sessions):
        before = loop.events
        loop.run(until=loop.now + 60_000.0)
        if loop.events == before:
            raise RuntimeError(f"a simulated {arm} wave stalled with {len(ended)} sessions ended")
    wall = max(s.ended_at or start for s in sessions) - start
    return wall, [w for s in sessions for w in s.waits_ms]


def _plain_wave(fleet: Fleet, work: list[_Work]) -> float:
    """Plain serving of one wave: prefill each prompt in turn, then decode the batch."""
    profile = fleet.verifiers[0].profile
    truth = fleet.verifiers[0].truth
    rng = fleet.rng
    elapsed = sum(
        profile.prefill_fixed_ms + profile.prefill_ms_per_token * w.prompt_tokens for w in work
    )
    left = [w.tokens - 1 for w in work if w.tokens > 1]  # each prefill made the first token
    while left:
        rows = len(left)
        noise = max(0.2, rng.gauss(1.0, profile.pass_cv))
        elapsed += truth.predict(rows, 1) * noise
        left = [n - 1 for n in left if n > 1]
    return elapsed


def replay_e2e(
    calibration: Calibration, document: dict[str, Any], seed: int = 0
) -> list[Comparison]:
    """Every configuration of a `bench e2e` JSON, measured and simulated."""
    try:
        settings = document["settings"]
        runs = {str(r["label"]): r for r in document["runs"]}
        levels = [int(n) for n in settings["sessions"]]
        drafter = str(settings["drafter"])
        agents = int(settings["agents"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SimInputError(f"not a bench e2e document: missing or bad {exc}") from None
    by_run: dict[str, list[dict[str, Any]]] = {}
    for s in document.get("sessions", []):
        by_run.setdefault(str(s["run"]), []).append(s)
    # The benchmark's host: the targets on a CPU of their own, everything else on the other.
    host_cpu = Server()
    fleet = Fleet(calibration, ["cpu"], seed=seed, host_cpu=host_cpu)
    draft_costs = calibration.device_draft_ms_per_token
    device_costs = next(iter(draft_costs.values()), {})
    devices = [
        Device(f"bench-agent-{i}", "bench", Link(LOOPBACK, fleet.rng), dict(device_costs), host_cpu)
        for i in range(agents)
    ]
    comparisons = []
    for level in levels:
        labels = [label for label, r in runs.items() if int(r["sessions"]) == level]
        outcomes = {label: _Outcome() for label in labels}
        waves = {label: _waves(by_run.get(label, []), level) for label in labels}
        for w in range(max((len(v) for v in waves.values()), default=0)):
            order = labels if w % 2 == 0 else list(reversed(labels))
            for label in order:
                if w >= len(waves[label]):
                    continue
                run, work = runs[label], waves[label][w]
                tokens = sum(item.tokens for item in work)
                if run["arm"] == "plain":
                    outcomes[label].add(tokens, _plain_wave(fleet, work), [])
                    continue
                k = int(by_run[label][0].get("k") or 0)
                wall, waits = _bus_wave(fleet, devices, str(run["arm"]), drafter, k, work)
                outcomes[label].add(tokens, wall, waits)
        for label in labels:
            run, outcome = runs[label], outcomes[label]
            waits = outcome.waits or []
            comparisons.append(
                Comparison(
                    "e2e",
                    label,
                    float(run["throughput_tokens_per_s"]),
                    outcome.tokens_per_s,
                    _measured_waits(by_run.get(label, [])),
                    (percentile(waits, 50), percentile(waits, 99)),
                )
            )
    return comparisons
