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

from broker import messages as m
from broker.client import RECONNECT_MAX_S, RECONNECT_MIN_S
from core.report import percentile
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
    # The lowest and highest simulated tokens/s over the replays averaged (one replay: itself).
    simulated_range: tuple[float, float] | None = None

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
            "simulated_range": list(self.simulated_range or (self.simulated_tokens_per_s,) * 2),
        }


def mean_of(replays: Sequence[Sequence[Comparison]]) -> list[Comparison]:
    """The same configurations simulated under several seeds, as one comparison each: the mean
    simulated tokens/s and wait percentiles, with the range of the tokens/s. A bench
    configuration runs for seconds, so one replay's draws (acceptance, pass noise, links) move
    it by several percent; the prediction is their mean."""
    first, n = replays[0], len(replays)
    merged = []
    for i, c in enumerate(first):
        runs = [replay[i] for replay in replays]
        if any((r.benchmark, r.label) != (c.benchmark, c.label) for r in runs):
            raise ValueError("replays of different configurations cannot be averaged")
        rates = [r.simulated_tokens_per_s for r in runs]
        merged.append(
            Comparison(
                benchmark=c.benchmark,
                label=c.label,
                measured_tokens_per_s=c.measured_tokens_per_s,
                simulated_tokens_per_s=sum(rates) / n,
                measured_wait_ms=c.measured_wait_ms,
                simulated_wait_ms=(
                    sum(r.simulated_wait_ms[0] for r in runs) / n,
                    sum(r.simulated_wait_ms[1] for r in runs) / n,
                ),
                simulated_range=(min(rates), max(rates)),
            )
        )
    return merged


@dataclass(frozen=True)
class _Work:
    """One session of a measured wave."""

    task: str
    prompt_tokens: int
    tokens: int
    prompt: str | None = None  # its prompt's id: acceptance is drawn from that prompt's rates
    # Its rounds as measured, (drafted, accepted), replayed as they were (`Session.trace`): a
    # fixed window's session only, whose rounds the load does not change.
    trace: tuple[tuple[int, int], ...] = ()


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


def _waves(
    sessions: list[dict[str, Any]],
    size: int,
    prompt_lens: dict[str, int] | None = None,
    traced: bool = False,
) -> list[list[_Work]]:
    """A run's sessions in its waves of `size`. A session's prompt length is its own, else its
    prompt's in another arm (plain serving recorded none before bench e2e timed its prefills),
    else 32. `traced`: each session's rounds are replayed as measured (`_trace`)."""
    lens = prompt_lens or {}
    work = [
        _Work(
            str(s["task"]),
            int(s.get("prompt_len") or lens.get(str(s.get("prompt_id"))) or 32),
            max(1, int(s["tokens"])),
            _prompt(s),
            _trace(s) if traced else (),
        )
        for s in sessions
    ]
    return [work[i : i + size] for i in range(0, len(work), size)]


def _trace(session: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """A measured session's rounds, (drafted, accepted) each, where its JSON has them."""
    drafted, accepted = session.get("drafted"), session.get("accepted")
    if not isinstance(drafted, list) or not isinstance(accepted, list):
        return ()
    return tuple((int(d), int(a)) for d, a in zip(drafted, accepted, strict=False))


def _prompt(session: dict[str, Any]) -> str | None:
    prompt = session.get("prompt_id")
    return None if prompt is None else str(prompt)


def _measured_waits(sessions: list[dict[str, Any]]) -> tuple[float, float]:
    waits = [ms for s in sessions for ms in s.get("wait_ms", [])]
    return (percentile(waits, 50), percentile(waits, 99))


def _bus_wave(
    fleet: Fleet, devices: list[Device], arm: str, drafter: str, k: int, work: list[_Work]
) -> tuple[float, list[float]]:
    """One wave of a `bench e2e` bus arm: its sessions spread over the agents in turn."""
    adaptive = arm == "adaptive"
    policy = m.Policy(mode=m.Mode.DISTRIBUTED, draft_model=drafter, k=0 if adaptive else k)
    items = [(devices[i % len(devices)], item, adaptive, policy) for i, item in enumerate(work)]
    return _wave(fleet, items)


def _wave(
    fleet: Fleet, items: Sequence[tuple[Device, _Work, bool, m.Policy]]
) -> tuple[float, list[float]]:
    """Sessions opened at once, run until the last ends: the wall time, first open to last
    end, and every round's wait at the agents."""
    loop = fleet.loop
    start = loop.now
    ended: list[Session] = []
    sessions: list[Session] = []

    def on_end(session: Session) -> None:
        ended.append(session)
        if len(ended) == len(items):
            loop.halted = True  # the wave is over: the next one starts now

    for device, item, adaptive, policy in items:
        session = Session(
            id=f"s{fleet.rng.getrandbits(48):012x}",
            device=device,
            task=item.task,
            prompt_tokens=item.prompt_tokens,
            length=item.tokens,
            adaptive=adaptive,
            policy=policy,
            opened_at=start,
            on_end=on_end,
            prompt=item.prompt,
            trace=item.trace,
        )
        sessions.append(session)
        fleet.open_session(session)
    while len(ended) < len(sessions):
        before = loop.events
        loop.run(until=loop.now + 600_000.0)
        if loop.events == before:
            raise RuntimeError(f"a simulated wave stalled with {len(ended)} sessions ended")
    wall = max(s.ended_at or start for s in sessions) - start
    return wall, [w for s in sessions for w in s.waits_ms]


def _plain_wave(fleet: Fleet, work: list[_Work], prefill_speed: float | None = None) -> float:
    """Plain serving of one wave: prefill each prompt in turn (at `prefill_speed` times the
    profile's where the run timed its prefills, else at its decode speed), then decode the
    batch."""
    verifier = fleet.verifiers[0]  # plain serving runs on the CPU the verifier's target has
    profile, truth, speed = verifier.profile, verifier.truth, verifier.speed
    rng = fleet.rng
    elapsed = (speed if prefill_speed is None else prefill_speed) * sum(
        profile.prefill_ms(w.prompt_tokens) for w in work
    )
    left = [w.tokens - 1 for w in work if w.tokens > 1]  # each prefill made the first token
    while left:
        rows = len(left)
        noise = max(0.2, rng.gauss(1.0, profile.pass_cv))
        elapsed += truth.predict(rows, 1) * speed * noise
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
    if settings.get("arrivals", "waves") != "waves":
        # The replay starts each level's sessions in waves, as bench e2e does by default.
        raise SimInputError(
            f"settings.arrivals: a bench e2e run with {settings['arrivals']!r} arrivals; "
            "the simulator replays waves (bench e2e without --arrivals)"
        )
    by_run: dict[str, list[dict[str, Any]]] = {}
    prompt_lens: dict[str, int] = {}
    for s in document.get("sessions", []):
        by_run.setdefault(str(s["run"]), []).append(s)
        if s.get("prompt_len") and s.get("prompt_id") is not None:
            prompt_lens[str(s["prompt_id"])] = int(s["prompt_len"])
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
        # The fixed drafter's sessions replay their measured rounds: greedy, with the same
        # window at every level, a prompt's session drafts and is accepted alike each time
        # (the adaptive arm's windows follow the policy, and are drawn).
        waves = {
            label: _waves(
                by_run.get(label, []), level, prompt_lens, traced=runs[label]["arm"] == "fixed"
            )
            for label in labels
        }
        for w in range(max((len(v) for v in waves.values()), default=0)):
            order = labels if w % 2 == 0 else list(reversed(labels))
            for label in order:
                if w >= len(waves[label]):
                    continue
                run, work = runs[label], waves[label][w]
                fleet.verifiers[0].speed = calibration.host_speed.get(f"e2e {label}", 1.0)
                tokens = sum(item.tokens for item in work)
                if run["arm"] == "plain":
                    prefill_speed = calibration.host_speed.get(f"e2e {label} prefill")
                    outcomes[label].add(tokens, _plain_wave(fleet, work, prefill_speed), [])
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


# -- bench adaptive ------------------------------------------------------------------------------

ADAPTIVE = "adaptive"
TELEMETRY_INTERVAL_MS = 1000.0  # bench adaptive's agents probe their RTT once a second
WARMUP_TOKENS = 8  # bench adaptive's warm-up sessions, on the LAN, all configurations at once


def _config_policy(name: str) -> tuple[bool, m.Policy]:
    """`adaptive` (opens with k = 0 and the hybrid drafter) or MODE:DRAFT:K."""
    if name == ADAPTIVE:
        return True, m.Policy(mode=m.Mode.DISTRIBUTED, draft_model="hybrid", k=0)
    try:
        mode, draft, k = name.split(":")
        return False, m.Policy(mode=m.Mode(mode), draft_model=draft, k=int(k))
    except ValueError:
        raise SimInputError(f"bench adaptive: configuration {name!r} is not MODE:DRAFT:K") from None


def _probe_rtt(fleet: Fleet, devices: Sequence[Device]) -> None:
    """Each agent's telemetry: an RTT probe to the coordinator, as the policy hears it."""
    now = fleet.loop.now
    for device in devices:
        up = device.link.delay(now, upstream=True) - now
        down = device.link.delay(now + up, upstream=False) - now - up
        if up + down < TELEMETRY_INTERVAL_MS:  # a probe across a cut link never returns
            fleet.policy.observe_rtt(device.id, up + down + 2 * fleet.broker.hop_ms)
    fleet.loop.after(TELEMETRY_INTERVAL_MS, _probe_rtt, fleet, devices)


def _cut(
    link: Link, now: float, run: dict[str, Any], after_s: float, for_s: float, resume_ms: float
) -> None:
    """A blip on a replayed run's link. Where the run says when its agent's connection came back
    (`link_back_s`, from the cut), the link is out that long: one draw of the client's back-off
    sets a measured blip run's figure (in one run the agents were back 0.2 to 1.6 s after the
    cut ended, and replays drawing their own came out 6% slow to 53% fast), and the replay
    takes the same draw. Otherwise the back-off is drawn, as the client draws it."""
    back_s = run.get("link_back_s")
    at = now + after_s * 1e3
    if isinstance(back_s, int | float) and math.isfinite(back_s) and back_s >= for_s:
        link.cut(at, back_s * 1e3, None, resume_ms)
    else:
        link.cut(at, for_s * 1e3, (RECONNECT_MIN_S, RECONNECT_MAX_S), resume_ms)


def replay_adaptive(
    calibration: Calibration, document: dict[str, Any], seed: int = 0
) -> list[Comparison]:
    """Every (phase, configuration) run of a `bench adaptive` JSON, measured and simulated:
    one agent per configuration behind its own link shaped by the phase's profile (a blip cuts
    it --blip-s, --blip-after-s into the run, back as its blip profile), the runs in the order
    they ran, each with the phase's prompts at once; one verifier, and one policy that keeps
    what it learns from phase to phase."""
    try:
        settings = document["settings"]
        runs = list(document["runs"])
        blip_s = float(settings.get("blip_s", 1.5))
        blip_after_s = float(settings.get("blip_after_s", 0.3))
        blip_profile = str(settings.get("blip_profile", "wifi"))
        configs = list(dict.fromkeys(str(r["config"]) for r in runs))
        work: dict[tuple[str, str], list[_Work]] = {}
        for s in document["sessions"]:
            key = (str(s["phase"]), str(s["config"]))
            fixed = str(s["config"]) != ADAPTIVE  # a fixed window: its rounds replayed as run
            item = _Work(
                str(s["task"]),
                int(s.get("prompt_len") or 32),
                max(1, int(s["tokens"])),
                _prompt(s),
                _trace(s) if fixed else (),
            )
            work.setdefault(key, []).append(item)
    except (KeyError, TypeError, ValueError) as exc:
        raise SimInputError(f"not a bench adaptive document: missing or bad {exc}") from None
    host_cpu = Server()
    fleet = Fleet(calibration, ["cpu"], seed=seed, host_cpu=host_cpu)
    device_costs = next(iter(calibration.device_draft_ms_per_token.values()), {})
    devices = {
        name: Device(f"bench-{name}", "bench", Link(LOOPBACK, fleet.rng), dict(device_costs))
        for name in configs
    }
    for device in devices.values():
        device.cpu = host_cpu
    fleet.loop.after(0.0, _probe_rtt, fleet, list(devices.values()))
    # The warm-up: every configuration at once on the LAN, a few tokens of the first prompt.
    first = next(iter(work.values()))[0]
    for device in devices.values():
        device.link = Link(LinkSpec(profile="lan"), fleet.rng)
        device.link.extra_ms = calibration.emulated_link_ms / 2
    warm = _Work(first.task, first.prompt_tokens, WARMUP_TOKENS)
    _wave(fleet, [(devices[name], warm, *_config_policy(name)) for name in configs])
    comparisons = []
    phase_now = None
    for run in runs:
        phase, config = str(run["phase"]), str(run["config"])
        if phase != phase_now:  # every link is shaped for the phase
            phase_now = phase
            for device in devices.values():
                profile = blip_profile if phase == "blip" else phase
                device.link = Link(LinkSpec(profile=profile), fleet.rng)
                device.link.extra_ms = calibration.emulated_link_ms / 2
        device = devices[config]
        speed = calibration.host_speed.get(f"adaptive {phase} {config}", 1.0)
        fleet.verifiers[0].speed = speed
        if phase == "blip":
            _cut(device.link, fleet.loop.now, run, blip_after_s, blip_s, calibration.reconnect_ms)
        adaptive, policy = _config_policy(config)
        items = work.get((phase, config), [])
        wall, waits = _wave(fleet, [(device, item, adaptive, policy) for item in items])
        tokens = sum(item.tokens for item in items)
        measured_waits = [
            w
            for s in document["sessions"]
            if s["phase"] == phase and s["config"] == config
            for w in s.get("wait_ms", [])
        ]
        comparisons.append(
            Comparison(
                "adaptive",
                f"{phase} {config}",
                float(run["tokens_per_s"]),
                tokens / wall * 1e3 if wall > 0 else math.nan,
                (percentile(measured_waits, 50), percentile(measured_waits, 99)),
                (percentile(waits, 50), percentile(waits, 99)),
            )
        )
    return comparisons
