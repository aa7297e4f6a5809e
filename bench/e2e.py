"""`specfleet bench e2e`: specfleet over a real bus against plain serving of the target alone.

One run starts a private Mosquitto with `set_tcp_nodelay true` (or uses --broker), SQLite in a
temporary home (or --database-url), the coordinator in this process, ONE verifier process
(threads=1, so all throughput figures are that verifier's) and --agents agent processes, and
drives greedy sessions through the agents' local APIs, as `specfleet demo` does. Beside them
runs the baseline's process. The arms, on the same prompts at every level:

- plain serving (`bench.plain_serving`), what a user would run instead of specfleet: the target,
  loaded as the verifier loads it (fp32, one ONNX Runtime thread), decodes every session of a
  wave itself, greedy and continuously batched, with no bus round trip per token, no database
  and no drafting. Its wave time is taken inside its process (first prefill to last token), so
  neither its load nor the pipe to it is counted.
- the fixed drafter: sessions opened with --drafter (and --k, or the drafter's own window),
  drafted by the device in distributed mode.
- adaptive: sessions opened with k=0 and no drafter, which leaves the mode (the device drafts,
  the verifier host drafts, or the host decodes alone), the drafter and k to the coordinator's
  adaptive policy.
- with --bus-target-only, also the old baseline: target-only decoding over the bus, one target
  token per round (the agent opens with k=0; as soon as the open is handled, the benchmark takes
  the session off the adaptive policy and fixes its window at 0 with `SessionBook.set_k`).

Every answer is compared, token for token, with plain serving's answer to the same prompt at the
lowest level run (the unit tests check that plain serving equals the target decoding alone).

1. Single session: level 1 runs one session at a time. A bus session's tokens/s is its generated
   tokens over its wall time from open to end (prefill included), as the agent reports it; plain
   serving's, over the time from the wave's start to its last token. The figure is
   sum(tokens) / sum(time) over the configuration's sessions.
2. Throughput at c concurrent sessions (c = --sessions): a level's work (max(--limit, c) sessions,
   rounded up to a multiple of c) runs in waves of c sessions started together, session i of a
   wave on agent i mod --agents. Committed tokens/s is every generated token over the sum of the
   configuration's wave times (first open to last end); the one verifier (or the plain-serving
   process) batches across the sessions. With `--arrivals steady` the level's work runs in two
   halves instead, each with c sessions open at all times (the next prompt starts as a session
   ends), so that no wave waits for its slowest session. The goals: adaptive / plain serving
   >= 1.0 at every level, >= 1.5 at 1 session and >= 1.2 at 4. In every level the
   configurations take turns wave by wave, in an order reversed every other wave, so that the
   host's drifting load falls on all of them alike (on the shared 2-core host this was written
   on, the target's compute time per round differed by up to 1.5x between runs minutes apart).
3. Per-round overhead beyond model compute, for every round the device drafted: the agent's wait
   (draft handed to the bus until its verdict is in the session's inbox) minus the verifier's
   compute (`verify_batch` in its inference process) and its queue (request received until its
   batch goes to the inference process: the batching window plus any wait behind other
   batches). Probes in the in-process coordinator (its Draft handler, `VerifierPool.verify`, the
   round writer and the book's publish function, wrapped) split the rest into: the
   agent<->coordinator legs (wait - handler, where the handler's time ends as the verdict's
   publish begins: the draft up, the verdict down, both agents' and the coordinator's dispatch),
   the persistence of the round (its group commit), the rest of the coordinator's work
   (validation, the verify request, stop rules, building the verdict) and the
   coordinator<->verifier leg (round trip - queue - compute: two broker hops, JSON both ways, the
   pipe to the inference process and back). Each term is a difference of durations measured
   inside one process; no clocks are compared across processes. Rounds the host ran by itself
   (streamed, with no Draft handler call) have no such record; they are left out and counted.
   The goals (p50 <= 2 ms, aiming at 1 ms; p99 <= 10 ms) are judged on the fixed drafter's
   single-session rounds.
4. Proactive drafting, when --proactive-sessions names levels: --proactive-drafters (by default
   --drafter, plus a neural drafter where one is installed, since copying drafters cost too
   little for drafting ahead to hide anything) run there with proactive drafting on and off (the
   local API's per-session switch).
5. The modes the adaptive arm's rounds ran in, per level, counted from the database's rounds.
6. The target's use: its share of the run's wall time, and its passes' shape.
7. The CPU time of the benchmark's processes over each configuration's waves, by role, per
   committed token (/proc, user and system): this process (the coordinator, and the load
   generator reading every token's event), the verifier's bus side, the agents, the broker and
   the rest, and the target's own process. On one host all but the target share the other CPUs,
   and a busy neighbour slows the target's passes (`bench co-runner`): what the stack burns
   beside the target is what the bus arms pay that plain serving does not.

The default run (10 prompts, 48 tokens, levels 1/4/16/32) takes several minutes on a busy 2-core
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from core.report import add_json_argument, format_table, median, percentile, write_json
from localfleet.prompts import BenchPrompt, read_prompts

if TYPE_CHECKING:
    from bench.plain_serving import PlainServer
    from broker import messages as m
    from coordinator.db.models import Round, SessionStatus
    from coordinator.db.round_writer import RoundRecord
    from coordinator.runtime.service import Coordinator
    from localfleet.fleet import LocalFleet

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
DEFAULT_JSON = Path("bench-results/e2e.json")
SHARED_BROKER_PORT = 1883
LEVELS = (1, 4, 16, 32)
# Waves of each configuration at least, per level: a level of 16 or 32 sessions was one wave
# each, and the same code's ratio moved by 5-10% between runs on a quiet host.
WAVES = 3
AGENT_NICENESS = 10  # the device processes yield the shared CPUs to the cloud side
# Copying drafters cost next to nothing, so drafting ahead has little to hide with them; part 4
# also runs this neural one by default where it is installed.
NEURAL_PROACTIVE_DRAFTER = "hybrid+draft-l1"
SESSIONS_PER_AGENT = 8  # concurrent sessions one agent is asked to run at most
SESSION_TIMEOUT_S = 600.0
WARMUP_TOKENS = 8
# Goals of the issue, all against plain serving: adaptive never slower at any level, and faster
# where the verifier has compute to spare for drafted tokens; the overhead budget per round.
ADAPTIVE_FLOOR = 1.0
ADAPTIVE_GOALS = {1: 1.5, 4: 1.2}
OVERHEAD_P50_GOAL_MS = 2.0
OVERHEAD_P50_AIM_MS = 1.0
OVERHEAD_P99_GOAL_MS = 10.0

Arm = Literal["plain", "target", "fixed", "adaptive"]
# Modes in the order the report lists them; any other value a round holds comes after.
MODE_ORDER = ("distributed", "cloud", "plain", "local")


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
        help="drafter of the fixed-drafter arm, and the agents' default: lookup, ngram, hybrid, "
        "a draft, hybrid+DRAFT (default: hybrid)",
    )
    parser.add_argument(
        "--k", type=int, default=None, help="fixed-drafter window (default: the drafter's own)"
    )
    parser.add_argument(
        "--sessions",
        type=int,
        nargs="+",
        default=list(LEVELS),
        metavar="N",
        help="concurrent sessions per level (default: 1 4 16 32)",
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=WAVES,
        metavar="N",
        help="waves of each configuration at least, per level, the configurations taking turns "
        f"(default: {WAVES}; one wave of 16 or 32 sessions moved the ratio by 5-10%% between "
        "runs of the same code)",
    )
    parser.add_argument(
        "--arrivals",
        choices=("waves", "steady"),
        default="waves",
        help="waves (default): a level's sessions start c at a time, the next c when the last "
        "of them ends; steady: c sessions open at all times, the next starting as one ends (a "
        "server under sustained load, where no wave waits for its slowest session)",
    )
    parser.add_argument(
        "--shared-cpus",
        action="store_true",
        help="let every process run on every CPU; by default the targets (the verifier's "
        "inference process, plain serving) get the last CPU to themselves and everything else "
        "the others, as devices and the control plane are other machines in the field",
    )
    parser.add_argument(
        "--stream-clients",
        action="store_true",
        help="the load generator reads each session's text as it streams (an event per committed "
        'piece); by default it asks for whole answers (`"stream": false`), as plain serving '
        "hands them back",
    )
    parser.add_argument(
        "--bus-target-only",
        action="store_true",
        help="also run target-only decoding over the bus (k=0 drafts), the old baseline",
    )
    parser.add_argument(
        "--proactive-sessions",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="levels also run with proactive drafting off (part 4; default: none)",
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
    parser.add_argument(
        "--pass-trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write DIR/verifier.jsonl (a line per forward pass of the verifier's target: "
        "`verifier --pass-trace`) and DIR/waves.jsonl (a line per wave: its run, start and end "
        "on the same monotonic clock)",
    )
    add_json_argument(parser, DEFAULT_JSON)


# -- plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """One measured configuration: an arm at a number of concurrent sessions."""

    sessions: int  # concurrent clients
    arm: Arm
    drafter: str | None = None  # the fixed arm's
    proactive: bool = True

    @property
    def on_bus(self) -> bool:
        return self.arm != "plain"

    @property
    def label(self) -> str:
        if self.arm == "plain":
            return f"plain serving x{self.sessions}"
        if self.arm == "target":
            return f"bus target-only x{self.sessions}"
        if self.arm == "adaptive":
            return f"adaptive x{self.sessions}"
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


def level_work(prompts: Sequence[BenchPrompt], sessions: int, waves: int = 1) -> list[BenchPrompt]:
    """max(len(prompts), sessions x waves) sessions rounded up to a multiple of `sessions`,
    cycling through the prompts: every prompt once, and at least `waves` waves."""
    count = math.ceil(max(len(prompts), sessions * waves) / sessions) * sessions
    return [prompts[i % len(prompts)] for i in range(count)]


def plan(
    levels: Sequence[int],
    drafter: str,
    proactive_levels: Sequence[int],
    proactive_drafters: Sequence[str],
    bus_target_only: bool = False,
) -> list[list[RunConfig]]:
    """Each level's configurations: plain, (bus target-only), fixed, adaptive, part 4."""
    plans: list[list[RunConfig]] = []
    for level in levels:
        configs = [RunConfig(level, "plain")]
        if bus_target_only:
            configs.append(RunConfig(level, "target"))
        configs += [RunConfig(level, "fixed", drafter), RunConfig(level, "adaptive")]
        if level in proactive_levels:
            for name in proactive_drafters:
                if name != drafter:
                    configs.append(RunConfig(level, "fixed", name))
                configs.append(RunConfig(level, "fixed", name, proactive=False))
        plans.append(configs)
    return plans


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments with a one-line reason, before anything starts."""
    from core.errors import CommandError

    if args.limit < 1:
        raise CommandError(f"--limit must be >= 1, got {args.limit}")
    if not 2 <= args.max_tokens <= 8192:
        raise CommandError(f"--max-tokens must be in 2..8192, got {args.max_tokens}")
    if args.k is not None and not 1 <= args.k <= 64:
        raise CommandError(f"--k must be in 1..64, got {args.k}")
    if not 1 <= args.waves <= 20:
        raise CommandError(f"--waves must be in 1..20, got {args.waves}")
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
    if args.proactive_drafters is not None and not args.proactive_sessions:
        raise CommandError("--proactive-drafters needs --proactive-sessions (part 4's levels)")
    if args.broker is not None and not args.broker.startswith(("mqtt://", "mqtts://")):
        raise CommandError(f"--broker must be an mqtt:// or mqtts:// URL, got {args.broker!r}")
    if not args.prompts.is_file():
        raise CommandError(f"no prompts file {args.prompts}")
    if args.pass_trace is not None:
        try:
            args.pass_trace.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"--pass-trace {args.pass_trace}: {exc.strerror or exc}") from None


def resolve_drafters(args: argparse.Namespace, models_dir: Path) -> list[str]:
    """Check the drafters named; return those of part 4 (none when part 4 does not run)."""
    from core.errors import CommandError
    from inference.drafters import drafter_names

    known = drafter_names(models_dir)
    named = args.proactive_drafters
    if named is None:
        named = [args.drafter]
        if NEURAL_PROACTIVE_DRAFTER in known and args.drafter != NEURAL_PROACTIVE_DRAFTER:
            named.append(NEURAL_PROACTIVE_DRAFTER)
    for name in [args.drafter, *named]:
        if name not in known:
            raise CommandError(f"unknown drafter {name!r}; known: {', '.join(known)}")
    return list(dict.fromkeys(named)) if args.proactive_sessions else []


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
    # A direct round's own legs, from its RoundDone (NaN for a relayed round, or a verifier that
    # does not report them): the pipe to the inference process and back beyond the pass, the
    # group commit, building and encoding the verdict, and the draft's arrival at the verifier
    # until its verdict was queued for the bus.
    pipe_ms: float = float("nan")
    persist_ms: float = float("nan")
    encode_ms: float = float("nan")
    held_ms: float = float("nan")


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

    # -- a direct round's legs (NaN for a relayed round) --

    @property
    def bus_agent_ms(self) -> float:
        """The agent's wait outside the verifier: the draft up and the verdict down through the
        broker, the verifier's receive and publish tasks, both ends' dispatch."""
        return self.wait_ms - self.leg.held_ms

    @property
    def verifier_rest_ms(self) -> float:
        """The verifier's time on the round beyond the legs it times: decoding the draft, the
        hand-offs between its tasks, the checks and the stop rules."""
        leg = self.leg
        return (
            leg.held_ms
            - leg.queue_ms
            - leg.verify_ms
            - leg.pipe_ms
            - leg.persist_ms
            - (leg.encode_ms)
        )


RoundKey = tuple[str, int]  # (session id, round)


class CoordinatorProbes:
    """Wraps parts of the in-process coordinator to time each round where it spends it.

    Wrapped: the Draft handler, `VerifierPool.verify` and `VerifierPool.stream`, and the book's
    round writer and publish function; each wrapper adds two perf_counter reads and a dict store
    per round. The writer and publish function are private attributes of the `SessionBook`:
    there is no public handle on persistence or on the moment a verdict leaves. A stream's
    rounds give only their batch sizes: no Draft handler runs for them. With `hold_zero_window`
    (the bus target-only arm) the SessionOpen handler is wrapped too, to fix at 0 the window of
    the sessions opened with k=0 while `holding_zero_window` is set.
    """

    def __init__(self, coordinator: Coordinator, hold_zero_window: bool = False) -> None:
        from broker import messages as m

        self.handler_ms: dict[RoundKey, float] = {}
        self.puback_ms: dict[RoundKey, float] = {}
        self.legs: dict[RoundKey, VerifierLeg] = {}
        self.persist_ms: dict[RoundKey, float] = {}
        # Direct rounds (a verifier held the session's lease): their verifier legs, reported.
        self.direct: dict[RoundKey, VerifierLeg] = {}
        # Per session: the size of the verifier's batch in each of its rounds, streamed or not.
        self.batch_sizes: defaultdict[str, list[int]] = defaultdict(list)
        self.zero_window_sessions: set[str] = set()
        self.holding_zero_window = False  # set while bus target-only sessions are opened
        # The round whose Draft handler runs in this task; its last publish is the verdict.
        current: ContextVar[tuple[RoundKey, list[float]] | None] = ContextVar(
            "bench_e2e_round", default=None
        )
        book = coordinator.book
        pool = coordinator.verifiers
        self.pool = pool
        handle_draft = coordinator.device_handlers[m.Draft]
        handle_open = coordinator.device_handlers[m.SessionOpen]
        pool_verify = pool.verify
        pool_stream = pool.stream
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
            self.batch_sizes[request.session_id].append(result.batch_size)
            return result

        async def counted_stream(request: m.VerifyRequest) -> AsyncGenerator[m.VerifyResult, None]:
            # aclosing: a caller that leaves the stream early must stop it on the verifier now,
            # not whenever the inner generator is collected.
            async with contextlib.aclosing(pool_stream(request)) as results:
                async for result in results:
                    self.batch_sizes[request.session_id].append(result.batch_size)
                    yield result

        async def timed_write(
            row: Round | RoundRecord, generated: list[int], status: SessionStatus, **details: Any
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
            # A cloud request's handler runs the host stream and publishes every round of it:
            # its last publish is not this round's verdict, so it gives no split.
            if key in self.legs and key not in self.handler_ms and publishes and not draft.cloud:
                self.handler_ms[key] = (publishes[-1] - started) * 1e3
                self.puback_ms[key] = (ended - publishes[-1]) * 1e3

        async def open_keeping_zero_window(device_id: str, request: m.SessionOpen) -> None:
            await handle_open(device_id, request)
            live = book.live.get(request.session_id)
            if self.holding_zero_window and request.k == 0 and live is not None:
                live.policy_task = None  # no adaptive policy: the window stays fixed, at 0
                book.set_k(request.session_id, 0)
                self.zero_window_sessions.add(request.session_id)

        round_done = coordinator.verifier_handlers[m.RoundDone]

        async def recorded_round_done(verifier_id: str, done: m.RoundDone) -> None:
            # A direct round: the verifier answered the device; only its legs are known here.
            nan = float("nan")
            key = (done.session_id, done.round)
            self.direct[key] = VerifierLeg(
                nan,
                done.t_queue_ms,
                done.t_verify_ms,
                done.batch_size,
                *(nan if v is None else v for v in (done.t_pipe_ms, done.t_persist_ms)),
                *(nan if v is None else v for v in (done.t_encode_ms, done.t_held_ms)),
            )
            self.batch_sizes[done.session_id].append(done.batch_size)
            await round_done(verifier_id, done)

        coordinator.verifier_handlers[m.RoundDone] = recorded_round_done
        pool.verify = timed_verify  # type: ignore[method-assign]
        pool.stream = counted_stream  # type: ignore[method-assign]
        writer.write = timed_write  # type: ignore[method-assign]
        book._publish = timed_publish
        coordinator.device_handlers[m.Draft] = timed_draft
        if hold_zero_window:
            coordinator.device_handlers[m.SessionOpen] = open_keeping_zero_window

    def timings(self, session_id: str, wait_ms: Sequence[float]) -> tuple[list[RoundTiming], int]:
        """The rounds of a session matched with the agent's waits; and how many did not match.

        A direct round (answered by the verifier holding the session's lease) has only its
        verifier legs, from its report: its wait splits into compute, queue and the rest. A round
        without a record (one the host ran by itself in a stream) is left out and counted.
        """
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
            elif key in self.direct:
                nan = float("nan")
                matched.append(
                    RoundTiming(session_id, index, wait, nan, nan, nan, self.direct[key])
                )
            else:
                missing += 1
        return matched, missing


# -- running sessions -------------------------------------------------------------------------


TARGET_COUNTERS = ("passes", "busy_s", "rows", "positions")
STATUS_WAIT_S = 3.0  # a heartbeat comes every second; past this the counters are left out


@dataclass
class TargetUse:
    """What the target did in a run: its passes, the seconds it computed, and their rows and
    positions (padding included). Busy over the run's wall time is how much of the verifier's
    compute the fleet kept in use; plain serving keeps it near 1."""

    passes: int = 0
    busy_s: float = 0.0
    rows: int = 0
    positions: int = 0
    missing: int = 0  # waves whose counters no heartbeat gave

    def add(self, before: dict[str, float] | None, after: dict[str, float] | None) -> None:
        if before is None or after is None:
            self.missing += 1
            return
        self.passes += int(after["passes"] - before["passes"])
        self.busy_s += after["busy_s"] - before["busy_s"]
        self.rows += int(after["rows"] - before["rows"])
        self.positions += int(after["positions"] - before["positions"])

    def document(self, wall_s: float) -> dict[str, float | int]:
        return {
            "passes": self.passes,
            "busy_s": self.busy_s,
            "busy": self.busy_s / wall_s if wall_s > 0 else float("nan"),
            "rows_per_pass": self.rows / self.passes if self.passes else float("nan"),
            "positions_per_row": self.positions / self.rows if self.rows else float("nan"),
            "waves_missing": self.missing,
        }


async def target_counters(pool: Any, since: float) -> dict[str, float] | None:
    """The verifiers' target counters, summed, from heartbeats sent after `since` (time.time()):
    taken between waves, when no pass runs, they are exact."""
    deadline = time.monotonic() + STATUS_WAIT_S
    while time.monotonic() < deadline:
        statuses = [info.status for info in pool.live()]
        if statuses and all(status.at > since for status in statuses):
            return {
                name: sum(float(getattr(status, name)) for status in statuses)
                for name in TARGET_COUNTERS
            }
        await asyncio.sleep(0.05)
    return None


@dataclass
class RunResult:
    config: RunConfig
    wall_s: float
    # Per session: the agent's summary (bus arms) or plain serving's answer, with prompt_id,
    # task, token_ids, tokens, rounds (target passes) and elapsed_s in every one.
    sessions: list[dict[str, Any]]
    timings: list[RoundTiming] = field(default_factory=list)
    unmatched_rounds: int = 0
    # Per verify round (bus arms) or batched decode pass (plain serving): its sessions.
    batch_sizes: list[int] = field(default_factory=list)
    round_modes: dict[str, int] = field(default_factory=dict)  # bus arms: rounds by mode
    pass_ms: list[float] = field(default_factory=list)  # plain serving: each decode pass's time
    # Bus arms: the verifier's target over the run's waves (TargetUse); plain serving: its passes.
    target: TargetUse = field(default_factory=lambda: TargetUse())
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over its waves, by role

    def add_cpu(self, before: dict[str, float], after: dict[str, float]) -> None:
        for role, seconds in after.items():
            self.cpu_s[role] = self.cpu_s.get(role, 0.0) + seconds - before.get(role, 0.0)

    @property
    def cpu_ms_per_token(self) -> dict[str, float]:
        """CPU_ROLES' CPU time per committed token, and `beside` (all but the target's)."""
        if not self.tokens:
            return {}
        per = {role: 1e3 * self.cpu_s.get(role, 0.0) / self.tokens for role in CPU_ROLES}
        return per | {"beside": sum(v for role, v in per.items() if role != "target")}

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
        if not self.config.on_bus:
            return None
        drafted = sum(sum(s["drafted"]) for s in self.sessions)
        accepted = sum(sum(s["accepted"]) for s in self.sessions)
        return accepted / drafted if drafted else None

    @property
    def drafted_rounds(self) -> int:
        if not self.config.on_bus:
            return 0
        return sum(1 for s in self.sessions for d in s["drafted"] if d)

    @property
    def mean_batch(self) -> float:
        sizes = self.batch_sizes
        return sum(sizes) / len(sizes) if sizes else float("nan")

    def values(self, what: Callable[[RoundTiming], float]) -> list[float]:
        """One value per matched round; a part not measured for a round (NaN: a direct round
        has no coordinator handler) is left out."""
        return [v for v in (what(t) for t in self.timings) if not math.isnan(v)]

    def summary(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "arm": self.config.arm,
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
            "mean_batch": self.mean_batch,
            "target": self.target.document(self.wall_s),
            "cpu_ms_per_token": self.cpu_ms_per_token,
        }
        if self.config.on_bus:
            document |= self._bus_summary()
        else:  # what `sim validate` replays plain serving's waves with
            document |= {"batch_sizes": self.batch_sizes, "pass_ms": self.pass_ms}
        return document

    def _bus_summary(self) -> dict[str, Any]:
        def stats(what: Callable[[RoundTiming], float]) -> dict[str, float]:
            values = self.values(what)
            return {"p50": median(values), "p99": percentile(values, 99)}

        turnaround = [ms for s in self.sessions for ms in s["turnaround_ms"]]
        return {
            "alpha": self.alpha,
            "drafted_rounds": self.drafted_rounds,
            "round_modes": self.round_modes,
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
                # Direct rounds: the legs the verifier reports, and the agent's wait outside it.
                "direct": {
                    "bus_agent": stats(lambda t: t.bus_agent_ms),
                    "held": stats(lambda t: t.leg.held_ms),
                    "pipe": stats(lambda t: t.leg.pipe_ms),
                    "persist": stats(lambda t: t.leg.persist_ms),
                    "verdict": stats(lambda t: t.leg.encode_ms),
                    "verifier_rest": stats(lambda t: t.verifier_rest_ms),
                },
                "turnaround": {"p50": median(turnaround), "p99": percentile(turnaround, 99)},
            },
        }


def session_request(
    prompt: BenchPrompt, config: RunConfig, args: argparse.Namespace, max_tokens: int
) -> dict[str, Any]:
    """The local API's body for a bus arm's session."""
    request: dict[str, Any] = {
        "prompt": prompt.prompt,
        "task_type": prompt.task,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "proactive": config.proactive,
    }
    if config.arm == "target":
        request |= {"draft": "lookup", "k": 0}  # k=0, held there: nothing is ever proposed
    elif config.arm == "adaptive":
        request["k"] = 0  # no drafter either: mode, drafter and k are the coordinator's choice
    else:
        request["draft"] = config.drafter
        if args.k is not None:
            request["k"] = args.k
    return request


async def ask_one(
    port: int,
    request: dict[str, Any],
    label: str,
    timeout_s: float = SESSION_TIMEOUT_S,
    *,
    stream: bool = False,
) -> dict[str, Any]:
    """One session through an agent's local API; an error unless it finished.

    By default the client asks for the whole answer (`"stream": false`): the summary comes in
    one reply when the session ends, as plain serving hands back whole answers. With `stream`,
    it reads the session's events as they come, a line per committed piece of text. Either way
    through the agent's own client (asyncio streams), not httpx: the benchmark's coordinator
    shares this process's loop and CPU with this load generator (through httpx a wave's 16
    requests went out 17-30 ms into it, holding the opens back). On a device the client is the
    device's app, on the device's own CPU; here it is on the coordinator's, and a streaming
    one reads every token's event of every session (768 a wave of 16)."""
    from device_agent.local_api import HOST, ApiError, stream_session, whole_session

    async def answer() -> dict[str, Any]:
        if not stream:
            return await whole_session(HOST, port, request, timeout_s)
        async for event in stream_session(HOST, port, request):
            if event.event == "done":
                return event.data
            if event.event == "error":
                raise RuntimeError(f"{label}: {event.data}")
        raise RuntimeError(f"{label}: the agent's stream ended without an answer")

    try:
        summary = await asyncio.wait_for(answer(), timeout_s)
    except ApiError as exc:
        raise RuntimeError(f"{label}: agent refused the session: {exc.reason}") from None
    if summary.get("status") != "finished":
        raise RuntimeError(f"{label}: session ended {summary.get('status')}: {summary}")
    return summary


@dataclass(frozen=True)
class PlainArm:
    """The plain-serving process and what its waves need: the prompts as the agents encode them."""

    server: PlainServer
    prompt_ids: dict[str, list[int]]  # by prompt id: the chat template applied, as agents do
    eos_id: int

    async def wave(
        self, prompts: Sequence[BenchPrompt], max_tokens: int, concurrency: int | None = None
    ) -> tuple[list[dict[str, Any]], float, list[int], list[float]]:
        """One wave (with `concurrency`, at most that many sessions open at a time): each
        session's answer, the wave's time, the batch of each decode pass and each decode pass's
        time (ms)."""
        ids = [self.prompt_ids[p.id] for p in prompts]
        # In a thread: the coordinator in this loop must keep up with the fleet meanwhile.
        served = await asyncio.to_thread(
            self.server.serve, ids, max_tokens, self.eos_id, concurrency=concurrency
        )
        sessions = [
            {
                "prompt_id": prompt.id,
                "task": prompt.task,
                "token_ids": tokens,
                "tokens": len(tokens),
                "rounds": passes,
                "elapsed_s": elapsed,
                "tokens_per_s": len(tokens) / elapsed if elapsed > 0 else None,
                # What `sim calibrate` prices plain serving's prefills with.
                "prompt_len": len(prompt_ids),  # as the agents report it
                "prefill_ms": prefill_ms,
            }
            for prompt, prompt_ids, tokens, passes, elapsed, prefill_ms in zip(
                prompts,
                ids,
                served.token_ids,
                served.passes,
                served.elapsed_s,
                served.prefill_ms,
                strict=True,
            )
        ]
        return sessions, served.wall_s, served.batch_sizes, served.pass_ms


@dataclass
class WaveRunner:
    """What every wave needs: the fleet, the probes, the plain-serving arm, the arguments."""

    fleet: LocalFleet
    probes: CoordinatorProbes
    plain: PlainArm
    args: argparse.Namespace

    def trace_wave(
        self,
        run: str,
        number: int,
        sessions: int,
        started: float,
        ended: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        """A line in the pass trace's waves.jsonl (with --pass-trace): a wave that ended, its
        start and end as its wall time counts them (plain serving's: its own wall time, ending
        now), and what plain serving's target computed in it."""
        directory = self.args.pass_trace
        if directory is None:
            return
        line = {
            "run": run,
            "wave": number,
            "sessions": sessions,
            "start": round(started, 6),
            "end": round(ended, 6),
            **(extra or {}),
        }
        with (directory / "waves.jsonl").open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    def processes_by_role(self) -> dict[str, list[int]]:
        """The benchmark's processes by role (CPU_ROLES): the targets are the verifiers'
        inference processes and plain serving's process. Found by walking /proc, which costs
        milliseconds: done before a wave, never between its two readings (a process started
        during the wave, such as a drafter's runtime, counts from the next wave on)."""
        from bench.cpus import descendants

        verifiers = [child.pid for child in self.fleet.verifiers.values()]
        targets = [pid for parent in verifiers for pid in descendants(parent)[1:]]
        if self.plain.server.pid is not None:
            targets += descendants(self.plain.server.pid)
        agents = [pid for agent in self.fleet.agents.values() for pid in descendants(agent.pid)]
        known = {os.getpid(), *verifiers, *targets, *agents}
        return {
            "coordinator": [os.getpid()],
            "verifier": verifiers,
            "agents": agents,
            "other": [p for p in descendants(os.getpid()) if p not in known],
            "target": targets,
        }

    @contextlib.contextmanager
    def cpu_of(self, result: RunResult) -> Iterator[None]:
        """What the benchmark's processes burn within the block, by role, added to `result`:
        their processes found before it, their stat files read on each side of it."""
        from bench.cpus import cpu_by_role

        processes = self.processes_by_role()
        before = cpu_by_role(processes)
        yield
        result.add_cpu(before, cpu_by_role(processes))

    async def bus_wave(
        self,
        config: RunConfig,
        prompts: Sequence[BenchPrompt],
        on_done: Callable[[], None],
        concurrency: int | None = None,
    ) -> list[dict[str, Any]]:
        """Every session of a wave at once (with `concurrency`, at most that many open at a
        time, the next starting as one ends), session i on agent i mod the agents."""
        devices = list(self.fleet.agent_ports)
        slots = asyncio.Semaphore(concurrency or len(prompts))

        async def one(index: int, prompt: BenchPrompt) -> dict[str, Any]:
            device_id = devices[index % len(devices)]
            request = session_request(prompt, config, self.args, self.args.max_tokens)
            label = f"{config.label} {device_id} {prompt.id}"
            port = self.fleet.agent_ports[device_id]
            async with slots:
                summary = await ask_one(port, request, label, stream=self.args.stream_clients)
            on_done()
            return {**summary, "prompt_id": prompt.id, "task": prompt.task, "device_id": device_id}

        self.probes.holding_zero_window = config.arm == "target"
        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            self.probes.holding_zero_window = False


async def run_level(
    runner: WaveRunner, configs: list[RunConfig], work: list[BenchPrompt], steady: bool = False
) -> list[RunResult]:
    """One level in waves of c sessions at once, the configurations taking turns wave by wave.

    The order of the configurations is reversed every other wave, so that the host's load,
    which drifts over minutes on a shared machine, falls on every configuration alike. A
    configuration's wall time is the sum of its own waves' times, first open to last end, as if
    it had run alone. `steady`: the work in two halves instead (one where it is under 2c
    sessions), each run with c sessions open at all times, the next starting as one ends.
    """
    from tqdm import tqdm

    c = configs[0].sessions
    results = {config: RunResult(config, 0.0, []) for config in configs}
    if steady:
        half = len(work) // 2 if len(work) >= 2 * c else len(work)
        waves = [work[:half], work[half:]] if half < len(work) else [work]
    else:
        waves = [work[i : i + c] for i in range(0, len(work), c)]
    concurrency = c if steady else None
    desc = f"x{c}: {len(configs)} runs in turns"
    with tqdm(total=len(work) * len(configs), desc=desc, unit="session", file=sys.stderr) as bar:
        for number, wave in enumerate(waves):
            for config in configs if number % 2 == 0 else configs[::-1]:
                result = results[config]
                if config.on_bus:
                    before = await target_counters(runner.probes.pool, time.time())
                    with runner.cpu_of(result):  # the wave's, not the counters' wait
                        started = time.perf_counter()
                        result.sessions += await runner.bus_wave(
                            config, wave, lambda: bar.update(1), concurrency
                        )
                        ended = time.perf_counter()
                    result.wall_s += ended - started
                    runner.trace_wave(config.label, number, len(wave), started, ended)
                    after = await target_counters(runner.probes.pool, time.time())
                    result.target.add(before, after)
                else:
                    with runner.cpu_of(result):
                        sessions, wall_s, batch_sizes, pass_ms = await runner.plain.wave(
                            wave, runner.args.max_tokens, concurrency
                        )
                    prefill_ms = sum(session["prefill_ms"] for session in sessions)
                    now = time.perf_counter()
                    runner.trace_wave(
                        config.label,
                        number,
                        len(wave),
                        now - wall_s,
                        now,
                        {
                            "decode_passes": len(pass_ms),
                            "decode_ms": sum(pass_ms),
                            "prefill_ms": prefill_ms,
                        },
                    )
                    result.sessions += sessions
                    result.wall_s += wall_s
                    result.batch_sizes += batch_sizes
                    result.pass_ms += pass_ms
                    result.target.passes += len(pass_ms)
                    result.target.busy_s += sum(pass_ms) / 1e3
                    result.target.rows += sum(batch_sizes)
                    result.target.positions += sum(batch_sizes)
                    bar.update(len(wave))
    for result in results.values():
        if result.config.on_bus:
            _with_probes(result, runner.probes)
    return list(results.values())


def _with_probes(result: RunResult, probes: CoordinatorProbes) -> None:
    for summary in result.sessions:
        matched, missing = probes.timings(summary["session_id"], summary["wait_ms"])
        result.timings += matched
        result.unmatched_rounds += missing
        result.batch_sizes += probes.batch_sizes.get(summary["session_id"], [])


async def count_round_modes(coordinator: Coordinator, results: Sequence[RunResult]) -> None:
    """Each bus run's rounds by the mode the database recorded for them."""
    import sqlalchemy as sa

    from coordinator.db.models import Round

    def count(session_ids: list[str]) -> dict[str, int]:
        # Read as the stored string, so that a mode this checkout's enum lacks still counts.
        mode = sa.type_coerce(Round.mode, sa.String)
        query = (
            sa.select(mode, sa.func.count())
            .where(Round.session_id.in_([uuid.UUID(s) for s in session_ids]))
            .group_by(mode)
        )
        with coordinator.sessions() as db:
            return {str(name): int(n) for name, n in db.execute(query).all()}

    for result in results:
        if result.config.on_bus:
            ids = [str(s["session_id"]) for s in result.sessions]
            result.round_modes = await asyncio.to_thread(count, ids)


async def warm_up(runner: WaveRunner, prompt: BenchPrompt, configs: Sequence[RunConfig]) -> None:
    """A short session per bus configuration on every agent, and a short plain-serving wave as
    wide as the widest level: drafters loaded, the targets warm. Bus target-only sessions go
    last, on their own, as the probes hold their window at 0 only while no other session opens.
    """
    await runner.plain.wave([prompt] * max(c.sessions for c in configs), WARMUP_TOKENS)
    firsts = dict.fromkeys(RunConfig(1, c.arm, c.drafter) for c in configs if c.on_bus)
    for holding in (False, True):
        jobs: list[Awaitable[dict[str, Any]]] = []
        runner.probes.holding_zero_window = holding
        for config in firsts:
            if (config.arm == "target") != holding:
                continue
            for device_id, port in runner.fleet.agent_ports.items():
                request = session_request(prompt, config, runner.args, WARMUP_TOKENS)
                jobs.append(ask_one(port, request, f"warm-up {device_id} {config.label}"))
        await asyncio.gather(*jobs)
    runner.probes.holding_zero_window = False


@dataclass
class BenchRun:
    results: list[RunResult]
    broker: str
    database: str
    workdir: Path
    zero_window_sessions: int
    plain_load_s: float
    placement: str = "every process on every CPU"


async def run_bench(args: argparse.Namespace, prompts: list[BenchPrompt]) -> BenchRun:
    from bench.plain_serving import PlainServer
    from broker.mosquitto import PrivateMosquitto
    from core.settings import Settings
    from inference.tokenizer import ChatTokenizer
    from localfleet.fleet import AgentSpec, local_fleet
    from modelbuild.distill import ensure_drafts
    from modelbuild.head_build import ensure_heads
    from modelbuild.target_build import ensure_target

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
    # The shipped drafts and heads (built once from the committed weights, then cached): the
    # verifier host drafts cloud rounds with what its models directory holds, and without them
    # the adaptive arm would be rated on the copying drafters alone.
    for ensure in (ensure_drafts, ensure_heads):
        await asyncio.to_thread(ensure, settings.resolved_models_dir, target_dir)
    tokenizer = ChatTokenizer.load(target_dir)
    prompt_ids = {p.id: tokenizer.apply_chat_template(p.prompt) for p in prompts}
    neural = any(is_neural(name) for name in [args.drafter, *args.proactive_drafters])
    runtime = "onnx" if neural else "none"
    agents = [
        AgentSpec(f"bench-agent-{i + 1}", "other", args.drafter, runtime)
        for i in range(args.agents)
    ]
    plans = plan(
        args.sessions,
        args.drafter,
        args.proactive_sessions,
        args.proactive_drafters,
        args.bus_target_only,
    )
    results: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        print("loading the target for plain serving", file=sys.stderr, flush=True)
        server = stack.enter_context(PlainServer(settings.resolved_models_dir))
        plain = PlainArm(server, prompt_ids, tokenizer.eos_id)
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
            verifier_flags=_trace_flags(args.pass_trace),
        ) as fleet:
            placement = _place(fleet, server, shared=args.shared_cpus)
            probes = CoordinatorProbes(fleet.coordinator, hold_zero_window=args.bus_target_only)
            runner = WaveRunner(fleet, probes, plain, args)
            await warm_up(runner, prompts[0], [c for configs in plans for c in configs])
            for configs in plans:
                work = level_work(prompts, configs[0].sessions, args.waves)
                results += await run_level(runner, configs, work, steady=args.arrivals == "steady")
            await count_round_modes(fleet.coordinator, results)
            zero = len(probes.zero_window_sessions)
        load_s = server.load_s or float("nan")
    return BenchRun(results, broker_url, settings.database_url, workdir, zero, load_s, placement)


def _trace_flags(directory: Path | None) -> list[str]:
    """The verifier's flags for --pass-trace DIR (made by `check_arguments`)."""
    if directory is None:
        return []
    return ["--pass-trace", str((directory / "verifier.jsonl").resolve())]


def _place(fleet: LocalFleet, server: PlainServer, *, shared: bool) -> str:
    """The verifier and plain serving on one CPU of their own, the rest on the others."""
    from bench.cpus import available, pin_tree, split

    cpus = available()
    parts = None if shared else split(cpus)
    if parts is None:
        return f"every process on every CPU ({len(cpus)})"
    target, others = parts
    pin_tree(os.getpid(), others)  # this process (coordinator, clients), broker, agents
    for child in fleet.verifiers.values():
        # Its inference process; its bus side does its I/O with the rest (measured: the whole
        # verifier on the target's CPU lost 3-5% at 16 and 32 sessions to its own publishing).
        pin_tree(child.pid, target, below=True)
    if server.pid is not None:
        pin_tree(server.pid, target)
    for agent in fleet.agents.values():
        # Devices: on the cloud side's CPUs here, but never ahead of the cloud side's turns.
        os.setpriority(os.PRIO_PROCESS, agent.pid, AGENT_NICENESS)
    return (
        f"the targets (the verifier's inference process, plain serving) on CPU "
        f"{sorted(target)}; the verifier's bus side, agents (nice {AGENT_NICENESS}), broker and "
        f"coordinator on CPUs {sorted(others)}"
    )


# -- report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    what: str
    goal: float
    measured: float
    at_most: bool = False  # a time budget rather than a ratio to reach
    aim: float | None = None  # a stricter figure worked towards; not judged

    @property
    def met(self) -> bool:
        return self.measured <= self.goal if self.at_most else self.measured >= self.goal

    @property
    def sign(self) -> str:
        return "<=" if self.at_most else ">="

    def line(self) -> str:
        aim = "" if self.aim is None else f"; aiming at {self.aim}"
        verdict = "met" if self.met else "NOT met"
        return f"{self.what}: {self.measured:.3f} (goal {self.sign} {self.goal}{aim}) {verdict}"

    def document(self) -> dict[str, Any]:
        return {
            "goal": self.what,
            "target": self.goal,
            "at_most": self.at_most,
            "aim": self.aim,
            "measured": self.measured,
            "met": self.met,
        }


def _find(results: Sequence[RunResult], config: RunConfig) -> RunResult | None:
    return next((r for r in results if r.config == config), None)


def _arms(results: Sequence[RunResult], level: int, drafter: str) -> list[RunResult]:
    """The level's plain serving, bus target-only (if run), fixed drafter and adaptive runs."""
    configs = [RunConfig(level, arm) for arm in ("plain", "target")]
    configs += [RunConfig(level, "fixed", drafter), RunConfig(level, "adaptive")]
    return [r for r in (_find(results, c) for c in configs) if r is not None]


def _by_arm(results: Sequence[RunResult], level: int, drafter: str) -> dict[Arm, RunResult]:
    return {r.config.arm: r for r in _arms(results, level, drafter)}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


Table = tuple[Sequence[str], list[list[Any]]]

SINGLE_HEADERS = ("run", "sessions", "tokens", "rounds", "tok/round", "α", "tok/s", "median tok/s")
THROUGHPUT_HEADERS = (
    *("sessions", "n", "plain tok/s", "fixed tok/s", "adaptive tok/s"),
    *("fixed/plain", "adaptive/plain", "goal", "plain batch", "fixed batch", "adaptive batch"),
)
BUS_TARGET_HEADERS = ("sessions", "bus target-only tok/s", "plain tok/s", "bus/plain", "batch")
OVERHEAD_HEADERS = (
    *("run", "rounds", "left out", "wait p50", "verify p50", "queue p50"),
    *("overhead p50", "overhead p99", "agent<->coord p50", "persist p50", "coord rest p50"),
    *("coord<->verifier p50", "agent turn p50"),
)
DIRECT_HEADERS = (
    *("run", "rounds", "overhead", "bus+agent", "pipe", "persist", "verdict"),
    *("verifier rest", "queue", "verify"),
)
PROACTIVE_HEADERS = (
    *("drafter", "sessions", "on tok/s", "off tok/s", "on/off"),
    *("on session tok/s", "off session tok/s", "hits/misses/skipped", "on turn", "off turn"),
)


def single_session(results: Sequence[RunResult], drafter: str) -> tuple[Table, dict[str, float]]:
    """Part 1's rows, and each bus arm's session tokens/s over plain serving's, by run name."""
    runs = _arms(results, 1, drafter)
    rows = [
        [
            *(r.config.label, len(r.sessions), r.tokens, r.rounds, r.tokens / r.rounds),
            "-" if r.alpha is None else r.alpha,
            r.session_tokens_per_s,
            median([float(s["tokens_per_s"]) for s in r.sessions if s["tokens_per_s"]]),
        ]
        for r in runs
    ]
    arms = {r.config.arm: r for r in runs}
    plain = arms["plain"].session_tokens_per_s
    ratios: dict[str, float] = {
        r.config.label.removesuffix(" x1"): _ratio(r.session_tokens_per_s, plain)
        for r in runs
        if r.config.on_bus
    }
    return (SINGLE_HEADERS, rows), ratios


def adaptive_goals(level: int, ratio: float) -> list[Goal]:
    what = f"tokens/s x{level}, adaptive / plain serving"
    goals = [Goal(what, ADAPTIVE_FLOOR, ratio)]
    if level in ADAPTIVE_GOALS:
        goals.append(Goal(what, ADAPTIVE_GOALS[level], ratio))
    return goals


def throughput(
    results: Sequence[RunResult], levels: Sequence[int], drafter: str
) -> tuple[Table, list[Goal]]:
    rows: list[list[Any]] = []
    goals: list[Goal] = []
    for level in levels:
        arms = _by_arm(results, level, drafter)
        plain, fixed, adaptive = arms["plain"], arms["fixed"], arms["adaptive"]
        ratio = _ratio(adaptive.throughput, plain.throughput)
        level_goals = adaptive_goals(level, ratio)
        goals += level_goals
        verdict = ", ".join(f">= {g.goal} {'met' if g.met else 'NOT met'}" for g in level_goals)
        rows.append(
            [
                *(level, len(adaptive.sessions)),
                *(plain.throughput, fixed.throughput, adaptive.throughput),
                *(_ratio(fixed.throughput, plain.throughput), ratio, verdict),
                *(plain.mean_batch, fixed.mean_batch, adaptive.mean_batch),
            ]
        )
    return (THROUGHPUT_HEADERS, rows), goals


def bus_target_only(results: Sequence[RunResult], levels: Sequence[int], drafter: str) -> Table:
    rows: list[list[Any]] = []
    for level in levels:
        arms = _by_arm(results, level, drafter)
        target, plain = arms["target"], arms["plain"]
        ratio = _ratio(target.throughput, plain.throughput)
        rows.append([level, target.throughput, plain.throughput, ratio, target.mean_batch])
    return BUS_TARGET_HEADERS, rows


def overhead(results: Sequence[RunResult], drafter: str) -> tuple[Table, list[Goal]]:
    rows: list[list[Any]] = []
    for r in results:
        if not r.config.on_bus or not r.config.proactive:
            continue
        ms = r.summary()["ms"]
        rows.append(
            [
                *(r.config.label, len(r.timings), r.unmatched_rounds, ms["wait"]["p50"]),
                *(ms["verify"]["p50"], ms["queue"]["p50"]),
                *(ms["overhead"]["p50"], ms["overhead"]["p99"]),
                *(ms["agent_legs"]["p50"], ms["persist"]["p50"], ms["other_coordinator"]["p50"]),
                *(ms["verifier_leg"]["p50"], ms["turnaround"]["p50"]),
            ]
        )
    goals: list[Goal] = []
    fixed = _find(results, RunConfig(1, "fixed", drafter))
    if fixed is not None:
        values = fixed.values(lambda t: t.overhead_ms)
        what = f"per-round overhead beyond compute, {drafter} x1, ms"
        goals += [
            Goal(f"{what}, p50", OVERHEAD_P50_GOAL_MS, median(values), True, OVERHEAD_P50_AIM_MS),
            Goal(f"{what}, p99", OVERHEAD_P99_GOAL_MS, percentile(values, 99), True),
        ]
    return (OVERHEAD_HEADERS, rows), goals


def direct_legs(results: Sequence[RunResult]) -> Table:
    """Part 3b: the overhead of direct rounds by leg, p50 / p99 of each (rounds whose verifier
    reported its legs; the legs' p50s need not add up to the overhead's)."""
    rows: list[list[Any]] = []
    for r in results:
        if not r.config.on_bus or not r.config.proactive:
            continue
        timed = [t for t in r.timings if not math.isnan(t.leg.held_ms)]
        if not timed:
            continue

        def cell(what: Callable[[RoundTiming], float], timed: list[RoundTiming] = timed) -> str:
            values = [v for v in (what(t) for t in timed) if not math.isnan(v)]
            return f"{median(values):.2f} / {percentile(values, 99):.2f}"

        rows.append(
            [
                *(r.config.label, len(timed), cell(lambda t: t.overhead_ms)),
                *(cell(lambda t: t.bus_agent_ms), cell(lambda t: t.leg.pipe_ms)),
                *(cell(lambda t: t.leg.persist_ms), cell(lambda t: t.leg.encode_ms)),
                *(cell(lambda t: t.verifier_rest_ms), cell(lambda t: t.leg.queue_ms)),
                cell(lambda t: t.leg.verify_ms),
            ]
        )
    return DIRECT_HEADERS, rows


def proactive(
    results: Sequence[RunResult], levels: Sequence[int], drafters: Sequence[str]
) -> Table:
    rows: list[list[Any]] = []
    for drafter in drafters:
        for level in levels:
            rows.append(_proactive_row(results, level, drafter))
    return PROACTIVE_HEADERS, rows


def _proactive_row(results: Sequence[RunResult], level: int, drafter: str) -> list[Any]:
    on = _find(results, RunConfig(level, "fixed", drafter))
    off = _find(results, RunConfig(level, "fixed", drafter, proactive=False))
    assert on is not None and off is not None  # plan() runs both wherever part 4 runs
    on_s, off_s = on.summary(), off.summary()
    counts = (on_s["proactive_hits"], on_s["proactive_misses"], on_s["proactive_skipped"])
    return [
        *(drafter, level, on.throughput, off.throughput, _ratio(on.throughput, off.throughput)),
        *(on.session_tokens_per_s, off.session_tokens_per_s),
        "/".join(str(c) for c in counts),
        *(on_s["ms"]["turnaround"]["p50"], off_s["ms"]["turnaround"]["p50"]),
    ]


def adaptive_modes(
    results: Sequence[RunResult], levels: Sequence[int]
) -> tuple[Table, dict[str, dict[str, int]]]:
    """Part 5: the adaptive arm's rounds by mode, per level; and the same for the JSON."""
    runs = [(level, _find(results, RunConfig(level, "adaptive"))) for level in levels]
    modes = [(level, r.round_modes) for level, r in runs if r is not None]
    seen = {mode for _, counts in modes for mode in counts}
    columns = [m for m in MODE_ORDER if m in seen] + sorted(seen - set(MODE_ORDER))
    rows = [
        [level, sum(counts.values()), *(counts.get(mode, 0) for mode in columns)]
        for level, counts in modes
    ]
    by_level = {str(level): counts for level, counts in modes}
    return (("sessions", "rounds", *columns), rows), by_level


def target_use(results: Sequence[RunResult]) -> Table:
    """Part 6: per run, how much of its wall time the target computed, and its passes' shape."""
    rows = []
    for r in results:
        use = r.target.document(r.wall_s)
        rows.append(
            [
                r.config.label,
                f"{use['busy']:.0%}",
                use["passes"],
                f"{use['rows_per_pass']:.1f}",
                f"{use['positions_per_row']:.2f}",
                f"{r.tokens / use['passes']:.1f}" if use["passes"] else "-",
                use["waves_missing"],
            ]
        )
    columns = ("run", "busy", "passes", "rows/pass", "positions/row", "tokens/pass", "no counters")
    return columns, rows


# Processes by role, for part 7: this one (the coordinator and the load generator), the
# verifiers' bus sides, the agents, the rest below this process (the broker), the targets.
CPU_ROLES = ("coordinator", "verifier", "agents", "other", "target")
CPU_HEADERS = (
    *("run", "coordinator+clients", "verifier bus side", "agents", "broker, other"),
    *("beside the target", "target"),
)


def cpu_use(results: Sequence[RunResult]) -> Table:
    """Part 7: each run's CPU time by role, ms per committed token."""
    rows = []
    for r in results:
        per = r.cpu_ms_per_token
        if per:
            roles = (*CPU_ROLES[:-1], "beside", "target")
            rows.append([r.config.label, *(f"{per[role]:.2f}" for role in roles)])
    return CPU_HEADERS, rows


@dataclass(frozen=True)
class Identity:
    """Every answer against plain serving's answer to the same prompt."""

    checked: int
    differing: list[str]  # "run label:prompt id"
    reference_level: int | None  # the plain-serving level whose answers are the reference

    @property
    def equal(self) -> int:
        return self.checked - len(self.differing)


def identity_check(results: Sequence[RunResult]) -> Identity:
    """Compare each answer with plain serving's at its lowest level (bus arms and other levels)."""
    plain = sorted((r for r in results if r.config.arm == "plain"), key=lambda r: r.config.sessions)
    if not plain:
        return Identity(0, [], None)
    reference: dict[str, dict[str, Any]] = {}
    for s in plain[0].sessions:
        reference.setdefault(s["prompt_id"], s)
    checked = 0
    differing: list[str] = []
    for result in results:
        for s in result.sessions:
            expected = reference.get(s["prompt_id"])
            if expected is None or expected is s:
                continue
            checked += 1
            if s["token_ids"] != expected["token_ids"]:
                differing.append(f"{result.config.label}:{s['prompt_id']}")
    return Identity(checked, differing, plain[0].config.sessions)


def _print_table(title: str, table: Table) -> None:
    print(f"\n{title}")
    print(format_table(*table))


def _print_setup(run: BenchRun, args: argparse.Namespace) -> None:
    k_text = f"k={args.k}" if args.k is not None else "its own k"
    print(
        f"\nbroker {run.broker}; database {run.database}; 1 verifier (threads=1); "
        f"{args.agents} agents; fixed drafter {args.drafter} ({k_text}); greedy; "
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
    print(f"placement: {run.placement}")
    print(
        "plain serving: the target alone in its own process (threads=1), greedy, continuously "
        f"batched, no bus (loaded in {run.plain_load_s:.1f} s, not timed); adaptive: k=0, the "
        "coordinator chooses mode, drafter and k"
    )
    print(
        "clients (in this process, on the coordinator's CPU): "
        + (
            "each session's text read as it streams (--stream-clients)"
            if args.stream_clients
            else 'whole answers (`"stream": false`), as plain serving hands them back'
        )
    )


def report(run: BenchRun, args: argparse.Namespace) -> dict[str, Any]:
    """Print a table per part and the goals; return the JSON document."""
    results = run.results
    levels = list(args.sessions)
    _print_setup(run, args)
    if 1 in levels:
        table, ratios = single_session(results, args.drafter)
        _print_table("1. single session (one at a time; configurations take turns)", table)
        print(", ".join(f"{name} / plain serving: {ratio:.2f}x" for name, ratio in ratios.items()))
    table, goals = throughput(results, levels, args.drafter)
    _print_table(
        "2. committed tokens/s (one verifier or plain serving; waves of c sessions)", table
    )
    if args.bus_target_only:
        table_b = bus_target_only(results, levels, args.drafter)
        _print_table("2b. target-only over the bus against plain serving", table_b)
    table, more = overhead(results, args.drafter)
    goals += more
    _print_table(
        "3. per-round time of device-drafted rounds, ms; "
        "overhead = agent wait - verifier compute - verifier queue",
        table,
    )
    unmatched = sum(r.unmatched_rounds for r in results)
    if unmatched:
        print(f"({unmatched} rounds had no coordinator record to match and are left out)")
    table = direct_legs(results)
    if table[1]:
        _print_table(
            "3b. direct rounds (the verifier answers the device): overhead by leg, ms p50 / p99; "
            "bus+agent = agent wait - the verifier's time from the draft's arrival to the "
            "verdict queued; verdict = building and encoding it; verifier rest = its time less "
            "the legs timed (decode, task hand-offs, checks, stop rules)",
            table,
        )
    if args.proactive_sessions:
        table = proactive(results, args.proactive_sessions, args.proactive_drafters)
        _print_table("4. proactive drafting on vs off (turn: agent turnaround p50, ms)", table)
    table, modes = adaptive_modes(results, levels)
    _print_table("5. the adaptive arm's rounds by mode (from the database)", table)
    _print_table(
        "6. the target's use: busy = its compute / the run's wall time (plain serving: decode "
        "passes, prefills left out); positions per row include each pass's padding",
        target_use(results),
    )
    _print_table(
        "7. CPU time by process, ms per committed token (user + system); beside the target: "
        "every process but the target's, on the other CPUs (the coordinator with this load "
        "generator, the verifier's bus side, the agents, the broker)",
        cpu_use(results),
    )

    identity = identity_check(results)
    drafted_target_rounds = sum(r.drafted_rounds for r in results if r.config.arm == "target")
    differ_text = f" (differ: {', '.join(identity.differing[:8])})" if identity.differing else ""
    print(
        f"\ngreedy answers equal to plain serving's (x{identity.reference_level}): "
        f"{identity.equal}/{identity.checked}{differ_text}"
    )
    if args.bus_target_only:
        print(f"bus target-only rounds that carried a draft: {drafted_target_rounds}")
    print("goals")
    for goal in goals:
        print(f"  {goal.line()}")
    identity_met = identity.checked > 0 and not identity.differing
    print(f"  greedy answers identical to the target alone in every arm: {identity_met}")
    return {
        "benchmark": "e2e",
        "settings": _settings_document(run, args),
        "runs": [r.summary() for r in results],
        "goals": [g.document() for g in goals],
        "identity": {
            "checked": identity.checked,
            "differing": identity.differing,
            "reference": f"plain serving x{identity.reference_level}",
            "met": identity_met,
        },
        "adaptive_round_modes": modes,
        "bus_target_only_rounds_with_a_draft": drafted_target_rounds,
        "bus_target_only_sessions_held_at_k0": run.zero_window_sessions,
        "sessions": [
            {"run": r.config.label, "arm": r.config.arm, **s} for r in results for s in r.sessions
        ],
        "rounds": [
            {"run": r.config.label, **_round_document(t)} for r in results for t in r.timings
        ],
    }


def _settings_document(run: BenchRun, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "drafter": args.drafter,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "limit": args.limit,
        "sessions": list(args.sessions),
        "arrivals": args.arrivals,
        "stream_clients": args.stream_clients,
        "bus_target_only": args.bus_target_only,
        "proactive_sessions": list(args.proactive_sessions),
        "proactive_drafters": list(args.proactive_drafters),
        "agents": args.agents,
        "verifiers": 1,
        "verifier_threads": 1,
        "plain_serving_threads": 1,
        "plain_serving_load_s": run.plain_load_s,
        "broker": run.broker,
        "private_mosquitto": args.broker is None,
        "database": run.database,
        "workdir": str(run.workdir),
    }


def _round_document(t: RoundTiming) -> dict[str, Any]:
    return {
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
        "direct_pipe_ms": t.leg.pipe_ms,
        "direct_persist_ms": t.leg.persist_ms,
        "direct_verdict_ms": t.leg.encode_ms,
        "direct_held_ms": t.leg.held_ms,
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
    from bench.plain_serving import PlainServingError
    from core.errors import CommandError
    from core.settings import Settings

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
        try:
            bench_run = asyncio.run(run_bench(args, prompts))
        except PlainServingError as exc:
            raise CommandError(f"plain serving failed: {exc}") from exc
    document = report(bench_run, args)
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    return 0
