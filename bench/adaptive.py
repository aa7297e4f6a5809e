"""`specfleet bench adaptive`: the adaptive policy against fixed configurations as the link changes.

One run starts a private Mosquitto with `set_tcp_nodelay true`, SQLite in a temporary home, the
coordinator in this process and one verifier process (threads=1). Every configuration gets an
agent process of its own, and every agent reaches the broker through a network emulator of its
own (`netem`), all of them shaped alike; the coordinator and the verifier talk to the broker
directly. The trace is a series of phases:

  lan -> 4g -> congested -> blip -> wifi

`blip` is the link dropping: each configuration's link is cut for --blip-s seconds, --blip-after-s
into its run, and comes back shaped as wifi. Each phase is a fixed amount of work: the same
--prompts-per-phase prompts (greedy, --max-tokens each, run at once on the configuration's agent)
for every configuration, the prompts changing from phase to phase. Within a phase the
configurations take turns, in an order rotated phase by phase, so that the host's drifting load
falls on all of them alike.

Configurations:
- adaptive: the session opens with k = 0, and the coordinator's policy chooses mode (distributed
  or cloud), drafter and k round by round; its device keeps what it learned from phase to phase;
- every fixed (mode, drafter, k) of the grid (--grid), e.g. distributed:hybrid:4, cloud:hybrid:4;
- the oracle: per phase, the best fixed configuration of that phase (known only afterwards).

The figure is committed (target-verified) tokens per second: a configuration's tokens over its
wall time, first open to last end, per phase and over the whole trace. Until the agent's local
fallback lands, a blip simply stalls sessions. The goals: adaptive >= 1.2x the best single fixed
configuration over the trace, and >= 95% of the oracle.

The default run (3 prompts x 32 tokens per phase, 5 configurations) takes about 5-8 minutes on a
busy 2-core machine; --quick (1 prompt x 16 tokens, 3 configurations) about 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.e2e import ask_one
from core.report import add_json_argument, format_table, write_json
from localfleet.prompts import BenchPrompt, read_prompts

if TYPE_CHECKING:
    from localfleet.fleet import LocalFleet
    from netem import NetworkEmulator

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
DEFAULT_JSON = Path("bench-results/adaptive.json")
BLIP = "blip"
PHASES = ("lan", "4g", "congested", BLIP, "wifi")
BLIP_PROFILE = "wifi"  # the link a blip comes back as
BLIP_S = 1.5
BLIP_AFTER_S = 0.3
DEFAULT_GRID = ("distributed:hybrid:4", "distributed:hybrid:8", "distributed:draft-l1:4")
DEFAULT_GRID_CLOUD = ("cloud:hybrid:4",)
QUICK_GRID = ("distributed:hybrid:4", "cloud:hybrid:4")
ADAPTIVE = "adaptive"
ADAPTIVE_DRAFT = "hybrid"  # the drafter an adaptive session opens with
SESSION_TIMEOUT_S = 300.0
TELEMETRY_INTERVAL_S = 1.0  # agents probe their RTT this often, so the policy sees a link change
WARMUP_TOKENS = 8
# Goals of the issue: adaptive over the best single fixed configuration, and over the oracle.
BEST_FIXED_GOAL = 1.2
ORACLE_GOAL = 0.95


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts",
        type=Path,
        default=DEFAULT_PROMPTS,
        metavar="FILE",
        help="JSONL of {id, task, prompt} (default: ../shared/bench/prompts.jsonl)",
    )
    parser.add_argument(
        "--prompts-per-phase",
        type=int,
        default=None,
        metavar="N",
        help="prompts each phase runs, at once, per configuration (default: 3; --quick: 1)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens generated per session (default: 32; --quick: 16)",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=list(PHASES),
        metavar="PHASE",
        help=f"the trace: network profiles and `{BLIP}` (default: {' '.join(PHASES)})",
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        default=None,
        metavar="MODE:DRAFT:K",
        help="fixed configurations (default: "
        f"{' '.join(DEFAULT_GRID + DEFAULT_GRID_CLOUD)}; --quick: {' '.join(QUICK_GRID)}); "
        "those with a drafter that is not built are left out",
    )
    parser.add_argument(
        "--blip-s", type=float, default=BLIP_S, help=f"length of the blip (default: {BLIP_S})"
    )
    parser.add_argument(
        "--blip-after-s",
        type=float,
        default=BLIP_AFTER_S,
        help=f"the blip starts this long into a configuration's run (default: {BLIP_AFTER_S})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short run (about 2 minutes), as the tests run it"
    )
    add_json_argument(parser, DEFAULT_JSON)


# -- plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A configuration: adaptive (mode None), or a fixed mode, drafter and window."""

    name: str
    mode: str | None = None  # distributed | cloud; None: the coordinator chooses
    draft: str = ADAPTIVE_DRAFT
    k: int = 0

    @property
    def adaptive(self) -> bool:
        return self.mode is None

    @property
    def device_id(self) -> str:
        return "bench-" + self.name.replace(":", "-").replace("+", "-")

    def request(self, prompt: BenchPrompt, max_tokens: int) -> dict[str, Any]:
        """The body of the agent's local API for one session of this configuration."""
        request: dict[str, Any] = {
            "prompt": prompt.prompt,
            "task_type": prompt.task,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "draft": self.draft,
            "k": self.k,
        }
        if self.mode is not None:
            request["mode"] = self.mode
        return request


def parse_grid(entries: Sequence[str]) -> list[Config]:
    """`MODE:DRAFT:K` entries as fixed configurations; ValueError with the reason."""
    configs: list[Config] = []
    for entry in entries:
        parts = entry.split(":")
        if len(parts) != 3:
            raise ValueError(f"a grid entry is MODE:DRAFT:K, got {entry!r}")
        mode, draft, k_text = parts
        if mode not in ("distributed", "cloud"):
            raise ValueError(f"a grid mode is distributed or cloud, got {mode!r}")
        if not k_text.isdigit() or not 1 <= int(k_text) <= 64:
            raise ValueError(f"a grid k is in 1..64, got {k_text!r}")
        configs.append(Config(entry, mode, draft, int(k_text)))
    if len({c.name for c in configs}) != len(configs):
        raise ValueError("the grid lists a configuration twice")
    return configs


def phase_prompts(
    prompts: Sequence[BenchPrompt], phases: int, per_phase: int
) -> list[list[BenchPrompt]]:
    """Each phase's prompts, taking the task types in turn, different from phase to phase."""
    from bench.e2e import interleave_tasks

    chosen = interleave_tasks(prompts, phases * per_phase)
    return [
        [chosen[(p * per_phase + i) % len(chosen)] for i in range(per_phase)] for p in range(phases)
    ]


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments with a one-line reason, before anything starts; fill the defaults."""
    from core.errors import CommandError
    from netem.profiles import PROFILES

    if args.prompts_per_phase is None:
        args.prompts_per_phase = 1 if args.quick else 3
    if args.max_tokens is None:
        args.max_tokens = 16 if args.quick else 32
    if args.grid is None:
        args.grid = list(QUICK_GRID if args.quick else DEFAULT_GRID + DEFAULT_GRID_CLOUD)
    if not 1 <= args.prompts_per_phase <= 8:
        raise CommandError(f"--prompts-per-phase must be in 1..8, got {args.prompts_per_phase}")
    if not 2 <= args.max_tokens <= 512:
        raise CommandError(f"--max-tokens must be in 2..512, got {args.max_tokens}")
    known = {name for name, profile in PROFILES.items() if not profile.offline} | {BLIP}
    for phase in args.phases:
        if phase not in known:
            raise CommandError(f"unknown phase {phase!r}; known: {', '.join(sorted(known))}")
    if not 0.0 < args.blip_s <= 30.0:
        raise CommandError(f"--blip-s must be in (0, 30], got {args.blip_s}")
    if not 0.0 <= args.blip_after_s <= 30.0:
        raise CommandError(f"--blip-after-s must be in [0, 30], got {args.blip_after_s}")
    try:
        parse_grid(args.grid)
    except ValueError as exc:
        raise CommandError(f"--grid: {exc}") from None
    if not args.prompts.is_file():
        raise CommandError(f"no prompts file {args.prompts}")


def resolve_grid(args: argparse.Namespace, models_dir: Path) -> tuple[list[Config], list[str]]:
    """The fixed configurations whose drafter exists, and the names left out."""
    from core.errors import CommandError
    from inference.drafters import drafter_names

    known = set(drafter_names(models_dir))
    grid = parse_grid(args.grid)
    kept = [c for c in grid if c.draft in known]
    if not kept:
        raise CommandError(f"no drafter of the grid is built in {models_dir}")
    return kept, [c.name for c in grid if c.draft not in known]


# -- running ----------------------------------------------------------------------------------


@dataclass
class PhaseRun:
    """One configuration's work in one phase."""

    phase: str
    config: str
    wall_s: float
    sessions: list[dict[str, Any]]  # the agent's summaries, with prompt_id and round modes
    # A blip's: from the cut until the agent's connection through the link was accepted again
    # (None: no blip, or no connection came back within the run).
    link_back_s: float | None = None

    @property
    def tokens(self) -> int:
        return sum(int(s["tokens"]) for s in self.sessions)

    @property
    def rounds(self) -> int:
        return sum(int(s["rounds"]) for s in self.sessions)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def modes(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for session in self.sessions:
            counts.update(session["round_modes"])
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "config": self.config,
            "wall_s": self.wall_s,
            "tokens": self.tokens,
            "rounds": self.rounds,
            "tokens_per_s": self.tokens_per_s,
            "round_modes": dict(self.modes()),
            "link_back_s": self.link_back_s,
        }


@dataclass
class Trace:
    configs: list[Config]
    phases: list[str]
    runs: list[PhaseRun] = field(default_factory=list)
    workdir: Path = Path()
    left_out: list[str] = field(default_factory=list)

    def run_of(self, phase: str, config: str) -> PhaseRun:
        return next(r for r in self.runs if r.phase == phase and r.config == config)


def _round_modes(fleet: LocalFleet, session_id: str) -> list[str]:
    """The mode of each stored round of a session, in order."""
    import sqlalchemy as sa

    from coordinator.db.models import Round

    with fleet.coordinator.sessions() as db:
        modes = db.scalars(
            sa.select(Round.mode)
            .where(Round.session_id == uuid.UUID(session_id))
            .order_by(Round.round_index)
        ).all()
    return [mode.value for mode in modes]


async def run_phase(
    fleet: LocalFleet,
    config: Config,
    link: NetworkEmulator,
    phase: str,
    prompts: list[BenchPrompt],
    args: argparse.Namespace,
) -> PhaseRun:
    """The phase's prompts at once on the configuration's agent; the blip cuts its link."""
    port = fleet.agent_ports[config.device_id]

    async def one(prompt: BenchPrompt) -> dict[str, Any]:
        request = config.request(prompt, args.max_tokens)
        label = f"{phase} {config.name} {prompt.id}"
        summary = await ask_one(port, request, label, SESSION_TIMEOUT_S)
        modes = await asyncio.to_thread(_round_modes, fleet, summary["session_id"])
        return {**summary, "prompt_id": prompt.id, "task": prompt.task, "round_modes": modes}

    cut_at: float | None = None

    async def blip() -> None:
        nonlocal cut_at
        await asyncio.sleep(args.blip_after_s)
        cut_at = time.monotonic()  # the emulator's clock
        link.cut(args.blip_s)

    started = time.perf_counter()
    blipping = asyncio.create_task(blip(), name="bench-blip") if phase == BLIP else None
    try:
        sessions = await asyncio.gather(*(one(prompt) for prompt in prompts))
    finally:
        if blipping is not None:
            blipping.cancel()
    wall_s = time.perf_counter() - started
    ended = time.monotonic()
    back_s = None
    if phase == BLIP:
        link.restore()  # a blip that outlasted the run ends with it
        # When the agent got through again within the run: its client's back-off draw, which
        # `sim validate` replays (replays drawing their own missed by up to 53%).
        if cut_at is not None:  # None: the sessions ended before the cut came
            back = link.connected_since(cut_at)
            if back is not None and back <= ended:
                back_s = back - cut_at
    return PhaseRun(phase, config.name, wall_s, list(sessions), back_s)


def _start_agent(fleet: LocalFleet, config: Config, broker_url: str, runtime: str) -> None:
    from coordinator.db.registry import DeviceExistsError
    from localfleet.fleet import AgentSpec

    spec = AgentSpec(config.device_id, "phone", config.draft, runtime)
    registry = fleet.coordinator.registry
    try:
        _, credential = registry.provision(spec.device_id, spec.kind, ("bench",), actor="bench")
    except DeviceExistsError:
        credential = registry.rotate_credential(spec.device_id, actor="bench")
    fleet.credentials[spec.device_id] = credential
    fleet.start_agent(
        spec,
        broker_url=broker_url,
        extra=["--telemetry-interval", str(TELEMETRY_INTERVAL_S)],
    )


async def run_trace(
    args: argparse.Namespace, configs: list[Config], phase_work: list[list[BenchPrompt]]
) -> Trace:
    from tqdm import tqdm

    from broker.mosquitto import PrivateMosquitto
    from core.settings import Settings
    from inference.drafters import BUILTIN_DRAFTERS
    from localfleet.fleet import START_TIMEOUT_S, local_fleet
    from modelbuild.target_build import ensure_target
    from netem import NetworkEmulator

    base = Settings()
    workdir = Path(tempfile.mkdtemp(prefix="specfleet-bench-adaptive-"))
    home = workdir / "home"
    settings = Settings(
        home=home,
        models_dir=base.resolved_models_dir,
        database_url=f"sqlite:///{home / 'specfleet.db'}",
        coordinator_id=f"bench-adaptive-{uuid.uuid4().hex[:8]}",
    )
    await asyncio.to_thread(ensure_target, settings.resolved_models_dir)
    trace = Trace(configs, list(args.phases), workdir=workdir)
    with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
        print(
            f"starting 1 verifier and {len(configs)} agents, each behind its own emulated link "
            f"to {mosquitto.url} (logs in {workdir})",
            file=sys.stderr,
            flush=True,
        )
        async with contextlib.AsyncExitStack() as stack:
            fleet = await stack.enter_async_context(
                local_fleet(
                    settings,
                    [],
                    ["bench-verifier"],
                    workdir=workdir,
                    external_broker=mosquitto.url,
                )
            )
            links: dict[str, NetworkEmulator] = {}
            for config in configs:
                links[config.name] = await stack.enter_async_context(
                    NetworkEmulator(0, mosquitto.host, mosquitto.port, profile="lan")
                )
                # The adaptive device has the neural drafts too, so the policy may pick one.
                neural = config.adaptive or config.draft not in BUILTIN_DRAFTERS
                url = f"mqtt://127.0.0.1:{links[config.name].port}"
                _start_agent(fleet, config, url, "onnx" if neural else "none")
            await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
            total = len(configs) * (len(trace.phases) + 1)
            with tqdm(total=total, desc="adaptive trace", unit="run", file=sys.stderr) as bar:
                # Warm-up on the LAN: drafters loaded on the devices and on the verifier host.
                warm = phase_work[0][:1]
                await asyncio.gather(
                    *(
                        ask_one(
                            fleet.agent_ports[c.device_id],
                            c.request(warm[0], WARMUP_TOKENS),
                            f"warm-up {c.name}",
                            SESSION_TIMEOUT_S,
                        )
                        for c in configs
                    )
                )
                bar.update(len(configs))
                for number, (phase, prompts) in enumerate(
                    zip(trace.phases, phase_work, strict=True)
                ):
                    profile = BLIP_PROFILE if phase == BLIP else phase
                    for link in links.values():
                        link.set_profile(profile)
                    shift = number % len(configs)
                    for config in configs[shift:] + configs[:shift]:
                        bar.set_postfix_str(f"{phase}: {config.name}")
                        trace.runs.append(
                            await run_phase(fleet, config, links[config.name], phase, prompts, args)
                        )
                        bar.update(1)
    return trace


# -- report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    what: str
    goal: float
    measured: float

    @property
    def met(self) -> bool:
        return self.measured >= self.goal

    def line(self) -> str:
        verdict = "met" if self.met else "NOT met"
        return f"{self.what}: {self.measured:.3f} (goal >= {self.goal}) {verdict}"


def _rate(runs: Sequence[PhaseRun]) -> float:
    wall = sum(r.wall_s for r in runs)
    return sum(r.tokens for r in runs) / wall if wall > 0 else float("nan")


def summarize(trace: Trace) -> dict[str, Any]:
    """Per phase and over the trace: every configuration's tokens/s, the oracle, the ratios."""
    fixed = [c.name for c in trace.configs if not c.adaptive]
    phases: list[dict[str, Any]] = []
    oracle_runs: list[PhaseRun] = []
    for phase in trace.phases:
        runs = {c.name: trace.run_of(phase, c.name) for c in trace.configs}
        best = max(fixed, key=lambda name: runs[name].tokens_per_s)
        oracle_runs.append(runs[best])
        adaptive = runs[ADAPTIVE]
        phases.append(
            {
                "phase": phase,
                "tokens_per_s": {name: run.tokens_per_s for name, run in runs.items()},
                "best_fixed": best,
                "adaptive_over_best_fixed": adaptive.tokens_per_s / runs[best].tokens_per_s,
                "adaptive_round_modes": dict(adaptive.modes()),
            }
        )
    totals = {c.name: _rate([r for r in trace.runs if r.config == c.name]) for c in trace.configs}
    best_fixed = max(fixed, key=lambda name: totals[name])
    oracle = _rate(oracle_runs)
    return {
        "phases": phases,
        "totals": totals,
        "best_fixed": best_fixed,
        "oracle_tokens_per_s": oracle,
        "adaptive_over_best_fixed": totals[ADAPTIVE] / totals[best_fixed],
        "adaptive_over_oracle": totals[ADAPTIVE] / oracle,
    }


def identity_check(trace: Trace) -> tuple[int, list[str]]:
    """Every configuration's answer to a prompt compared with the first one's: (checked, differ)."""
    reference: dict[str, list[int]] = {}
    checked = 0
    differing: list[str] = []
    for run in trace.runs:
        for session in run.sessions:
            expected = reference.setdefault(session["prompt_id"], session["token_ids"])
            checked += 1
            if session["token_ids"] != expected:
                differing.append(f"{run.phase}:{run.config}:{session['prompt_id']}")
    return checked, differing


def report(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and the goals; return the JSON document."""
    summary = summarize(trace)
    names = [c.name for c in trace.configs]
    print(
        f"\n1 verifier (threads=1), private Mosquitto; one agent per configuration, each behind "
        f"its own emulated link; {args.prompts_per_phase} prompt(s) x {args.max_tokens} tokens "
        f"per phase, greedy; blip: the link cut {args.blip_s}s, {args.blip_after_s}s in, back "
        f"as {BLIP_PROFILE}"
    )
    if trace.left_out:
        print(f"left out (drafter not built): {', '.join(trace.left_out)}")
    headers = ["phase", *names, "best fixed", "adaptive/best"]
    rows: list[list[Any]] = []
    for phase in summary["phases"]:
        rates = phase["tokens_per_s"]
        rows.append(
            [
                phase["phase"],
                *(rates[name] for name in names),
                phase["best_fixed"],
                phase["adaptive_over_best_fixed"],
            ]
        )
    totals = summary["totals"]
    rows.append(["total", *(totals[name] for name in names), summary["best_fixed"], "-"])
    print("\ncommitted tokens/s per phase (each configuration's tokens over its wall time)")
    print(format_table(headers, rows))
    print(f"oracle (best fixed per phase) over the trace: {summary['oracle_tokens_per_s']:.3f}")
    modes = ", ".join(
        f"{p['phase']} {'/'.join(f'{m} {n}' for m, n in sorted(p['adaptive_round_modes'].items()))}"
        for p in summary["phases"]
    )
    print(f"adaptive rounds by mode: {modes}")
    checked, differing = identity_check(trace)
    differ_text = f" (differ: {', '.join(differing[:8])})" if differing else ""
    print(f"greedy answers equal across configurations: {checked - len(differing)}/{checked}")
    if differing:
        print(differ_text)
    goals = [
        Goal(
            f"adaptive / best fixed ({summary['best_fixed']}) over the trace",
            BEST_FIXED_GOAL,
            summary["adaptive_over_best_fixed"],
        ),
        Goal("adaptive / oracle over the trace", ORACLE_GOAL, summary["adaptive_over_oracle"]),
    ]
    print("goals")
    for goal in goals:
        print(f"  {goal.line()}")
    return {
        "benchmark": "adaptive",
        "settings": {
            "phases": trace.phases,
            "prompts_per_phase": args.prompts_per_phase,
            "max_tokens": args.max_tokens,
            "grid": [c.name for c in trace.configs if not c.adaptive],
            "left_out": trace.left_out,
            "blip_s": args.blip_s,
            "blip_after_s": args.blip_after_s,
            "blip_profile": BLIP_PROFILE,
            "quick": args.quick,
            "verifiers": 1,
            "workdir": str(trace.workdir),
        },
        **summary,
        "goals": [
            {"goal": g.what, "target": g.goal, "measured": g.measured, "met": g.met} for g in goals
        ],
        "identity": {"checked": checked, "differing": differing},
        "runs": [r.to_json() for r in trace.runs],
        "sessions": [
            {"phase": r.phase, "config": r.config, **s} for r in trace.runs for s in r.sessions
        ],
    }


def run(args: argparse.Namespace) -> int:
    from bench.e2e import _QuietLoggers
    from core.errors import CommandError
    from core.settings import Settings

    check_arguments(args)
    grid, left_out = resolve_grid(args, Settings().resolved_models_dir)
    try:
        prompts = read_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read prompts: {exc}") from exc
    configs = [Config(ADAPTIVE), *grid]
    phase_work = phase_prompts(prompts, len(args.phases), args.prompts_per_phase)
    print(
        f"{len(args.phases)} phases ({' -> '.join(args.phases)}) x {len(configs)} configurations "
        f"({', '.join(c.name for c in configs)})",
        file=sys.stderr,
    )
    with _QuietLoggers(("coordinator", "broker", "httpx", "verifier", "netem")):
        trace = asyncio.run(run_trace(args, configs, phase_work))
    trace.left_out = left_out
    document = report(trace, args)
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    return 0
