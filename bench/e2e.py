"""`specfleet bench e2e`: distributed speculative decoding over a real bus against the target alone.

One run starts a private Mosquitto with `set_tcp_nodelay true` (or uses --broker), SQLite in a
temporary home (or --database-url), the coordinator in this process, ONE verifier process
(threads=1, so all throughput figures are that verifier's) and --agents agent processes, and
drives greedy sessions through the agents' local APIs, as `specfleet demo` does.

Baseline: target-only decoding on the same fleet and the same verifier. The agent opens the
session with k=0, so its first round sends an empty draft. The coordinator reads an opening k
of 0 as "choose for me" (its adaptive policy, and its default window until then), so as soon as
the open is handled, before any verdict of the session leaves, the benchmark takes the session
off the adaptive policy and fixes its window at 0 (`SessionBook.set_k`): every round then
commits exactly the target's one token. The run checks that no target-only round carried a
draft, and compares every DSD answer with the target-only answer to the same prompt.

1. Single session: level 1 runs one session at a time on one agent. A session's tokens/s is its
   generated tokens over its wall time from open to end (prefill included), as the agent reports
   it; the figure is sum(tokens) / sum(time) over the configuration's sessions.
2. Verifier throughput at c concurrent sessions (c = --sessions): a level's work (max(--limit, c)
   sessions, rounded up to a multiple of c) runs in waves of c sessions started together, session
   i of a wave on agent i mod --agents. Committed tokens/s is every generated token over the sum
   of the configuration's wave times (first open to last end); the one verifier batches across
   the sessions. A wave's last sessions run with fewer beside them, as any finite run does.
   In every level the configurations (target-only, DSD, the part 4 runs) take turns wave by
   wave, in an order reversed every other wave, so that the host's drifting load falls on all
   of them alike (on the shared 2-core host this was written on, the target's compute time per
   round differed by up to 1.5x between runs minutes apart).
3. Per-round overhead beyond model compute: for every verified round, the agent's wait (draft
   handed to the bus until its verdict is in the session's inbox) minus the verifier's compute
   (`verify_batch` in its inference process) and its queue (request received until its batch
   goes to the inference process: the batching window plus any wait behind other batches).
   Probes in the in-process coordinator (its Draft handler, `VerifierPool.verify`, the round
   writer and the book's publish function, wrapped) split the rest into: the agent<->coordinator
   legs (wait - handler, where the handler's time ends as the verdict's publish begins: the draft
   up, the verdict down, both agents' and the coordinator's dispatch), the persistence of the
   round (its group commit), the rest of the coordinator's work (validation, the verify request,
   stop rules, building the verdict) and the coordinator<->verifier leg (round trip - queue -
   compute: two broker hops, JSON both ways, the pipe to the inference process and back). Each
   term is a difference of durations measured inside one process; no clocks are compared across
   processes. The goal is judged on the DSD single-session rounds.
4. Proactive drafting: for --proactive-drafters (by default --drafter, plus a neural drafter
   where one is installed, since copying drafters cost too little for drafting ahead to hide
   anything) the levels in --proactive-sessions run with proactive drafting on and off (the local
   API's per-session switch).

The default run (10 prompts, 48 tokens, levels 1/4/16, part 4 at 1 and 4) takes 3-6 minutes on
a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bench.models import BenchPrompt, read_prompts
from bench.report import add_json_argument, format_table, median, percentile, write_json

if TYPE_CHECKING:
    import httpx

    from broker import messages as m
    from coordinator.db.models import Round, SessionStatus
    from coordinator.localfleet import LocalFleet
    from coordinator.service import Coordinator

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
DEFAULT_JSON = Path("bench-results/e2e.json")
SHARED_BROKER_PORT = 1883
LEVELS = (1, 4, 16)
PROACTIVE_LEVELS = (1, 4)
# Copying drafters cost next to nothing, so drafting ahead has little to hide with them; part 4
# also runs this neural one by default where it is installed.
NEURAL_PROACTIVE_DRAFTER = "hybrid+draft-l1"
SESSIONS_PER_AGENT = 4  # concurrent sessions one agent is asked to run at most
SESSION_TIMEOUT_S = 600.0
WARMUP_TOKENS = 8
# Goals of the issue: throughput ratio DSD / target-only per level, and the overhead budget.
SINGLE_SESSION_GOAL = 1.5
THROUGHPUT_GOALS = {1: 2.0, 4: 1.5}
OVERHEAD_P50_GOAL_MS = 1.0
OVERHEAD_P99_GOAL_MS = 5.0

Mode = Literal["target", "dsd"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts",
        type=Path,
        default=DEFAULT_PROMPTS,
        metavar="FILE",
        help="JSONL of {id, task, prompt} (default: ../shared/bench/prompts.jsonl)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=10,
        help="prompts used, taken in turn from each task type (default: 10)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=48, help="tokens generated per session (default: 48)"
    )
    parser.add_argument(
        "--drafter",
        default="hybrid",
        metavar="NAME",
        help="drafter of the DSD sessions: lookup, ngram, hybrid, a draft, hybrid+DRAFT "
        "(default: hybrid)",
    )
    parser.add_argument(
        "--k", type=int, default=None, help="DSD window (default: the drafter's own)"
    )
    parser.add_argument(
        "--sessions",
        type=int,
        nargs="+",
        default=list(LEVELS),
        metavar="N",
        help="concurrent sessions per level (default: 1 4 16)",
    )
    parser.add_argument(
        "--proactive-sessions",
        type=int,
        nargs="*",
        default=list(PROACTIVE_LEVELS),
        metavar="N",
        help="levels run again with proactive drafting off; none skips the part (default: 1 4)",
    )
    parser.add_argument(
        "--proactive-drafters",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"drafters of part 4 (default: --drafter, and {NEURAL_PROACTIVE_DRAFTER} where "
        "it is installed)",
    )
    parser.add_argument(
        "--agents", type=int, default=4, help="agent processes generating the load (default: 4)"
    )
    parser.add_argument(
        "--broker",
        metavar="URL",
        default=None,
        help="an external broker instead of the private Mosquitto",
    )
    parser.add_argument("--database-url", metavar="URL", default=None, help="instead of SQLite")
    add_json_argument(parser, DEFAULT_JSON)


# -- plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """One measured configuration: target-only or a drafter, at a number of concurrent sessions."""

    sessions: int  # concurrent clients
    drafter: str | None = None  # None: target-only (k=0 drafts)
    proactive: bool = True

    @property
    def mode(self) -> Mode:
        return "target" if self.drafter is None else "dsd"

    @property
    def label(self) -> str:
        if self.drafter is None:
            return f"target-only x{self.sessions}"
        return f"{self.drafter}{'' if self.proactive else ' no-proactive'} x{self.sessions}"


def interleave_tasks(prompts: Sequence[BenchPrompt], limit: int) -> list[BenchPrompt]:
    """The first `limit` prompts taking one of each task type in turn, in file order."""
    by_task: dict[str, deque[BenchPrompt]] = {}
    for prompt in prompts:
        by_task.setdefault(prompt.task, deque()).append(prompt)
    chosen: list[BenchPrompt] = []
    while len(chosen) < limit and any(by_task.values()):
        for queue in by_task.values():
            if queue and len(chosen) < limit:
                chosen.append(queue.popleft())
    return chosen


def level_work(prompts: Sequence[BenchPrompt], sessions: int) -> list[BenchPrompt]:
    """max(len(prompts), sessions) sessions rounded up to a multiple of `sessions`, cycling."""
    count = math.ceil(max(len(prompts), sessions) / sessions) * sessions
    return [prompts[i % len(prompts)] for i in range(count)]


def plan(
    levels: Sequence[int],
    drafter: str,
    proactive_levels: Sequence[int],
    proactive_drafters: Sequence[str],
) -> list[list[RunConfig]]:
    """The configurations of each level: target-only, DSD, then the part 4 runs."""
    plans: list[list[RunConfig]] = []
    for level in levels:
        configs = [RunConfig(level), RunConfig(level, drafter)]
        if level in proactive_levels:
            for name in proactive_drafters:
                if name != drafter:
                    configs.append(RunConfig(level, name))
                configs.append(RunConfig(level, name, proactive=False))
        plans.append(configs)
    return plans


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments with a one-line reason, before anything starts."""
    from specfleet.cli import CommandError

    if args.limit < 1:
        raise CommandError(f"--limit must be >= 1, got {args.limit}")
    if not 2 <= args.max_tokens <= 8192:
        raise CommandError(f"--max-tokens must be in 2..8192, got {args.max_tokens}")
    if args.k is not None and not 1 <= args.k <= 64:
        raise CommandError(f"--k must be in 1..64, got {args.k}")
    if not 1 <= args.agents <= 16:
        raise CommandError(f"--agents must be in 1..16, got {args.agents}")
    most = args.agents * SESSIONS_PER_AGENT
    for level in args.sessions:
        if not 1 <= level <= most:
            raise CommandError(
                f"--sessions must be in 1..{most} ({SESSIONS_PER_AGENT} per agent), got {level}"
            )
    if len(set(args.sessions)) != len(args.sessions):
        raise CommandError("--sessions lists a level twice")
    extra = sorted(set(args.proactive_sessions) - set(args.sessions))
    if extra:
        raise CommandError(f"--proactive-sessions {extra} are not among --sessions")
    if args.broker is not None and not args.broker.startswith(("mqtt://", "mqtts://")):
        raise CommandError(f"--broker must be an mqtt:// or mqtts:// URL, got {args.broker!r}")
    if not args.prompts.is_file():
        raise CommandError(f"no prompts file {args.prompts}")


def resolve_drafters(args: argparse.Namespace, models_dir: Path) -> list[str]:
    """Check the drafters named; return those of part 4 (the default adds a neural one)."""
    from inference.drafters import drafter_names
    from specfleet.cli import CommandError

    known = drafter_names(models_dir)
    named = args.proactive_drafters
    if named is None:
        named = [args.drafter]
        if NEURAL_PROACTIVE_DRAFTER in known and args.drafter != NEURAL_PROACTIVE_DRAFTER:
            named.append(NEURAL_PROACTIVE_DRAFTER)
    for name in [args.drafter, *named]:
        if name not in known:
            raise CommandError(f"unknown drafter {name!r}; known: {', '.join(known)}")
    return list(dict.fromkeys(named))


def is_neural(name: str) -> bool:
    from inference.drafters import BUILTIN_DRAFTERS

    return name not in BUILTIN_DRAFTERS


# -- probes in the coordinator ----------------------------------------------------------------


@dataclass(frozen=True)
class VerifierLeg:
    round_trip_ms: float  # VerifierPool.verify: request published until its result is back
    queue_ms: float  # the worker's: received until its batch went to the inference process
    verify_ms: float  # verify_batch in the inference process
    batch_size: int


@dataclass(frozen=True)
class RoundTiming:
    """One verified round, its agent wait split by where the time went (all in ms)."""

    session_id: str
    round: int
    wait_ms: float  # agent: draft handed to the bus until its verdict arrived
    handler_ms: float  # coordinator: Draft handler start until the verdict's publish began
    persist_ms: float  # coordinator: the round's group commit, queue to the writer included
    puback_ms: float  # coordinator: the verdict's publish until the broker's PUBACK (off-path)
    leg: VerifierLeg

    @property
    def overhead_ms(self) -> float:
        """Beyond model compute and the verifier's queue: bus, scheduling, persistence."""
        return self.wait_ms - self.leg.verify_ms - self.leg.queue_ms

    @property
    def beyond_compute_ms(self) -> float:
        return self.wait_ms - self.leg.verify_ms

    @property
    def agent_legs_ms(self) -> float:
        """Draft to the coordinator's handler, verdict back to the agent's session."""
        return self.wait_ms - self.handler_ms

    @property
    def coordinator_ms(self) -> float:
        return self.handler_ms - self.leg.round_trip_ms

    @property
    def other_coordinator_ms(self) -> float:
        """Validation, the verify request, stop rules, the verdict: all but persisting."""
        return self.coordinator_ms - self.persist_ms

    @property
    def verifier_leg_ms(self) -> float:
        return self.leg.round_trip_ms - self.leg.queue_ms - self.leg.verify_ms


RoundKey = tuple[str, int]  # (session id, round)


class CoordinatorProbes:
    """Wraps parts of the in-process coordinator to time each round where it spends it.

    Wrapped: the Draft handler, `VerifierPool.verify`, and the book's round writer and publish
    function; each wrapper adds two perf_counter reads and a dict store per round. The writer
    and publish function are private attributes of the `SessionBook`: there is no public handle
    on persistence or on the moment a verdict leaves. The SessionOpen handler is wrapped too, to
    fix at 0 the window of sessions opened with k=0 (the target-only baseline).
    """

    def __init__(self, coordinator: Coordinator) -> None:
        from broker import messages as m

        self.handler_ms: dict[RoundKey, float] = {}
        self.puback_ms: dict[RoundKey, float] = {}
        self.legs: dict[RoundKey, VerifierLeg] = {}
        self.persist_ms: dict[RoundKey, float] = {}
        self.zero_window_sessions: set[str] = set()
        # The round whose Draft handler runs in this task; its last publish is the verdict.
        current: ContextVar[tuple[RoundKey, list[float]] | None] = ContextVar(
            "bench_e2e_round", default=None
        )
        book = coordinator.book
        pool = coordinator.verifiers
        handle_draft = coordinator.device_handlers[m.Draft]
        handle_open = coordinator.device_handlers[m.SessionOpen]
        pool_verify = pool.verify
        writer = book._writer
        write_round = writer.write
        publish = book._publish

        async def timed_verify(request: m.VerifyRequest) -> m.VerifyResult:
            started = time.perf_counter()
            result = await pool_verify(request)
            self.legs[(request.session_id, request.round)] = VerifierLeg(
                (time.perf_counter() - started) * 1e3,
                result.queue_ms,
                result.verify_ms,
                result.batch_size,
            )
            return result

        async def timed_write(
            row: Round, generated: list[int], status: SessionStatus, **details: Any
        ) -> None:
            started = time.perf_counter()
            await write_round(row, generated, status, **details)
            key = (str(row.session_id), row.round_index)
            self.persist_ms[key] = (time.perf_counter() - started) * 1e3

        async def timed_publish(topic: str, payload: bytes) -> None:
            round_in_task = current.get()
            if round_in_task is not None:
                round_in_task[1].append(time.perf_counter())
            await publish(topic, payload)

        async def timed_draft(device_id: str, draft: m.Draft) -> None:
            key = (draft.session_id, draft.round)
            publishes: list[float] = []
            token = current.set((key, publishes))
            started = time.perf_counter()
            try:
                await handle_draft(device_id, draft)
            finally:
                current.reset(token)
            ended = time.perf_counter()
            if key in self.legs and key not in self.handler_ms and publishes:
                self.handler_ms[key] = (publishes[-1] - started) * 1e3
                self.puback_ms[key] = (ended - publishes[-1]) * 1e3

        async def open_keeping_zero_window(device_id: str, request: m.SessionOpen) -> None:
            await handle_open(device_id, request)
            live = book.live.get(request.session_id)
            if request.k == 0 and live is not None:
                live.policy_task = None  # no adaptive policy: the window stays fixed, at 0
                book.set_k(request.session_id, 0)
                self.zero_window_sessions.add(request.session_id)

        pool.verify = timed_verify  # type: ignore[method-assign]
        writer.write = timed_write  # type: ignore[method-assign]
        book._publish = timed_publish
        coordinator.device_handlers[m.Draft] = timed_draft
        coordinator.device_handlers[m.SessionOpen] = open_keeping_zero_window

    def timings(self, session_id: str, wait_ms: Sequence[float]) -> tuple[list[RoundTiming], int]:
        """The rounds of a session matched with the agent's waits; and how many did not match."""
        matched: list[RoundTiming] = []
        missing = 0
        for index, wait in enumerate(wait_ms):
            key = (session_id, index)
            if key in self.legs and key in self.handler_ms:
                matched.append(
                    RoundTiming(
                        session_id,
                        index,
                        wait,
                        self.handler_ms[key],
                        self.persist_ms.get(key, float("nan")),
                        self.puback_ms[key],
                        self.legs[key],
                    )
                )
            else:
                missing += 1
        return matched, missing


# -- running sessions -------------------------------------------------------------------------


@dataclass
class RunResult:
    config: RunConfig
    wall_s: float
    sessions: list[dict[str, Any]]  # the agents' summaries, with prompt_id, task and device_id
    timings: list[RoundTiming] = field(default_factory=list)
    unmatched_rounds: int = 0

    @property
    def tokens(self) -> int:
        return sum(int(s["tokens"]) for s in self.sessions)

    @property
    def rounds(self) -> int:
        return sum(int(s["rounds"]) for s in self.sessions)

    @property
    def throughput(self) -> float:
        """Committed tokens per second of wall time, all sessions together."""
        return self.tokens / self.wall_s

    @property
    def session_tokens_per_s(self) -> float:
        """sum(tokens) / sum(session time): the rate one session sees."""
        return self.tokens / sum(float(s["elapsed_s"]) for s in self.sessions)

    @property
    def alpha(self) -> float | None:
        drafted = sum(sum(s["drafted"]) for s in self.sessions)
        accepted = sum(sum(s["accepted"]) for s in self.sessions)
        return accepted / drafted if drafted else None

    @property
    def drafted_rounds(self) -> int:
        return sum(1 for s in self.sessions for d in s["drafted"] if d)

    @property
    def mean_batch(self) -> float:
        sizes = [t.leg.batch_size for t in self.timings]
        return sum(sizes) / len(sizes) if sizes else float("nan")

    def values(self, what: Callable[[RoundTiming], float]) -> list[float]:
        return [what(t) for t in self.timings]

    def summary(self) -> dict[str, Any]:
        def stats(what: Callable[[RoundTiming], float]) -> dict[str, float]:
            values = self.values(what)
            return {"p50": median(values), "p99": percentile(values, 99)}

        turnaround = [ms for s in self.sessions for ms in s["turnaround_ms"]]
        return {
            "mode": self.config.mode,
            "drafter": self.config.drafter,
            "sessions": self.config.sessions,
            "proactive": self.config.proactive,
            "label": self.config.label,
            "n_sessions": len(self.sessions),
            "tokens": self.tokens,
            "rounds": self.rounds,
            "wall_s": self.wall_s,
            "throughput_tokens_per_s": self.throughput,
            "session_tokens_per_s": self.session_tokens_per_s,
            "tokens_per_round": self.tokens / self.rounds if self.rounds else float("nan"),
            "alpha": self.alpha,
            "drafted_rounds": self.drafted_rounds,
            "mean_batch": self.mean_batch,
            "proactive_hits": sum(int(s["proactive_hits"]) for s in self.sessions),
            "proactive_misses": sum(int(s["proactive_misses"]) for s in self.sessions),
            "proactive_skipped": sum(int(s["proactive_skipped"]) for s in self.sessions),
            "matched_rounds": len(self.timings),
            "unmatched_rounds": self.unmatched_rounds,
            "ms": {
                "wait": stats(lambda t: t.wait_ms),
                "verify": stats(lambda t: t.leg.verify_ms),
                "queue": stats(lambda t: t.leg.queue_ms),
                "overhead": stats(lambda t: t.overhead_ms),
                "beyond_compute": stats(lambda t: t.beyond_compute_ms),
                "agent_legs": stats(lambda t: t.agent_legs_ms),
                "coordinator": stats(lambda t: t.coordinator_ms),
                "persist": stats(lambda t: t.persist_ms),
                "other_coordinator": stats(lambda t: t.other_coordinator_ms),
                "verifier_leg": stats(lambda t: t.verifier_leg_ms),
                "verdict_puback": stats(lambda t: t.puback_ms),
                "turnaround": {"p50": median(turnaround), "p99": percentile(turnaround, 99)},
            },
        }


def session_request(
    prompt: BenchPrompt, config: RunConfig, args: argparse.Namespace, max_tokens: int
) -> dict[str, Any]:
    request: dict[str, Any] = {
        "prompt": prompt.prompt,
        "task_type": prompt.task,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "proactive": config.proactive,
    }
    if config.drafter is None:
        request |= {"draft": "lookup", "k": 0}  # k=0: nothing is ever proposed
    else:
        request["draft"] = config.drafter
        if args.k is not None:
            request["k"] = args.k
    return request


async def ask_one(
    client: httpx.AsyncClient,
    port: int,
    request: dict[str, Any],
    label: str,
    timeout_s: float = SESSION_TIMEOUT_S,
) -> dict[str, Any]:
    """One session through an agent's local API; an error unless it finished."""
    from coordinator.demo import ask

    summary = await asyncio.wait_for(ask(client, port, request, label, False), timeout_s)
    if summary.get("status") != "finished":
        raise RuntimeError(f"{label}: session ended {summary.get('status')}: {summary}")
    return summary


async def run_level(
    fleet: LocalFleet,
    probes: CoordinatorProbes,
    client: httpx.AsyncClient,
    configs: list[RunConfig],
    work: list[BenchPrompt],
    args: argparse.Namespace,
) -> list[RunResult]:
    """One level in waves of c sessions at once, the configurations taking turns wave by wave.

    Session i of a wave runs on agent i mod the agents. The order of the configurations is
    reversed every other wave, so that the host's load, which drifts over minutes on a shared
    machine, falls on every configuration alike. A configuration's wall time is the sum of its
    own waves' times, first open to last end, as if it had run alone.
    """
    from tqdm import tqdm

    level = configs[0].sessions
    devices = list(fleet.agent_ports)
    sessions: dict[RunConfig, list[dict[str, Any]]] = {c: [] for c in configs}
    wall_s = dict.fromkeys(configs, 0.0)
    waves = [work[i : i + level] for i in range(0, len(work), level)]
    desc = f"x{level}: {len(configs)} runs in turns"
    with tqdm(total=len(work) * len(configs), desc=desc, unit="session", file=sys.stderr) as bar:

        async def one(config: RunConfig, index: int, prompt: BenchPrompt) -> dict[str, Any]:
            device_id = devices[index % len(devices)]
            request = session_request(prompt, config, args, args.max_tokens)
            label = f"{config.label} {device_id} {prompt.id}"
            summary = await ask_one(client, fleet.agent_ports[device_id], request, label)
            bar.update(1)
            return {**summary, "prompt_id": prompt.id, "task": prompt.task, "device_id": device_id}

        for number, wave in enumerate(waves):
            for config in configs if number % 2 == 0 else configs[::-1]:
                started = time.perf_counter()
                done = await asyncio.gather(*(one(config, i, p) for i, p in enumerate(wave)))
                wall_s[config] += time.perf_counter() - started
                sessions[config] += done
    return [_with_timings(RunResult(c, wall_s[c], sessions[c]), probes) for c in configs]


def _with_timings(result: RunResult, probes: CoordinatorProbes) -> RunResult:
    for summary in result.sessions:
        matched, missing = probes.timings(summary["session_id"], summary["wait_ms"])
        result.timings += matched
        result.unmatched_rounds += missing
    return result


async def warm_up(
    fleet: LocalFleet, client: httpx.AsyncClient, prompt: BenchPrompt, args: argparse.Namespace
) -> None:
    """A short session per drafter on every agent: drafters loaded, the target warm."""
    jobs: list[Awaitable[dict[str, Any]]] = []
    for device_id, port in fleet.agent_ports.items():
        for drafter in (None, *dict.fromkeys([args.drafter, *args.proactive_drafters])):
            config = RunConfig(1, drafter)
            request = session_request(prompt, config, args, WARMUP_TOKENS)
            jobs.append(ask_one(client, port, request, f"warm-up {device_id} {config.label}"))
    await asyncio.gather(*jobs)


@dataclass
class BenchRun:
    results: list[RunResult]
    broker: str
    database: str
    workdir: Path
    zero_window_sessions: int


async def run_bench(args: argparse.Namespace, prompts: list[BenchPrompt]) -> BenchRun:
    import contextlib

    import httpx

    from broker.mosquitto import PrivateMosquitto
    from coordinator.localfleet import AgentSpec, local_fleet
    from coordinator.settings import Settings
    from inference.target_build import ensure_target
    from inference.tokenizer import ChatTokenizer

    base = Settings()
    workdir = Path(tempfile.mkdtemp(prefix="specfleet-bench-e2e-"))
    home = workdir / "home"
    settings = Settings(
        home=home,
        models_dir=base.resolved_models_dir,
        database_url=args.database_url or f"sqlite:///{home / 'specfleet.db'}",
        coordinator_id=f"bench-e2e-{uuid.uuid4().hex[:8]}",
    )
    target_dir = await asyncio.to_thread(ensure_target, settings.resolved_models_dir)
    eos_id = ChatTokenizer.load(target_dir).eos_id
    neural = any(is_neural(name) for name in [args.drafter, *args.proactive_drafters])
    runtime = "onnx" if neural else "none"
    agents = [
        AgentSpec(f"bench-agent-{i + 1}", "other", args.drafter, runtime)
        for i in range(args.agents)
    ]
    results: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        broker_url = args.broker
        if broker_url is None:
            broker_url = stack.enter_context(PrivateMosquitto(tcp_nodelay=True)).url
        print(
            f"starting 1 verifier and {len(agents)} agents on {broker_url} (logs in {workdir})",
            file=sys.stderr,
            flush=True,
        )
        async with local_fleet(
            settings,
            agents,
            ["bench-verifier"],
            workdir=workdir,
            external_broker=broker_url,
            eos_id=eos_id,
        ) as fleet:
            probes = CoordinatorProbes(fleet.coordinator)
            async with httpx.AsyncClient() as client:
                await warm_up(fleet, client, prompts[0], args)
                plans = plan(
                    args.sessions, args.drafter, args.proactive_sessions, args.proactive_drafters
                )
                for configs in plans:
                    work = level_work(prompts, configs[0].sessions)
                    results += await run_level(fleet, probes, client, configs, work, args)
            zero = len(probes.zero_window_sessions)
    return BenchRun(results, broker_url, settings.database_url, workdir, zero)


# -- report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    what: str
    goal: float
    measured: float
    at_most: bool = False  # a time budget rather than a ratio to reach

    @property
    def met(self) -> bool:
        return self.measured <= self.goal if self.at_most else self.measured >= self.goal

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        verdict = "met" if self.met else "NOT met"
        return f"{self.what}: {self.measured:.3f} (goal {sign} {self.goal}) {verdict}"


def _find(
    results: Sequence[RunResult], level: int, drafter: str | None, proactive: bool = True
) -> RunResult:
    """The run at `level` with `drafter` (None: target-only)."""
    return next(r for r in results if r.config == RunConfig(level, drafter, proactive))


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


Table = tuple[Sequence[str], list[list[Any]]]

SINGLE_HEADERS = ("run", "sessions", "tokens", "rounds", "tok/round", "α", "tok/s", "median tok/s")
THROUGHPUT_HEADERS = (
    *("sessions", "n", "target tok/s", "DSD tok/s", "DSD/target", "goal"),
    *("target batch", "DSD batch", "DSD tok/round"),
)
OVERHEAD_HEADERS = (
    *("run", "rounds", "wait p50", "verify p50", "queue p50", "overhead p50", "overhead p99"),
    *("agent<->coord p50", "persist p50", "coord rest p50", "coord<->verifier p50"),
    "agent turn p50",
)
PROACTIVE_HEADERS = (
    *("drafter", "sessions", "on tok/s", "off tok/s", "on/off"),
    *("on session tok/s", "off session tok/s", "hits/misses/skipped", "on turn", "off turn"),
)


def single_session(results: Sequence[RunResult], drafter: str) -> tuple[Table, Goal]:
    target, dsd = _find(results, 1, None), _find(results, 1, drafter)
    rows = [
        [
            *(r.config.label, len(r.sessions), r.tokens, r.rounds, r.tokens / r.rounds),
            "-" if r.alpha is None else r.alpha,
            r.session_tokens_per_s,
            median([float(s["tokens_per_s"]) for s in r.sessions]),
        ]
        for r in (target, dsd)
    ]
    ratio = _ratio(dsd.session_tokens_per_s, target.session_tokens_per_s)
    goal = Goal("single-session tokens/s, DSD / target-only", SINGLE_SESSION_GOAL, ratio)
    return (SINGLE_HEADERS, rows), goal


def throughput(
    results: Sequence[RunResult], levels: Sequence[int], drafter: str
) -> tuple[Table, list[Goal]]:
    rows: list[list[Any]] = []
    goals: list[Goal] = []
    for level in levels:
        target, dsd = _find(results, level, None), _find(results, level, drafter)
        ratio = _ratio(dsd.throughput, target.throughput)
        wanted = THROUGHPUT_GOALS.get(level)
        verdict = "-"
        if wanted is not None:
            goal = Goal(f"verifier throughput x{level}, DSD / target-only", wanted, ratio)
            goals.append(goal)
            verdict = f">= {wanted} {'met' if goal.met else 'NOT met'}"
        rows.append(
            [
                *(level, len(dsd.sessions), target.throughput, dsd.throughput, ratio, verdict),
                *(target.mean_batch, dsd.mean_batch, dsd.tokens / dsd.rounds),
            ]
        )
    return (THROUGHPUT_HEADERS, rows), goals


def overhead(results: Sequence[RunResult], drafter: str) -> tuple[Table, list[Goal]]:
    rows: list[list[Any]] = []
    for r in results:
        if not r.config.proactive:
            continue
        ms = r.summary()["ms"]
        rows.append(
            [
                *(r.config.label, len(r.timings), ms["wait"]["p50"], ms["verify"]["p50"]),
                *(ms["queue"]["p50"], ms["overhead"]["p50"], ms["overhead"]["p99"]),
                *(ms["agent_legs"]["p50"], ms["persist"]["p50"], ms["other_coordinator"]["p50"]),
                ms["verifier_leg"]["p50"],
                ms["turnaround"]["p50"],
            ]
        )
    goals: list[Goal] = []
    if any(r.config == RunConfig(1, drafter) for r in results):
        values = _find(results, 1, drafter).values(lambda t: t.overhead_ms)
        goals += [
            Goal("per-round overhead p50, DSD x1, ms", OVERHEAD_P50_GOAL_MS, median(values), True),
            Goal(
                "per-round overhead p99, DSD x1, ms",
                OVERHEAD_P99_GOAL_MS,
                percentile(values, 99),
                True,
            ),
        ]
    return (OVERHEAD_HEADERS, rows), goals


def proactive(
    results: Sequence[RunResult], levels: Sequence[int], drafters: Sequence[str]
) -> Table:
    rows: list[list[Any]] = []
    for drafter in drafters:
        for level in levels:
            rows.append(_proactive_row(results, level, drafter))
    return PROACTIVE_HEADERS, rows


def _proactive_row(results: Sequence[RunResult], level: int, drafter: str) -> list[Any]:
    on, off = _find(results, level, drafter), _find(results, level, drafter, proactive=False)
    on_s, off_s = on.summary(), off.summary()
    counts = (on_s["proactive_hits"], on_s["proactive_misses"], on_s["proactive_skipped"])
    return [
        *(drafter, level, on.throughput, off.throughput, _ratio(on.throughput, off.throughput)),
        *(on.session_tokens_per_s, off.session_tokens_per_s),
        "/".join(str(c) for c in counts),
        *(on_s["ms"]["turnaround"]["p50"], off_s["ms"]["turnaround"]["p50"]),
    ]


def identity_check(results: Sequence[RunResult]) -> tuple[int, list[str]]:
    """DSD answers compared with the target-only answer to the same prompt: (checked, differing)."""
    reference: dict[str, list[int]] = {}
    for result in results:
        if result.config.mode == "target":
            for s in result.sessions:
                reference.setdefault(s["prompt_id"], s["token_ids"])
    checked = 0
    differing: list[str] = []
    for result in results:
        if result.config.mode != "dsd":
            continue
        for s in result.sessions:
            expected = reference.get(s["prompt_id"])
            if expected is None:
                continue
            checked += 1
            if s["token_ids"] != expected:
                differing.append(f"{result.config.label}:{s['prompt_id']}")
    return checked, differing


def _print_table(title: str, table: Table) -> None:
    print(f"\n{title}")
    print(format_table(*table))


def report(run: BenchRun, args: argparse.Namespace) -> dict[str, Any]:
    """Print a table per part and the goals; return the JSON document."""
    results = run.results
    levels = list(args.sessions)
    k_text = f"k={args.k}" if args.k is not None else "its own k"
    print(
        f"\nbroker {run.broker}; database {run.database}; 1 verifier (threads=1); "
        f"{args.agents} agents; drafter {args.drafter} ({k_text}); greedy; "
        f"at most {args.max_tokens} tokens per session"
    )
    if args.broker is None:
        print(
            "private Mosquitto with set_tcp_nodelay true; the shared one on :1883 lacks "
            "TCP_NODELAY and adds ~40 ms per hop (see `specfleet bench bus`)"
        )
    elif f":{SHARED_BROKER_PORT}" in args.broker:
        print(
            "WARNING: the shared Mosquitto on :1883 lacks TCP_NODELAY and adds ~40 ms per hop; "
            "these figures include that"
        )
    print("target-only: the same fleet and verifier, k=0 drafts (one target token per round)")
    goals: list[Goal] = []
    if 1 in levels:
        table, goal = single_session(results, args.drafter)
        goals.append(goal)
        _print_table("1. single session (one at a time; configurations take turns)", table)
        print(f"DSD / target-only: {goal.measured:.2f}x (goal >= {goal.goal}x)")
    table, more = throughput(results, levels, args.drafter)
    goals += more
    _print_table(
        "2. verifier throughput, committed tokens/s (one verifier; waves of c sessions)", table
    )
    table, more = overhead(results, args.drafter)
    goals += more
    _print_table(
        "3. per-round time, ms; overhead = agent wait - verifier compute - verifier queue", table
    )
    unmatched = sum(r.unmatched_rounds for r in results)
    if unmatched:
        print(f"({unmatched} rounds had no coordinator record to match and are left out)")
    if args.proactive_sessions:
        table = proactive(results, args.proactive_sessions, args.proactive_drafters)
        _print_table("4. proactive drafting on vs off (turn: agent turnaround p50, ms)", table)

    checked, differing = identity_check(results)
    drafted_target_rounds = sum(r.drafted_rounds for r in results if r.config.mode == "target")
    differ_text = f" (differ: {', '.join(differing[:8])})" if differing else ""
    print(
        f"\ngreedy DSD answers equal to target-only: {checked - len(differing)}/{checked}"
        f"{differ_text}; target-only rounds that carried a draft: {drafted_target_rounds}"
    )
    print("goals")
    for goal in goals:
        print(f"  {goal.line()}")
    return {
        "benchmark": "e2e",
        "settings": {
            "drafter": args.drafter,
            "k": args.k,
            "max_tokens": args.max_tokens,
            "limit": args.limit,
            "sessions": levels,
            "proactive_sessions": list(args.proactive_sessions),
            "proactive_drafters": list(args.proactive_drafters),
            "agents": args.agents,
            "verifiers": 1,
            "verifier_threads": 1,
            "broker": run.broker,
            "private_mosquitto": args.broker is None,
            "database": run.database,
            "workdir": str(run.workdir),
        },
        "runs": [r.summary() for r in results],
        "goals": [
            {"goal": g.what, "target": g.goal, "measured": g.measured, "met": g.met} for g in goals
        ],
        "identity": {"checked": checked, "differing": differing},
        "target_only_rounds_with_a_draft": drafted_target_rounds,
        "target_only_sessions_held_at_k0": run.zero_window_sessions,
        "sessions": [{"run": r.config.label, **s} for r in results for s in r.sessions],
        "rounds": [
            {
                "run": r.config.label,
                "session_id": t.session_id,
                "round": t.round,
                "wait_ms": t.wait_ms,
                "handler_ms": t.handler_ms,
                "persist_ms": t.persist_ms,
                "puback_ms": t.puback_ms,
                "round_trip_ms": t.leg.round_trip_ms,
                "queue_ms": t.leg.queue_ms,
                "verify_ms": t.leg.verify_ms,
                "batch_size": t.leg.batch_size,
            }
            for r in results
            for t in r.timings
        ],
    }


@dataclass
class _QuietLoggers:
    """The in-process coordinator logs every session at INFO; the progress bars need quiet."""

    names: tuple[str, ...] = ("coordinator", "broker", "httpx", "verifier")
    saved: dict[str, int] = field(default_factory=dict)

    def __enter__(self) -> None:
        for name in self.names:
            logger = logging.getLogger(name)
            self.saved[name] = logger.level
            logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        for name, level in self.saved.items():
            logging.getLogger(name).setLevel(level)


def run(args: argparse.Namespace) -> int:
    from coordinator.settings import Settings
    from specfleet.cli import CommandError

    check_arguments(args)
    args.proactive_drafters = resolve_drafters(args, Settings().resolved_models_dir)
    try:
        prompts = interleave_tasks(read_prompts(args.prompts), args.limit)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read prompts: {exc}") from exc
    tasks = sorted({p.task for p in prompts})
    print(
        f"{len(prompts)} prompts ({', '.join(tasks)}); levels {list(args.sessions)}",
        file=sys.stderr,
    )
    with _QuietLoggers():
        bench_run = asyncio.run(run_bench(args, prompts))
    document = report(bench_run, args)
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    return 0
