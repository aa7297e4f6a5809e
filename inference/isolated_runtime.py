"""A draft's Runtime in a child process of its own, driven over a pipe: a native crash stays there.

ONNX Runtime and LiteRT run native code, and on a phone its drivers crash, hang, or draw the
low-memory killer; in-process, any of these takes the agent and its bus session with it.
`IsolatedRuntime` implements the Runtime protocol in the agent and runs the model in a spawned
child (`child_main`); the KV caches live in the child, and the agent holds handles to them. Every
call that reaches the child is one `forward_batch`: a cache trimmed since its last pass carries
its new length with the next pass, and caches dropped by the agent ride along to be freed, so a
draft step costs one pipe round trip and no more.

Why this shape:
- One child per draft model, not one per engine: a crash costs the sessions drafting with that
  model, and a model that keeps crashing is told apart from the others (its runtime's build, its
  delegate, its memory).
- A multiprocessing pipe (a socket pair) with compact binary framing of our own, not pickling:
  requests are int64 words and a reply is a small header plus the logits' float32 bytes, as the
  runtime produced them, so the logits in the agent are the child's bit for bit. Our framing
  lets the agent read a reply against a deadline down to its last byte. A draft's reply is a
  few rows of at most a vocabulary of floats (tens of KB); shared memory would spare one copy
  of that at the price of a second channel to keep in step.
- Calls are synchronous: the agent drafts on its drafting thread, which waits on the pipe with
  a deadline. A child that misses it is taken for hung and killed.

Restarts, backoff and quarantine are the caller's policy (`device_agent.draft_supervisor`):
here a lost child raises `RuntimeLost` once, reports it to `on_lost`, and stays down until
`start` is called again. Caches of a lost child are gone: using one raises `RuntimeLost`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

import numpy as np
import numpy.typing as npt

from inference.child_process import STOP_TIMEOUT_S, exit_reason, kill_and_reap
from inference.runtime import KVCache, Logits

if TYPE_CHECKING:
    from inference.drafts import DraftRuntimeKind
    from inference.runtime import Runtime

log = logging.getLogger(__name__)

# A call that has not come back after this long (plus a little per token) is a hang. A draft
# step takes milliseconds and a long prefill well under a second here; a Pi is ~10x slower.
CALL_DEADLINE_S = 5.0
CALL_DEADLINE_PER_TOKEN_S = 0.01
# A first start spawns Python and loads the runtime: about 1-2 s here, several on a Pi.
START_DEADLINE_S = 60.0

# Framing. A request: int64 words [op, n_free, *freed handles, n_rows, *rows], a row being
# [handle, keep, n, *tokens] (keep: the length the agent's view of that cache has, to which the
# child trims it before the pass). A reply: int64 [status, n_rows, *new tokens per row] and the
# rows' logits as float32 [n, vocab], one after another; or [status] and a UTF-8 reason.
OP_STOP = 0
OP_FORWARD = 1
STATUS_OK = 0
STATUS_REFUSED = 1
_WORD = np.dtype("<i8")
_LOGIT = np.dtype("<f4")

LossKind = Literal["crash", "hang", "start"]


class RuntimeLost(Exception):
    """The child died, hung past its deadline or could not start: its caches are gone."""

    def __init__(self, reason: str, kind: LossKind) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class RuntimeRefused(ValueError):
    """The child refused a call (a cache trimmed past its length, a token out of range...) and
    is still up: the same error an in-process runtime would have raised."""


@dataclass(frozen=True)
class DraftChildSpec:
    """What the child loads; picklable, sent at spawn."""

    models_dir: Path
    name: str  # the draft's manifest name (`draft-l1`, `draft-l1-tflite`)
    format: DraftRuntimeKind
    threads: int | None = None


@dataclass(frozen=True)
class DraftChildReady:
    pid: int
    name: str
    vocab_size: int
    head_ids: tuple[int, ...] | None  # the vocabulary id of each logit column; None: full head
    load_s: float


@dataclass(frozen=True)
class DraftChildFailed:
    reason: str


def encode_forward(rows: Sequence[tuple[int, int, Sequence[int]]], freed: Sequence[int]) -> bytes:
    """A forward request: rows of (handle, keep, new tokens), and handles to free first."""
    words = [OP_FORWARD, len(freed), *freed, len(rows)]
    for handle, keep, tokens in rows:
        words += [handle, keep, len(tokens), *tokens]
    return np.asarray(words, dtype=_WORD).tobytes()


def decode_forward(
    request: npt.NDArray[np.int64],
) -> tuple[list[tuple[int, int, list[int]]], list[int]]:
    """The rows and freed handles of a forward request's words (after the op)."""
    at = 1
    n_free = int(request[at])
    freed = request[at + 1 : at + 1 + n_free].tolist()
    at += 1 + n_free
    rows = []
    for _ in range(int(request[at])):
        handle, keep, n = (int(v) for v in request[at + 1 : at + 4])
        rows.append((handle, keep, request[at + 4 : at + 4 + n].tolist()))
        at += 3 + n
    if at + 1 != request.shape[0]:
        raise ValueError(f"a forward request of {request.shape[0]} words ends at {at + 1}")
    return rows, freed


def encode_logits(logits: Sequence[Logits]) -> bytes:
    header = np.asarray([STATUS_OK, len(logits), *(row.shape[0] for row in logits)], dtype=_WORD)
    return b"".join(
        [header.tobytes(), *(np.ascontiguousarray(r, dtype=_LOGIT).data for r in logits)]
    )


def decode_logits(reply: bytes, vocab_size: int) -> list[Logits]:
    status = int(np.frombuffer(reply, dtype=_WORD, count=1)[0])
    if status != STATUS_OK:
        raise RuntimeRefused(reply[_WORD.itemsize :].decode("utf-8", "replace"))
    n_rows = int(np.frombuffer(reply, dtype=_WORD, count=2)[1])
    lens = np.frombuffer(reply, dtype=_WORD, count=2 + n_rows)[2:].tolist()
    offset = (2 + n_rows) * _WORD.itemsize
    out: list[Logits] = []
    for n in lens:
        count = int(n) * vocab_size
        out.append(np.frombuffer(reply, dtype=_LOGIT, count=count, offset=offset).reshape(n, -1))
        offset += count * _LOGIT.itemsize
    return out


def child_main(conn: Connection, spec: DraftChildSpec) -> None:
    """Entry point of the spawned process: load the draft, then answer passes until EOF or stop."""
    # Ctrl-C goes to the whole process group; the agent decides when its child stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.perf_counter()
    try:
        from inference.drafts import load_draft
        from inference.proposers import head_token_ids

        runtime = load_draft(spec.models_dir, spec.name, spec.format, threads=spec.threads)
        head = head_token_ids(runtime)
        ready = DraftChildReady(
            os.getpid(),
            runtime.name,
            runtime.vocab_size,
            None if head is None else tuple(int(i) for i in head),
            time.perf_counter() - started,
        )
    # Whatever stops the load goes back to the agent, which decides to retry or give up.
    except Exception as exc:
        _send_or_exit(conn, DraftChildFailed(f"{type(exc).__name__}: {exc}"))
        return
    if not _send_or_exit(conn, ready):
        return
    caches: dict[int, KVCache] = {}
    while True:
        try:
            request = np.frombuffer(read_frame(conn.fileno(), None), dtype=_WORD)
        except (EOFError, OSError):  # the agent is gone; nobody will read what we compute
            return
        if request.shape[0] == 0 or int(request[0]) == OP_STOP:
            return
        try:
            reply = encode_logits(_forward(runtime, caches, request))
        # A Python-level error (a bad trim, an engine's refusal of a token id) goes back to the
        # caller as a refusal, as it would have in-process; the child and its caches go on.
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            reply = np.asarray([STATUS_REFUSED], dtype=_WORD).tobytes() + reason.encode()
        try:
            write_frame(conn.fileno(), reply)
        except OSError:  # the agent is gone
            return


def _forward(
    runtime: Runtime, caches: dict[int, KVCache], request: npt.NDArray[np.int64]
) -> list[Logits]:
    rows, freed = decode_forward(request)
    for handle in freed:
        caches.pop(handle, None)
    batch: list[tuple[Sequence[int], KVCache]] = []
    for handle, keep, tokens in rows:
        cache = caches.get(handle)
        if cache is None:
            if keep != 0:
                raise KeyError(f"no cache {handle} in this child")
            cache = caches[handle] = runtime.new_cache()
        elif keep < cache.length:
            cache.trim(keep)
        elif keep > cache.length:
            raise ValueError(f"cache {handle} holds {cache.length} positions, not {keep}")
        batch.append((tokens, cache))
    return runtime.forward_batch(batch)


_FRAME = struct.Struct("<Q")  # a frame: its payload's length, then the payload


def write_frame(fd: int, payload: bytes) -> None:
    """One frame onto a pipe. Requests are small (8 bytes a token), well inside the socket's
    buffer, so a child that stopped reading cannot hold the agent here."""
    view = memoryview(_FRAME.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def read_frame(fd: int, deadline: float | None) -> bytes:
    """One whole frame off a pipe by `deadline` (time.monotonic; None: no limit).

    The deadline covers every byte: a child that stops halfway through a reply (a hang, a
    SIGSTOP) is a TimeoutError here, not a read that waits for ever. EOFError when the other
    end has gone.
    """
    (size,) = _FRAME.unpack(_read_exactly(fd, _FRAME.size, deadline))
    return bytes(_read_exactly(fd, size, deadline))


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"{got} of {size} bytes by the deadline")
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError(f"the pipe closed after {got} of {size} bytes")
        got += n
    return buffer


def _send_or_exit(conn: Connection, message: DraftChildReady | DraftChildFailed) -> bool:
    # Framed like every reply, so that the agent reads it against its deadline too.
    try:
        write_frame(conn.fileno(), pickle.dumps(message))
    except OSError:
        return False
    return True


class IsolatedKVCache:
    """A handle on a cache in the child; its length is the agent's view, trims are lazy."""

    def __init__(self, handle: int, generation: int) -> None:
        self.handle = handle
        self.generation = generation  # the child that holds it
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def trim(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot trim a cache of {self._length} positions to {length}")
        self._length = length  # the child trims on the next pass that uses this cache

    def grew(self, n: int) -> None:
        self._length += n


def _own_cache(cache: KVCache) -> IsolatedKVCache:
    if not isinstance(cache, IsolatedKVCache):
        raise TypeError(f"IsolatedRuntime needs its own caches, got {type(cache).__name__}")
    return cache


class IsolatedRuntime:
    """A draft model's Runtime, run in a supervised child process; see the module's docstring."""

    def __init__(
        self, spec: DraftChildSpec, on_lost: Callable[[RuntimeLost], None] | None = None
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.on_lost = on_lost
        self.vocab_size = 0
        self.head_ids: npt.NDArray[np.int64] | None = None
        self.ready: DraftChildReady | None = None
        self.generation = 0  # counts starts; a cache belongs to one
        self._context = multiprocessing.get_context("spawn")
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._started_at = 0.0
        # The drafting thread calls the child while the event loop may take a drafter back: the
        # pipe carries one call at a time.
        self._lock = threading.Lock()
        self._handles = 0
        self._freed: list[int] = []  # handles of caches dropped since the last call

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def starting(self) -> bool:
        return self._process is not None and self.ready is None

    @property
    def up(self) -> bool:
        return self.ready is not None

    def start(self) -> None:
        """Spawn a child; returns at once. `poll_ready` or `wait_ready` take its ready message."""
        with self._lock:
            self._kill()
            parent_conn, child_conn = self._context.Pipe(duplex=True)
            process = self._context.Process(
                target=child_main,
                args=(child_conn, self.spec),
                name=f"draft-{self.spec.name}",
                daemon=True,
            )
            process.start()
            # Our copy of the child's end must go, or its death would never read as EOF.
            child_conn.close()
            self._process, self._conn = process, parent_conn
            self._started_at = time.monotonic()
            self.generation += 1
            self._freed = []

    def poll_ready(self) -> bool:
        """Whether the child is up; takes its ready message when it has come (never blocks).
        A child that failed to load, died, or overran START_DEADLINE_S is lost."""
        return self.wait_ready(0.0)

    def wait_ready(self, timeout_s: float) -> bool:
        with self._lock:
            if self.ready is not None:
                return True
            if self._conn is None:
                return False
            overdue = time.monotonic() - self._started_at > START_DEADLINE_S
            try:
                if not self._conn.poll(0.0 if overdue else timeout_s):
                    if overdue:
                        self._lost(f"did not load within {START_DEADLINE_S:.0f}s", "start")
                    return False
                frame = read_frame(self._conn.fileno(), time.monotonic() + CALL_DEADLINE_S)
            except TimeoutError:
                self._lost("stopped halfway through its ready message", "start")
            except (EOFError, OSError):
                self._lost(self._death_reason(), "start")
            message: object = pickle.loads(frame)  # our own child's, sent at start
            if isinstance(message, DraftChildFailed):
                self._lost(f"could not load: {message.reason}", "start")
            if not isinstance(message, DraftChildReady):
                self._lost(f"sent {type(message).__name__} instead of ready", "start")
            self.ready = message
            self.vocab_size = message.vocab_size
            self.head_ids = (
                None if message.head_ids is None else np.asarray(message.head_ids, np.int64)
            )
            log.info(
                "draft %s: child %d loaded it in %.2fs", self.name, message.pid, message.load_s
            )
            return True

    def new_cache(self) -> IsolatedKVCache:
        with self._lock:
            self._handles += 1
            cache = IsolatedKVCache(self._handles, self.generation)
        weakref.finalize(cache, self._note_freed, cache.handle)
        return cache

    def _note_freed(self, handle: int) -> None:
        # Called by the collector on any thread; the child frees it with the next call.
        self._freed.append(handle)

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> Logits:
        return self.forward_batch([(token_ids, cache)])[0]

    def forward_batch(self, requests: Sequence[tuple[Sequence[int], KVCache]]) -> list[Logits]:
        own = [(list(ids), _own_cache(cache)) for ids, cache in requests]
        if any(not ids for ids, _ in own):
            raise ValueError("every sequence needs at least one new token")
        with self._lock:
            if self.ready is None or self._conn is None:
                raise RuntimeLost(f"draft {self.name}: its runtime process is not up", "crash")
            stale = [c for _, c in own if c.generation != self.generation]
            if stale:
                raise RuntimeLost(
                    f"draft {self.name}: a cache of a runtime process that was lost", "crash"
                )
            freed, self._freed = self._freed, []
            tokens = sum(len(ids) for ids, _ in own)
            reply = self._call(
                encode_forward([(c.handle, c.length, ids) for ids, c in own], freed),
                CALL_DEADLINE_S + CALL_DEADLINE_PER_TOKEN_S * tokens,
            )
        logits = decode_logits(reply, self.vocab_size)
        for ids, cache in own:
            cache.grew(len(ids))
        return logits

    def _call(self, request: bytes, deadline_s: float) -> bytes:
        assert self._conn is not None
        try:
            write_frame(self._conn.fileno(), request)
            return read_frame(self._conn.fileno(), time.monotonic() + deadline_s)
        except TimeoutError:
            self._lost(f"hung: no whole answer within {deadline_s:.1f}s", "hang")
        except (EOFError, OSError):
            self._lost(self._death_reason(), "crash")

    def _lost(self, reason: str, kind: LossKind) -> NoReturn:
        """Kill what is left of the child, tell `on_lost`, raise. Called with the lock held."""
        pid = self.pid
        self._kill()
        lost = RuntimeLost(f"draft {self.name}: runtime process {pid} {reason}", kind)
        log.error("%s", lost.reason)
        if self.on_lost is not None:
            self.on_lost(lost)
        raise lost

    def _death_reason(self) -> str:
        process = self._process
        return "is gone" if process is None else exit_reason(process)

    def _kill(self) -> None:
        process, conn = self._process, self._conn
        self._process, self._conn, self.ready = None, None, None
        kill_and_reap(process, conn)

    def stop(self) -> None:
        """Ask the child to exit; kill it if it does not."""
        with self._lock:
            if self._conn is not None and self._process is not None:
                try:
                    write_frame(self._conn.fileno(), np.asarray([OP_STOP], dtype=_WORD).tobytes())
                except OSError:
                    log.debug("draft %s: its child closed the pipe first", self.name)
                else:
                    self._process.join(STOP_TIMEOUT_S)
            self._kill()
