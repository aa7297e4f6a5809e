"""`specfleet bench round-floor`: what a direct round's hops cost on this host, with nothing else.

A direct round (docs/protocol.md) crosses the broker twice (the device's draft up, the verdict
down), the pipe to the verifier's inference process twice, and commits once. `bench e2e` measures
the whole round's overhead beyond compute (part 3); this benchmark measures the same hops alone,
with the processes placed as `bench e2e` places them (the compute on the target's core, the
rest on the others), and no specfleet code on the path but the bus client:

- **pipe**: a process hands a small message to a child on the target's core, which computes
  (spins) for `--compute-ms` and answers; the round trip less the child's compute. Between two
  rounds the sender waits `--gap-ms` (a round's time on the bus), so the child waits as a
  verifier's inference process waits for the next draft.
- **bus**: a device process publishes a draft-sized payload (QoS 1, on its `direct` topic) to a
  private Mosquitto; a verifier process holds it `--compute-ms` (idle, as while its pass runs
  elsewhere) and publishes a verdict-sized payload back; the device's wait less the verifier's
  hold.
- **bus + pipe**: both, as a direct round has them: the verifier hands each draft to its child.
  The device's wait less the child's compute: `bench e2e`'s overhead with no specfleet in it.
- **commit**: the round writer's commit of one round (SQLite, a scratch database), back to back
  and then one every `--compute-ms`, as rounds come: the same work, with the CPU's caches gone
  cold between commits.

Every round's wake-ups cross idle CPUs here, and a virtual machine's idle CPU wakes slower than
a busy one. The sum of `bus + pipe` and a commit at the round's pace is the overhead no design
with these hops goes under on the host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import struct
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import cpus
from core.report import add_json_argument, format_table, median, percentile, write_json

DEFAULT_JSON = Path("bench-results/round-floor.json")
DEVICE_ID = "floor-dev"
DRAFT_BYTES = 320  # a hybrid window's Draft, encoded
VERDICT_BYTES = 260  # its Verdict
WARMUP = 20
_HELD = struct.Struct("<d")  # what the verifier side held the round, ms, ahead of the padding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    parser.add_argument("--rounds", type=int, default=300, help="rounds per leg (default 300)")
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=30.0,
        help="the target's pass a round waits on (default 30: one session's on a 2-vCPU host)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=2.0,
        help="the pipe leg's wait between rounds, as the bus's round trip (default 2)",
    )


@dataclass(frozen=True)
class Placement:
    """The target's core and the others' (None: one CPU, nothing pinned)."""

    target: set[int] | None
    others: set[int] | None

    @classmethod
    def here(cls) -> Placement:
        found = cpus.split(cpus.available())
        return cls(None, None) if found is None else cls(*found)

    def pin(self, pid: int, *, target: bool = False) -> None:
        """`pid`'s threads and its children's onto the target's core, or the others' (what
        it starts after inherits that)."""
        cpus_for = self.target if target else self.others
        if cpus_for is not None:
            cpus.pin_tree(pid, cpus_for)

    def describe(self) -> str:
        if self.target is None:
            return "one CPU: nothing pinned"
        return f"compute on CPU {sorted(self.target)}; the rest on CPUs {sorted(self.others or ())}"


def run(args: argparse.Namespace) -> int:
    from broker.mosquitto import PrivateMosquitto
    from core.errors import CommandError

    if args.rounds < 1:
        raise CommandError("--rounds must be at least 1")
    if args.compute_ms <= 0 or args.gap_ms < 0:
        raise CommandError("--compute-ms must be above 0 and --gap-ms at least 0")
    placement = Placement.here()
    placement.pin(os.getpid())  # and so every process it starts, but for the children it pins
    print(f"placement: {placement.describe()}; compute {args.compute_ms} ms a round")
    legs: dict[str, list[float]] = {}
    legs["pipe"] = asyncio.run(_pipe_rounds(placement, args))
    with PrivateMosquitto() as broker:
        for label, piped in (("bus", False), ("bus + pipe", True)):
            legs[label] = _bus_rounds(broker.url, piped, placement, args, label)
    back_to_back, paced = _commit_rounds(args)
    legs["commit, back to back"] = back_to_back
    legs["commit, one a round"] = paced
    rows = [
        {
            "leg": leg,
            "rounds": len(values),
            "p50_ms": median(values),
            "p99_ms": percentile(values, 99),
        }
        for leg, values in legs.items()
    ]
    floor = median(legs["bus + pipe"]) + median(legs["commit, one a round"])
    table = [[r["leg"], r["rounds"], r["p50_ms"], r["p99_ms"]] for r in rows]
    print(format_table(["leg", "rounds", "p50 ms", "p99 ms"], table))
    cold = median(legs["commit, one a round"]) / median(legs["commit, back to back"])
    print(f"a direct round's floor (bus + pipe, and a commit a round), p50: {floor:.2f} ms")
    print(f"a commit a round against back to back: {cold:.2f}x")
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "round-floor",
                "compute_ms": args.compute_ms,
                "gap_ms": args.gap_ms,
                "placement": placement.describe(),
                "results": rows,
                "floor_p50_ms": floor,
                "commit_paced_over_back_to_back": cold,
            },
        )
        print(f"wrote {args.json}")
    return 0


# -- the pipe ----------------------------------------------------------------------------------


def _child(conn: Connection) -> None:
    """Spin `compute_ms` for each message and answer with what it spun."""
    while True:
        try:
            compute_ms = conn.recv()
        except EOFError:
            return
        if compute_ms is None:
            return
        started = time.perf_counter()
        while (time.perf_counter() - started) * 1e3 < compute_ms:
            pass
        conn.send((time.perf_counter() - started) * 1e3)


class _Child:
    """A spinning child on the target's core, reached as the verifier reaches its own: the
    event loop waits on the pipe's descriptor."""

    def __init__(self, placement: Placement) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(target=_child, args=(theirs,))
        self._process.start()
        theirs.close()
        assert self._process.pid is not None  # started
        placement.pin(self._process.pid, target=True)

    async def compute(self, compute_ms: float) -> float:
        """The child's compute, ms, once it has answered."""
        loop = asyncio.get_running_loop()
        self._conn.send(compute_ms)
        while not self._conn.poll():
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self._conn.fileno(), readable.set_result, None)
            try:
                await readable
            finally:
                loop.remove_reader(self._conn.fileno())
        answer: float = self._conn.recv()
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


async def _pipe_rounds(placement: Placement, args: argparse.Namespace) -> list[float]:
    child = _Child(placement)
    overheads: list[float] = []
    try:
        for i in tqdm(range(WARMUP + args.rounds), desc="pipe", unit="round"):
            await asyncio.sleep(args.gap_ms / 1e3)
            started = time.perf_counter()
            compute_ms = await child.compute(args.compute_ms)
            if i >= WARMUP:
                overheads.append((time.perf_counter() - started) * 1e3 - compute_ms)
    finally:
        child.close()
    return overheads


# -- the bus -----------------------------------------------------------------------------------


def _verifier(url: str, piped: bool, placement: Placement, compute_ms: float, ready: Any) -> None:
    asyncio.run(_verifier_main(url, piped, placement, compute_ms, ready))


async def _verifier_main(
    url: str, piped: bool, placement: Placement, compute_ms: float, ready: Any
) -> None:
    from broker.client import BrokerAddress, ConnectOptions, connect
    from broker.topics import DeviceChannel, device_topic

    child = _Child(placement) if piped else None
    options = ConnectOptions(client_id=f"floor-verifier-{uuid.uuid4().hex[:8]}")
    try:
        async with connect(BrokerAddress.from_url(url), options) as bus:
            await bus.subscribe(device_topic(DEVICE_ID, DeviceChannel.DIRECT))
            ready.set()
            verdicts = device_topic(DEVICE_ID, DeviceChannel.VERDICT)
            async for incoming in bus.messages():
                if incoming.payload == b"stop":
                    return
                received = time.perf_counter()
                if child is not None:
                    held_ms = await child.compute(compute_ms)
                else:
                    await asyncio.sleep(compute_ms / 1e3)
                    held_ms = (time.perf_counter() - received) * 1e3
                payload = _HELD.pack(held_ms) + b"v" * (VERDICT_BYTES - _HELD.size)
                await bus.publish(verdicts, payload)
    finally:
        if child is not None:
            child.close()


def _bus_rounds(
    url: str, piped: bool, placement: Placement, args: argparse.Namespace, label: str
) -> list[float]:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    verifier = context.Process(
        target=_verifier, args=(url, piped, placement, args.compute_ms, ready)
    )
    verifier.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the verifier side did not connect to the broker within 30 s")
        overheads: list[float] = asyncio.run(_device_rounds(url, args, label))
        return overheads
    finally:
        verifier.join(10)
        if verifier.is_alive():
            verifier.kill()
            verifier.join()


async def _device_rounds(url: str, args: argparse.Namespace, label: str) -> list[float]:
    from broker.client import BrokerAddress, ConnectOptions, connect
    from broker.topics import DeviceChannel, device_topic

    options = ConnectOptions(client_id=f"floor-device-{uuid.uuid4().hex[:8]}")
    direct = device_topic(DEVICE_ID, DeviceChannel.DIRECT)
    overheads: list[float] = []
    async with connect(BrokerAddress.from_url(url), options) as bus:
        await bus.subscribe(device_topic(DEVICE_ID, DeviceChannel.VERDICT))
        verdicts = bus.messages()
        for i in tqdm(range(WARMUP + args.rounds), desc=label, unit="round"):
            started = time.perf_counter()
            await bus.publish(direct, b"d" * DRAFT_BYTES)
            verdict = await anext(verdicts)
            waited_ms = (time.perf_counter() - started) * 1e3
            (held_ms,) = _HELD.unpack_from(verdict.payload)
            if i >= WARMUP:
                overheads.append(waited_ms - held_ms)
        await bus.publish(direct, b"stop")
    return overheads


# -- the commit --------------------------------------------------------------------------------


def _commit_rounds(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The round writer's commit of a round, back to back and one every compute_ms."""
    with tempfile.TemporaryDirectory(prefix="specfleet-round-floor-") as scratch:
        return asyncio.run(_commits(f"sqlite:///{scratch}/floor.db", args))


async def _commits(url: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    from broker.messages import Mode
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine, make_sessionmaker
    from coordinator.db.models import DecodingSession, Round, SessionStatus
    from coordinator.db.registry import DeviceRegistry
    from coordinator.db.round_writer import RoundWriter

    engine = make_engine(url)
    migrate.upgrade(engine)
    sessions = make_sessionmaker(engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE_ID, "pi")
    prompt = list(range(100, 300))
    session_id = uuid.uuid4()
    with sessions.begin() as db:
        db.add(
            DecodingSession(
                id=session_id, device_id=DEVICE_ID, task_type="chat", prompt="floor",
                prompt_ids=prompt, temperature=0.0, top_p=1.0, seed=0, max_tokens=100_000,
                mode=Mode.DISTRIBUTED, draft_model="hybrid", k=8,
                status=SessionStatus.ACTIVE, committed_ids=[], committed_len=len(prompt),
            )
        )  # fmt: skip
    writer = RoundWriter(engine)
    running = asyncio.create_task(writer.run(), name="round-floor-writer")
    generated = list(range(1000, 1150))  # the same answer's length every round: the same work
    index = 0

    async def commit() -> float:
        nonlocal index
        base_len = len(prompt) + 3 * index
        row = Round(
            session_id=session_id, round_index=index, base_len=base_len,
            draft_tokens=[7, 8, 5, 5], draft_model="hybrid", k=4, n_accepted=2, next_token=9,
            committed_len=base_len + 3, verifier_id="floor", policy={"k": 4},
            t_draft_ms=0.5, t_verify_ms=args.compute_ms,
        )  # fmt: skip
        index += 1
        started = time.perf_counter()
        await writer.write(row, generated, SessionStatus.ACTIVE, device_id=DEVICE_ID)
        return (time.perf_counter() - started) * 1e3

    back_to_back: list[float] = []
    paced: list[float] = []
    try:
        for i in tqdm(range(WARMUP + args.rounds), desc="commit, back to back", unit="round"):
            took = await commit()
            if i >= WARMUP:
                back_to_back.append(took)
        for i in tqdm(range(WARMUP + args.rounds), desc="commit, one a round", unit="round"):
            await asyncio.sleep(args.compute_ms / 1e3)
            took = await commit()
            if i >= WARMUP:
                paced.append(took)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        engine.dispose()
    return back_to_back, paced
