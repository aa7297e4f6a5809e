"""The inference child process: it loads the target once and verifies the batches sent down a pipe.

The bus-facing worker supervises it through `InferenceChild`. Running the runtime in another
process means a crash in native code (or an OOM kill) costs the batch in flight, not the worker
and its bus session; the worker answers that batch with errors and starts a new child.

A pass of nothing but plain stream rounds may come as `Steps`: the child then runs each row's
next round itself, pass after pass, sending each pass's rounds up as it ends, until the rows
stop or the worker sends anything (an `Interrupt`, when other work arrives). Between two such
passes there is no pipe and no worker: the target's idle time between passes went from 2-6 ms
to ~0 on a 2-core host where the worker shares a CPU with the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import resource
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TextIO

from broker.messages import VerifyRequest
from core.aio import timeout
from inference.child_process import STOP_TIMEOUT_S, exit_reason, kill_and_reap
from inference.heap import keep_freed_memory
from inference.runtime import Runtime
from inference.speculative import apply_stop_rules
from verifier.core import MAX_SESSIONS, CoreStats, Verification, VerifierCore
from verifier.streams import copy_reach, cut_window

log = logging.getLogger(__name__)

# A first start may build the target from its GGUF, which takes minutes on a small CPU.
START_TIMEOUT_S = 900.0
MAX_CACHE_MB = 2048
PRECISION = "fp32"


class ChildDied(Exception):
    """The inference process exited, broke its pipe, or did not answer in time."""


class ChildStartError(ChildDied):
    """The inference process could not load the target."""


@dataclass(frozen=True)
class ChildConfig:
    """What the child needs to build its runtime and core; picklable, sent at spawn."""

    models_dir: Path | None = None  # None: the settings' models directory
    precision: str = PRECISION
    target: str | None = None  # a built target's name; None: SmolLM2 at `precision`
    provider: str = "cpu"  # ONNX Runtime execution provider (inference.onnx_runtime.PROVIDERS)
    threads: int | None = None  # ORT intra-op threads; None: ORT's default (every core)
    max_sessions: int = MAX_SESSIONS
    max_cache_mb: int = MAX_CACHE_MB
    cloud_drafts: bool = True  # draft cloud rounds with the drafters of the models directory
    profile: bool = True  # time a few pass shapes after loading, to seed the worker's cost model
    preload_drafters: bool = True  # load the cloud drafters' models while idle, not on first use
    pass_trace: Path | None = None  # append a JSON line per pass here (PassTrace)


@dataclass(frozen=True)
class ChildReady:
    pid: int
    target: str  # model name@sha256 prefix
    load_s: float
    drafts: tuple[str, ...] = ()  # the drafters it runs for cloud rounds
    # Pass costs timed at start: (rows, positions per row, ms), for goodput control.
    profile: tuple[tuple[int, int, float], ...] = ()
    vocab_size: int | None = None  # the target's; the coordinator refuses prompts beyond it
    eos_id: int | None = None  # the target's, from its manifest
    vocab: str = ""  # the target's vocabulary hash, from its manifest


@dataclass(frozen=True)
class ChildFailed:
    reason: str


@dataclass(frozen=True)
class Steps:
    """Stream rounds that the child runs on by itself: after each pass, each row whose stream
    goes on runs its next round (its context grown by the tokens just committed) in the next
    pass, up to `limits[i]` rounds of row i in all, and only while nothing else comes down the
    pipe. What the worker would send pass by pass, without the pipe and the worker between two
    passes (vLLM's multi-step scheduling does the same for its decode steps).

    A row's rounds are plain, or drafted here with a window of `windows[i]` (the pass's choice,
    cut to the stream's cap), each cut further so that its accepted tokens and the target's own
    fit in what the answer has left (`verifier.streams.cut_window`). A row stops where the stop
    rules end its answer: at its end token, or at `left[i]` tokens (what its session may still
    generate when the call starts); its cache is then dropped before the next pass."""

    requests: list[VerifyRequest]  # a round of each row: plain, or drafted here (no tokens)
    limits: tuple[int, ...]  # [rows] rounds a row may run in this call, >= 1
    eos_ids: tuple[int | None, ...]  # [rows] the token that ends a row's answer
    # [rows] tokens the row's answer may still take; empty: not known (no stop but eos)
    left: tuple[int, ...] = ()
    # [rows] the window of the row's rounds before the cut to what is left; empty: all plain
    windows: tuple[int, ...] = ()


@dataclass(frozen=True)
class Forget:
    """Sessions whose answers ended: their caches go before the next batch. A finished
    session's cache kept in the LRU was copied out of its pass's presents when the other rows
    went on, and held ~6 MB a session until evicted; new sessions then grew the heap onto new
    pages (bench e2e at 32 streams: 27-60 thousand page faults a wave in the inference process,
    41 in plain serving's). Sent only between batches, as anything sent during `Steps` cuts
    it short."""

    session_ids: tuple[str, ...]


@dataclass(frozen=True)
class Interrupt:
    """The worker wants the pipe back: a child running `Steps` stops after its current pass.
    One that reaches a child between batches is stale and dropped."""


@dataclass(frozen=True)
class Extend:
    """The worker chose the same again for a `Steps` call in flight: every row still running
    may run `passes` more rounds. Sent while the call's last pass runs, it spares the call's
    end and the next call's start (the pipe both ways and the worker between, ~1 ms a call on
    a busy CPU against ~0.4 between two passes run on). One that reaches a child between
    batches came too late and is dropped."""

    passes: int


@dataclass(frozen=True)
class Step:
    """One more pass of a `Steps` call: which rows ran it, the rounds as verified, its time."""

    rows: tuple[int, ...]  # indices into the call's requests
    verifications: list[Verification]  # [len(rows)]
    compute_ms: float
    stack_ms: float
    windows: tuple[int, ...]  # [len(rows)] each round's window as it was asked for


@dataclass(frozen=True)
class StepsEnd:
    """The last message of a `Steps` call: its passes after the first have all gone up."""


@dataclass(frozen=True)
class ChildReply:
    verifications: list[Verification]  # in the order of the batch
    compute_ms: float  # verify_batch inside the child, the pipe excluded
    stats: CoreStats
    # How long the child sat idle before this batch came: from its last reply sent to this
    # batch read. The target's time lost between passes, whatever the worker was doing.
    idle_ms: float = 0.0
    # Of compute_ms, what the target spent stacking rows' caches into the batch (its rows
    # changed): not what a pass of this shape costs, so goodput control leaves it out.
    stack_ms: float = 0.0


class PassTrace:
    """One JSON line per forward pass, appended to a file as the pass ends: `t` (the host's
    monotonic clock at its start, the clock `time.perf_counter` reads in every process here, so
    the lines line up with other processes' records), `rows`, `positions` (the widest row's: a
    padded pass pays for it), `prefills` and `prefilled` (rows whose context was computed first,
    and its positions), `draft_ms` (the host drafting inside it), `ms`, `stack_ms` (of it, the
    rows' caches stacked or copied into the batch's), `faults` (the page faults the process
    took meanwhile), `steps` (a pass the child ran on by itself) and `rows_of` (each row's
    session, by the first 8 characters of its id, and round: "3f2a9c1e:12"). Where the
    target's time goes, pass by pass: what aggregates hide (a pass of one row beside passes of
    fifteen, a prefill that ran alone, a round run twice). A write that fails (a full disk) ends
    the trace, not the pass."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO | None = path.open("a", buffering=1, encoding="utf-8")  # by line

    def write(
        self,
        started: float,
        requests: Sequence[VerifyRequest],
        verifications: Sequence[Verification],
        ms: float,
        steps: bool,
        stack_ms: float = 0.0,
        faults: int = 0,
    ) -> None:
        if self._file is None:
            return
        widest, prefills, prefilled, draft_ms = 1, 0, 0, 0.0
        for request, verification in zip(requests, verifications, strict=False):
            drafted = verification.draft_tokens
            width = 1 + len(request.tokens if drafted is None else drafted)
            widest = width if width > widest else widest
            if verification.prefilled:
                prefills += 1
                prefilled += verification.prefilled
            draft_ms += verification.draft_ms
        line = {
            "t": round(started, 6),
            "rows": len(requests),
            "positions": widest,
            "prefills": prefills,
            "prefilled": prefilled,
            "draft_ms": round(draft_ms, 3),
            "ms": round(ms, 3),
            "stack_ms": round(stack_ms, 3),
            "faults": faults,
            "steps": steps,
            "rows_of": [f"{request.session_id[:8]}:{request.round}" for request in requests],
        }
        try:
            self._file.write(json.dumps(line) + "\n")
        except OSError:
            log.exception("pass trace %s stopped: a line could not be written", self.path)
            self._file = None


def stacking_ms(runtime: Runtime) -> float:
    """The target's stacking time so far (0 for a runtime that does not count it)."""
    return float(getattr(runtime, "stack_ms", 0.0))


def child_main(conn: Connection, config: ChildConfig) -> None:
    """Entry point of the spawned process: load once, then answer batches until EOF or None."""
    # Ctrl-C goes to the whole process group; the worker decides when its child stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started = time.perf_counter()
    keep_freed_memory()  # a pass's presents on reused pages, not on new ones (inference.heap)
    try:
        from modelbuild.target_build import PRECISIONS, load_target, load_target_identity
        from verifier.core import VerifierCore, kv_bytes_per_position

        precision = next(p for p in PRECISIONS if p == config.precision)
        runtime, _ = load_target(
            config.models_dir,
            precision=precision,
            threads=config.threads,
            allow_spinning=False,
            name=config.target,
            provider=config.provider,
        )
        c = runtime.config
        per_position = kv_bytes_per_position(c.n_layers, c.n_kv_heads, c.head_dim)
        models_dir = config.models_dir
        if models_dir is None:
            from inference.artifacts import default_models_dir

            models_dir = default_models_dir()
        identity = load_target_identity(models_dir, config.target or runtime.name)
        drafters = None
        if config.cloud_drafts:
            from verifier.drafting import HostDrafters

            drafters = HostDrafters(models_dir, threads=config.threads, vocab=identity.vocab_sha256)
        core = VerifierCore(
            runtime,
            max_sessions=config.max_sessions,
            max_cached_positions=max(1, config.max_cache_mb * 2**20 // per_position),
            max_positions=c.context_length,
            drafters=drafters,
        )
        ready = ChildReady(
            os.getpid(),
            identity.label,
            time.perf_counter() - started,
            drafts=() if drafters is None else drafters.names,
            profile=profile_passes(runtime) if config.profile else (),
            vocab_size=c.vocab_size,
            eos_id=identity.eos_id,
            vocab=identity.vocab_sha256,
        )
    # Whatever stops the load is reported to the worker, which decides to retry or give up.
    except Exception as exc:
        log.exception("inference process could not load the target")
        _send_or_exit(conn, ChildFailed(f"{type(exc).__name__}: {exc}"))
        return
    _send_or_exit(conn, ready)
    trace = None
    if config.pass_trace is not None:
        try:
            trace = PassTrace(config.pass_trace)
        except OSError:  # the worker checked it; a disk that went away costs the trace only
            log.exception("no pass trace: %s cannot be appended to", config.pass_trace)
    replied = time.perf_counter()
    # The drafters' models load while no batch waits, one at a time: a batch that comes
    # meanwhile waits for one load at most.
    preloads = drafters.preloads() if drafters is not None and config.preload_drafters else []
    frozen = False
    held: list[object] = []  # what a `Steps` call read that was not for it: the next message
    while True:
        while drafters is not None and preloads and not held and not conn.poll():
            name = preloads.pop(0)
            log.info("loaded drafter %s in %.2fs", name, drafters.load(name))
        if not preloads and not frozen:
            # What loading made lives as long as the process (the n-gram table alone is ~250k
            # objects): a full collection need not walk it again. Walking it took 17-107 ms a
            # collection, six of them while the table loaded; one during a pass would stall it.
            gc.freeze()
            frozen = True
        try:
            batch = held.pop(0) if held else conn.recv()
        except EOFError:  # the worker is gone; nobody will read what we compute
            return
        if batch is None:
            return
        if isinstance(batch, Interrupt | Extend):
            continue  # it came after the call it meant to cut short (or to go on) had ended
        if not isinstance(batch, Forget | Steps | list):
            log.error("unexpected message %s from the worker; dropped", type(batch).__name__)
            continue
        if isinstance(batch, Forget):
            for session_id in batch.session_ids:
                core.drop(session_id)
            continue
        plan = batch if isinstance(batch, Steps) else None
        requests = batch.requests if isinstance(batch, Steps) else batch
        idle_ms = (time.perf_counter() - replied) * 1e3
        verifications, compute_ms, stack_ms = timed_pass(core, runtime, requests, trace)
        reply = ChildReply(verifications, compute_ms, core.stats(), idle_ms, stack_ms)
        if not _send_or_exit(conn, reply):
            return
        if plan is not None:
            # Each pass's rounds go up as soon as it ends: the worker publishes them while the
            # next pass runs, as it does pass by pass.
            for step in run_steps(core, runtime, plan, verifications, conn, trace, held):
                if not _send_or_exit(conn, step):
                    return
            if not _send_or_exit(conn, StepsEnd()):
                return
        replied = time.perf_counter()


def timed_pass(
    core: VerifierCore,
    runtime: Runtime,
    requests: Sequence[VerifyRequest],
    trace: PassTrace | None = None,
    steps: bool = False,
) -> tuple[list[Verification], float, float]:
    """One batch through the core: its verifications, the ms it took, and the ms of that spent
    stacking rows' caches."""
    t0 = time.perf_counter()
    stacked = stacking_ms(runtime)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    verifications = core.verify_batch(requests)
    ms = (time.perf_counter() - t0) * 1e3
    stacked = stacking_ms(runtime) - stacked
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    if trace is not None:
        trace.write(t0, requests, verifications, ms, steps, stacked, faults)
    return verifications, ms, stacked


def run_steps(
    core: VerifierCore,
    runtime: Runtime,
    plan: Steps,
    first: Sequence[Verification],
    conn: Connection,
    trace: PassTrace | None = None,
    held: list[object] | None = None,
) -> Iterator[Step]:
    """The passes of `plan` after its first (whose rounds are `first`), each as it ends, until
    every row has stopped or the worker sends anything but an `Extend` down the pipe (put in
    `held` for the next receive; left in the pipe without one)."""
    requests = list(plan.requests)
    last = list(first)
    rows = list(range(len(requests)))
    limits = list(plan.limits)
    generated = [0] * len(requests)  # by row, tokens its rounds of this call committed
    done = 0
    while True:
        done += 1
        stop = held is None and conn.poll()
        while held is not None and not stop and conn.poll():
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None  # the worker is gone: the main loop ends on it
            if isinstance(message, Extend):
                limits = [limit + message.passes for limit in limits]
            else:
                held.append(message)
                stop = True
        going = []
        for row, verification in zip(rows, last, strict=True):
            token = verification.next_token
            if not verification.ok or token is None:
                continue
            accepted = list((verification.draft_tokens or ())[: verification.n_accepted])
            left = plan.left[row] if row < len(plan.left) else sys.maxsize
            eos = plan.eos_ids[row]
            kept, ended = apply_stop_rules(
                generated[row], accepted, token, left, -1 if eos is None else eos
            )
            generated[row] += len(kept)
            if ended:
                # Its answer is whole: its cache would only be copied out of this pass's
                # presents when the others go on (`Forget`).
                core.drop(requests[row].session_id)
            elif done < limits[row]:
                request = requests[row]
                own = plan.windows[row] if row < len(plan.windows) else 0
                room = left - generated[row]  # what its answer has left
                window = cut_window(own, room)
                far = plan.requests[row].cloud_reach or 0
                requests[row] = request.model_copy(
                    update={
                        "round": request.round + 1,
                        "context_ids": (*request.context_ids, *kept),
                        "cloud_draft": plan.requests[row].cloud_draft if window else None,
                        "cloud_k": window or None,
                        "cloud_reach": copy_reach(window, far, room),
                    }
                )
                going.append(row)
        if not going or stop:
            return
        ran = [requests[row] for row in going]
        last, compute_ms, stack_ms = timed_pass(core, runtime, ran, trace, steps=True)
        rows = going
        windows = tuple(request.cloud_k or 0 for request in ran)
        yield Step(tuple(going), last, compute_ms, stack_ms, windows)


# The pass shapes timed at start: enough distinct (rows, positions) for the three terms of
# cost(B, T) = a + b B + c B T, and the lone row's own slope; about 0.7 s on a 2-core host.
PROFILE_SHAPES = ((1, 1), (1, 5), (1, 9), (8, 1), (8, 5), (4, 1), (4, 3))
PROFILE_CONTEXT = 32  # positions already in each row's cache, as in a session under way
PROFILE_REPEATS = 2


def profile_passes(
    runtime: Runtime,
    shapes: Sequence[tuple[int, int]] = PROFILE_SHAPES,
    repeats: int = PROFILE_REPEATS,
    context: int = PROFILE_CONTEXT,
) -> tuple[tuple[int, int, float], ...]:
    """Time one pass per shape (the best of a few), on caches holding a short context."""
    runtime.forward_batch([([1], runtime.new_cache())])  # the first pass pays for warm-up
    samples = []
    for rows, positions in shapes:
        best = float("inf")
        for _ in range(repeats):
            caches = [runtime.new_cache() for _ in range(rows)]
            for cache in caches:
                runtime.forward(list(range(1, context + 1)), cache)
            stacked = stacking_ms(runtime)
            t0 = time.perf_counter()
            runtime.forward_batch([(list(range(2, positions + 2)), cache) for cache in caches])
            elapsed = (time.perf_counter() - t0) * 1e3
            # What the shape costs in place, as the worker observes its passes.
            best = min(best, elapsed - (stacking_ms(runtime) - stacked))
        samples.append((rows, positions, best))
    return tuple(samples)


def _send_or_exit(conn: Connection, message: object) -> bool:
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


class InferenceChild:
    """The worker's handle on its inference process: start, verify a batch, kill, stop."""

    def __init__(self, config: ChildConfig, name: str = "verifier-inference") -> None:
        self.config = config
        self.name = name
        self._context = multiprocessing.get_context("spawn")
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self.ready: ChildReady | None = None
        self.starts = 0
        self._stepping = False  # a `Steps` call is in flight and was not interrupted
        self._forgotten: list[str] = []  # sessions ended: `Forget` goes with the next batch

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> ChildReady:
        """Spawn the process and wait until it has loaded the target."""
        self.kill()
        self._stepping = False
        self._forgotten.clear()  # a new process holds no caches
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=child_main, args=(child_conn, self.config), name=self.name, daemon=True
        )
        process.start()
        # Our copy of the child's end must go, or the child's death would never read as EOF.
        child_conn.close()
        self._process, self._conn = process, parent_conn
        self.starts += 1
        try:
            message = await self._receive(timeout_s)
        except ChildDied as exc:
            self.kill()
            raise ChildStartError(str(exc)) from exc
        if isinstance(message, ChildFailed):
            self.kill()
            raise ChildStartError(message.reason)
        if not isinstance(message, ChildReady):
            self.kill()
            raise ChildStartError(f"unexpected first message {type(message).__name__}")
        self.ready = message
        log.info(
            "inference process %d loaded %s in %.1fs", message.pid, message.target, message.load_s
        )
        return message

    async def verify(
        self,
        requests: Sequence[VerifyRequest] | Steps,
        timeout_s: float,
        sent: Callable[[], None] | None = None,
    ) -> ChildReply:
        """Send one batch (or a `Steps` call) and wait for its reply (a `Steps` call's first
        pass; `steps` gives the rest); raise ChildDied if the process is lost. `sent` is called
        once the process has the batch."""
        if self._conn is None or not self.alive:
            raise ChildDied("the inference process is not running")
        try:
            if self._forgotten:
                self._conn.send(Forget(tuple(self._forgotten)))
                self._forgotten.clear()
            if isinstance(requests, Steps):
                self._conn.send(requests)
                self._stepping = True
            else:
                self._conn.send(list(requests))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise ChildDied(f"pipe to the inference process broke: {exc}") from exc
        if sent is not None:
            sent()
        message = await self._receive(timeout_s)
        if not isinstance(message, ChildReply):
            raise ChildDied(f"unexpected reply {type(message).__name__}")
        return message

    async def steps(self, timeout_s: float) -> AsyncIterator[Step]:
        """The passes of the `Steps` call whose first pass `verify` returned, as each ends;
        raise ChildDied if the process is lost. `timeout_s` is per pass."""
        try:
            while True:
                message = await self._receive(timeout_s)
                if isinstance(message, StepsEnd):
                    return
                if not isinstance(message, Step):
                    raise ChildDied(f"unexpected reply {type(message).__name__}")
                yield message
        finally:
            self._stepping = False

    @property
    def stepping(self) -> bool:
        """A `Steps` call is in flight, and no `Interrupt` was sent to it."""
        return self._stepping

    def extend(self, passes: int) -> None:
        """Let the `Steps` call in flight run `passes` more rounds a row (nothing otherwise)."""
        if not self._stepping or self._conn is None or passes < 1:
            return
        # A broken pipe is for the reply's wait to find: the process is gone.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
            self._conn.send(Extend(passes))

    def forget(self, session_id: str) -> None:
        """A session whose answer ended: the process drops its cache before its next batch
        (not now, which would cut a `Steps` call in flight short)."""
        self._forgotten.append(session_id)

    def interrupt(self) -> None:
        """Cut a `Steps` call in flight short after its current pass (nothing otherwise)."""
        if not self._stepping or self._conn is None:
            return
        self._stepping = False  # one is enough
        # A broken pipe is for the reply's wait to find: the process is gone.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
            self._conn.send(Interrupt())

    async def _receive(self, timeout_s: float) -> object:
        """The next message from the child, waiting on the pipe and the process sentinel."""
        assert self._conn is not None and self._process is not None
        conn, process = self._conn, self._process
        loop = asyncio.get_running_loop()
        try:
            async with timeout(timeout_s):
                while True:
                    if conn.poll():
                        try:
                            message: object = conn.recv()
                        except (EOFError, OSError) as exc:
                            raise ChildDied(self._death_reason()) from exc
                        return message
                    if not process.is_alive():
                        raise ChildDied(self._death_reason())
                    readable: asyncio.Future[None] = loop.create_future()

                    def wake(future: asyncio.Future[None] = readable) -> None:
                        if not future.done():
                            future.set_result(None)

                    loop.add_reader(conn.fileno(), wake)
                    loop.add_reader(process.sentinel, wake)
                    try:
                        await readable
                    finally:
                        loop.remove_reader(conn.fileno())
                        loop.remove_reader(process.sentinel)
        except TimeoutError:
            self.kill()
            raise ChildDied(
                f"no answer from the inference process within {timeout_s:.0f}s"
            ) from None

    def _death_reason(self) -> str:
        process = self._process
        if process is None:
            return "the inference process is gone"
        return f"the inference process {process.pid} {exit_reason(process)}"

    def kill(self) -> None:
        """SIGKILL the process (if any) and reap it."""
        process, conn = self._process, self._conn
        self._process, self._conn, self.ready = None, None, None
        kill_and_reap(process, conn)

    def stop(self) -> None:
        """Ask the process to exit after its current batch; kill it if it does not."""
        if self._conn is not None and self.alive:
            try:
                self._conn.send(None)
            except OSError:
                log.debug("the inference process closed its pipe first; killing it")
            else:
                assert self._process is not None
                self._process.join(STOP_TIMEOUT_S)
        self.kill()
