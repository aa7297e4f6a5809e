"""Plain serving, the baseline of `bench e2e`: the target alone, greedy and batched, in a process.

What a user would run instead of specfleet: one process holds the target, loaded as the
verifier's inference process loads it (fp32, ONNX Runtime with one intra-op thread and no
spinning), and decodes every session of a wave itself. Each prompt gets its own prefill pass,
whose last row gives the first token; then one batched pass per step over the sessions still
running, each feeding its last token. No bus, no database, no drafting: the lean baseline.

The process is started once and serves waves over a pipe, so loading the target is never timed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

from inference.heap import keep_freed_memory
from inference.runtime import KVCache, Runtime
from inference.speculative import apply_stop_rules

if TYPE_CHECKING:
    from modelbuild.target_build import TargetPrecision

# The verifier's inference process runs the fp32 target (verifier.child.PRECISION), and the
# benchmark's verifier runs with one intra-op thread: the baseline gets the same.
PRECISION: TargetPrecision = "fp32"
THREADS = 1
# A first start may build the target from its GGUF, which takes minutes on a small CPU.
START_TIMEOUT_S = 900.0
WAVE_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 5.0
POLL_S = 0.5  # how often a wait on the pipe checks that the process still lives


class PlainServingError(Exception):
    """The plain-serving process could not start, died, refused a wave or did not answer."""


@dataclass(frozen=True)
class ServedWave:
    """The answers of one wave of sessions started together, and what they took."""

    token_ids: list[list[int]]  # [sessions][generated]; ends with eos when it stopped there
    elapsed_s: list[float]  # [sessions]: the wave's start until the session's last token
    wall_s: float  # the wave's start until its last session ended
    batch_sizes: list[int]  # [decode steps]: sessions in each batched pass
    pass_ms: list[float] = field(default_factory=list)  # [decode steps]: each pass's time
    prefill_ms: list[float] = field(default_factory=list)  # [sessions]: its prompt's pass

    @property
    def passes(self) -> list[int]:
        """[sessions]: target passes each session took part in (its prefill included)."""
        return [len(tokens) for tokens in self.token_ids]


def serve_wave(
    runtime: Runtime,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos_id: int,
    concurrency: int | None = None,
) -> ServedWave:
    """Greedy continuous batching of `prompts` (chat-templated ids) until each one stops.

    A session stops where the coordinator stops it, by the same `apply_stop_rules`: after its
    first eos, kept, or at `max_tokens` generated tokens; it then leaves the batch. With
    `concurrency`, at most that many sessions are open at a time: the next prompt is prefilled
    as soon as one ends (before the next pass), and a session's time runs from its own start;
    without, every prompt is prefilled first and every session's time runs from the wave's.
    """
    if not prompts or any(not ids for ids in prompts):
        raise ValueError("a wave needs at least one prompt, each of at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    started = time.perf_counter()
    generated: list[list[int]] = [[] for _ in prompts]
    elapsed = [0.0] * len(prompts)
    began = [started] * len(prompts)
    caches: dict[int, KVCache] = {}  # by session, from its admission
    running: list[int] = []
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: in order
    limit = len(prompts) if concurrency is None else concurrency
    ended_at = started

    def commit(session: int, token: int) -> None:
        nonlocal ended_at
        kept, ended = apply_stop_rules(len(generated[session]), [], token, max_tokens, eos_id)
        generated[session] += kept
        if ended:
            ended_at = time.perf_counter()
            elapsed[session] = ended_at - began[session]
        else:
            running.append(session)

    prefill_ms: list[float] = []

    def admit() -> None:
        while waiting and len(running) < limit:
            session = waiting.pop()
            if concurrency is not None:
                began[session] = time.perf_counter()
            cache = caches[session] = runtime.new_cache()
            t0 = time.perf_counter()
            logits = runtime.forward(prompts[session], cache)  # [len(ids), vocab]
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
            commit(session, int(np.argmax(logits[-1])))

    admit()
    batch_sizes: list[int] = []
    pass_ms: list[float] = []
    while running:
        batch, running = running, []
        batch_sizes.append(len(batch))
        t0 = time.perf_counter()
        rows = runtime.forward_batch([([generated[s][-1]], caches[s]) for s in batch])
        pass_ms.append((time.perf_counter() - t0) * 1e3)
        for session, logits in zip(batch, rows, strict=True):
            commit(session, int(np.argmax(logits[-1])))
        admit()
    return ServedWave(generated, elapsed, ended_at - started, batch_sizes, pass_ms, prefill_ms)


@dataclass(frozen=True)
class _Wave:
    prompts: list[list[int]]
    max_tokens: int
    eos_id: int
    concurrency: int | None = None


@dataclass(frozen=True)
class _Ready:
    load_s: float


@dataclass(frozen=True)
class _Failed:
    reason: str


def _serve_main(conn: Connection, models_dir: Path | None, threads: int) -> None:
    """Entry point of the spawned process: load the target, then serve waves until EOF or None."""
    # Ctrl-C goes to the whole process group; the benchmark decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.perf_counter()
    keep_freed_memory()  # as the verifier's inference process does: the baseline loses nothing
    try:
        from modelbuild.target_build import load_target

        runtime, _ = load_target(
            models_dir, precision=PRECISION, threads=threads, allow_spinning=False
        )
    # Whatever stops the load goes back to the benchmark, which reports it in one line.
    except Exception as exc:
        conn.send(_Failed(f"cannot load the target: {type(exc).__name__}: {exc}"))
        return
    conn.send(_Ready(time.perf_counter() - started))
    while True:
        try:
            wave: _Wave | None = conn.recv()
        except EOFError:  # the benchmark is gone
            return
        if wave is None:
            return
        try:
            reply: ServedWave | _Failed = serve_wave(
                runtime, wave.prompts, wave.max_tokens, wave.eos_id, wave.concurrency
            )
        # A wave it cannot serve is refused, with its reason; the next one may be fine.
        except Exception as exc:
            reply = _Failed(f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            return


class PlainServer:
    """The benchmark's handle on the plain-serving process: start once, serve waves, stop."""

    def __init__(self, models_dir: Path | None = None, threads: int = THREADS) -> None:
        self.models_dir = models_dir
        self.threads = threads
        self.load_s: float | None = None
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The serving process's, once started."""
        return None if self._process is None else self._process.pid

    def __enter__(self) -> PlainServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Spawn the process and wait until it has loaded the target; return the load time."""
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(
            target=_serve_main,
            args=(child_conn, self.models_dir, self.threads),
            name="bench-plain-serving",
            daemon=True,
        )
        process.start()
        # Our copy of the child's end must go, or the child's death would never read as EOF.
        child_conn.close()
        self._process, self._conn = process, parent_conn
        try:
            ready = self._receive(timeout_s)
        except PlainServingError:
            self.stop()
            raise
        if not isinstance(ready, _Ready):
            self.stop()
            raise PlainServingError(f"unexpected first message {type(ready).__name__}")
        self.load_s = ready.load_s
        return ready.load_s

    def serve(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        eos_id: int,
        timeout_s: float = WAVE_TIMEOUT_S,
        concurrency: int | None = None,
    ) -> ServedWave:
        """Decode one wave of sessions started together (with `concurrency`, at most that many
        open at a time, the next starting as one ends); blocks until the last one ends."""
        if self._conn is None:
            raise PlainServingError("the plain-serving process is not running")
        wave = _Wave([[int(t) for t in ids] for ids in prompts], max_tokens, eos_id, concurrency)
        try:
            self._conn.send(wave)
        except OSError as exc:
            raise PlainServingError(f"pipe to the plain-serving process broke: {exc}") from exc
        served = self._receive(timeout_s)
        if not isinstance(served, ServedWave):
            raise PlainServingError(f"unexpected reply {type(served).__name__}")
        return served

    def _receive(self, timeout_s: float) -> object:
        assert self._conn is not None and self._process is not None
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(POLL_S):
            if not self._process.is_alive():
                raise PlainServingError(
                    f"the plain-serving process exited with status {self._process.exitcode}"
                )
            if time.monotonic() > deadline:
                raise PlainServingError(f"no answer from plain serving within {timeout_s:.0f}s")
        try:
            message: object = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise PlainServingError(f"the plain-serving process broke its pipe: {exc}") from exc
        if isinstance(message, _Failed):
            raise PlainServingError(message.reason)
        return message

    def stop(self) -> None:
        """Ask the process to exit; kill it if it does not within STOP_TIMEOUT_S."""
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        if conn is not None:
            # A process that is gone already cannot be asked; joining below reaps it.
            with contextlib.suppress(OSError):
                conn.send(None)
            conn.close()
        if process is not None:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)
