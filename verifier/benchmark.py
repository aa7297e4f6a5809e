"""Verify latency per batch size: the core in-process, and the worker over a private Mosquitto.

For 1, 4 and 16 concurrent sessions (k drafted tokens each), every round sends one request per
session and waits for all results. The same rounds run three ways: `VerifierCore.verify_batch`
in this process (model compute only), then through a `VerifierWorker` whose child reports its
compute time, so that the pipe hop per batch (`roundtrip - compute`) and the bus, JSON and
batching window per round (`end to end - roundtrips`) come out separately. Contexts grow by each
round's verdict, as in a real session. The core also runs every round a second time on caches
of its own with each request asking for the target's features (a feature drafter's rounds), in
alternating order, so `core_features_p50_ms` against `core_p50_ms` is what features cost a pass.
Follows the `add_arguments`/`run` convention of the `specfleet bench` commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from broker.client import BrokerAddress, BusClient, ConnectOptions, connect
from broker.messages import DeviceState, VerifierStatus, VerifyRequest, VerifyResult, decode, encode
from broker.mosquitto import PrivateMosquitto
from core.aio import task_group, timeout
from core.report import format_table, median, percentile, write_json
from verifier.child import ChildConfig, InferenceChild
from verifier.worker import BATCH_WINDOW_MS, BatchTiming, VerifierWorker, WorkerConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
SESSIONS = (1, 4, 16)
K = 4
RESULT_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, nargs="+", default=list(SESSIONS))
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds per size")
    parser.add_argument("--k", type=int, default=K, help="drafted tokens per request")
    parser.add_argument("--threads", type=int, default=None, help="ORT intra-op threads")
    parser.add_argument("--batch-window-ms", type=float, default=BATCH_WINDOW_MS)
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument(
        "--core-only", action="store_true", help="measure the core alone (no worker, no bus)"
    )
    parser.add_argument(
        "--json", type=Path, nargs="?", const=Path("bench-results/verifier.json"), default=None,
        help="write the results as JSON (default path bench-results/verifier.json)",
    )  # fmt: skip


def load_prompts(path: Path, count: int) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    prompts = [str(json.loads(line)["prompt"]) for line in lines]
    return [prompts[i % len(prompts)] for i in range(count)]


def draft_for(context: list[int], k: int) -> list[int]:
    """A cheap stand-in for a drafter: the k tokens before the last (compute ignores acceptance)."""
    return context[-k - 1 : -1] if len(context) > k else context[:k]


@dataclass
class _Sessions:
    """Contexts of n sessions, advanced by their verdicts."""

    ids: list[str]
    contexts: list[list[int]]
    round: int = 0

    def requests(self, k: int, want_features: bool = False) -> list[VerifyRequest]:
        return [
            VerifyRequest(
                request_id=uuid.uuid4().hex,
                session_id=session_id,
                round=self.round,
                context_ids=tuple(context),
                tokens=tuple(draft_for(context, k)),
                want_features=want_features or None,
            )
            for session_id, context in zip(self.ids, self.contexts, strict=True)
        ]

    def advance(self, requests: list[VerifyRequest], verdicts: list[tuple[int, int]]) -> None:
        for context, request, (n_accepted, next_token) in zip(
            self.contexts, requests, verdicts, strict=True
        ):
            context += [*request.tokens[:n_accepted], next_token]
        self.round += 1


def measure_core(
    models_dir: Path | None, threads: int | None, prompts: list[list[int]], rounds: int, k: int
) -> tuple[list[float], list[float]]:
    """Milliseconds of `verify_batch` per round, all sessions in one call, caches warm: plain
    rounds, and the same rounds asking for features (each on caches of its own)."""
    from modelbuild.target_build import load_target
    from verifier.core import VerifierCore

    runtime, _ = load_target(models_dir, threads=threads)
    runs = {asked: (VerifierCore(runtime), _Sessions(
        [f"core-{i}" for i in range(len(prompts))], [list(p) for p in prompts]
    )) for asked in (False, True)}  # fmt: skip
    times: dict[bool, list[float]] = {False: [], True: []}
    for index in tqdm(range(rounds + 1), desc=f"core x{len(prompts)}", leave=False):
        # Alternate which goes first, so that neither always runs on a warmer machine.
        for asked in (False, True) if index % 2 else (True, False):
            core, sessions = runs[asked]
            requests = sessions.requests(k, want_features=asked)
            started = time.perf_counter()
            results = core.verify_batch(requests)
            if index > 0:  # round 0 prefills
                times[asked].append((time.perf_counter() - started) * 1e3)
            sessions.advance(requests, [(r.n_accepted, r.next_token or 0) for r in results])
    return times[False], times[True]


class _Results:
    def __init__(self, client: BusClient) -> None:
        self.client = client
        self.results: dict[str, VerifyResult] = {}
        self.online = asyncio.Event()
        self._arrived = asyncio.Event()

    async def listen(self) -> None:
        async for incoming in self.client.messages():
            message = decode(incoming.payload)
            if isinstance(message, VerifyResult):
                self.results[message.request_id] = message
                self._arrived.set()
            elif isinstance(message, VerifierStatus) and message.state == DeviceState.ONLINE:
                self.online.set()

    async def wait_for(self, request_ids: list[str]) -> list[VerifyResult]:
        async with timeout(RESULT_TIMEOUT_S):
            while not all(r in self.results for r in request_ids):
                self._arrived.clear()
                await self._arrived.wait()
        return [self.results.pop(r) for r in request_ids]


@dataclass(frozen=True)
class WorkerRun:
    end_to_end_ms: list[float]  # publish of the first request to the last result, per round
    roundtrip_ms: list[float]  # per round, the child's batches end to end (pipe included)
    compute_ms: list[float]  # per round, verify_batch inside the child
    batches: list[BatchTiming]


async def measure_worker(
    url: str, config: WorkerConfig, prompts: list[list[int]], rounds: int, k: int
) -> WorkerRun:
    address = BrokerAddress.from_url(url)
    worker = VerifierWorker(config, address)
    e2e: list[float] = []
    roundtrips: list[float] = []
    computes: list[float] = []
    batches: list[BatchTiming] = []
    sessions = _Sessions([f"bus-{i}" for i in range(len(prompts))], [list(p) for p in prompts])
    async with connect(address, ConnectOptions(client_id=f"bench-{uuid.uuid4().hex}")) as client:
        await client.subscribe(worker.result_topic)
        await client.subscribe(worker.status_topic)
        results = _Results(client)
        async with task_group() as tasks:
            listening = tasks.create_task(results.listen(), name="bench-results")
            serving = tasks.create_task(worker.run(), name="bench-verifier")
            await results.online.wait()
            for index in tqdm(range(rounds + 1), desc=f"worker x{len(prompts)}", leave=False):
                requests = sessions.requests(k)
                seen = len(worker.counters.timings)
                started = time.perf_counter()
                await asyncio.gather(
                    *(client.publish(worker.work_topic, encode(r)) for r in requests)
                )
                got = await results.wait_for([r.request_id for r in requests])
                elapsed = (time.perf_counter() - started) * 1e3
                if any(r.error for r in got):
                    raise RuntimeError(f"verifier error: {next(r.error for r in got if r.error)}")
                round_batches = list(worker.counters.timings)[seen:]
                if index > 0:
                    e2e.append(elapsed)
                    roundtrips.append(sum(b.roundtrip_ms for b in round_batches))
                    computes.append(sum(b.compute_ms for b in round_batches))
                    batches += round_batches
                sessions.advance(requests, [(r.n_accepted, r.next_token or 0) for r in got])
            serving.cancel()
            listening.cancel()
    return WorkerRun(e2e, roundtrips, computes, batches)


async def measure_pipe(config: ChildConfig, count: int) -> list[float]:
    """Milliseconds of an empty batch to the child and back: the hop with no compute in it."""
    child = InferenceChild(config, name="bench-pipe")
    await child.start()
    try:
        times: list[float] = []
        for _ in range(count):
            started = time.perf_counter()
            await child.verify([], timeout_s=RESULT_TIMEOUT_S)
            times.append((time.perf_counter() - started) * 1e3)
        return times
    finally:
        child.stop()


def run(args: argparse.Namespace) -> int:
    from inference.tokenizer import ChatTokenizer
    from modelbuild.target_build import ensure_target

    tokenizer = ChatTokenizer.load(ensure_target(args.models_dir))
    rows: list[dict[str, Any]] = []
    with PrivateMosquitto() as broker:
        for n in args.sessions:
            prompts = [tokenizer.apply_chat_template(p) for p in load_prompts(args.prompts, n)]
            core_ms, features_ms = measure_core(
                args.models_dir, args.threads, prompts, args.rounds, args.k
            )
            core_row = {
                "sessions": n,
                "k": args.k,
                "rounds": args.rounds,
                "core_p50_ms": median(core_ms),
                "core_features_p50_ms": median(features_ms),
                # The fastest round of each: on a shared machine, the one least disturbed.
                "core_min_ms": min(core_ms),
                "core_features_min_ms": min(features_ms),
                "features_cost_pct": 100.0 * (median(features_ms) / median(core_ms) - 1.0),
            }
            if args.core_only:
                rows.append(core_row)
                continue
            config = WorkerConfig(
                f"bench-{uuid.uuid4().hex[:8]}",
                child=ChildConfig(models_dir=args.models_dir, threads=args.threads),
                max_batch=max(args.sessions),
                batch_window_ms=args.batch_window_ms,
            )
            w = asyncio.run(measure_worker(broker.url, config, prompts, args.rounds, args.k))
            pipe = [b.roundtrip_ms - b.compute_ms for b in w.batches]  # per batch
            bus = [e - r for e, r in zip(w.end_to_end_ms, w.roundtrip_ms, strict=True)]
            rows.append(
                {
                    **core_row,
                    "window_ms": args.batch_window_ms,
                    "mean_batch": sum(b.size for b in w.batches) / len(w.batches),
                    "child_compute_p50_ms": median(w.compute_ms),
                    "pipe_hop_p50_ms": median(pipe),
                    "pipe_hop_p90_ms": percentile(pipe, 90),
                    "bus_and_window_p50_ms": median(bus),
                    "end_to_end_p50_ms": median(w.end_to_end_ms),
                    "end_to_end_p90_ms": percentile(w.end_to_end_ms, 90),
                    "per_session_p50_ms": median(w.end_to_end_ms) / n,
                }
            )
    headers = list(rows[0])
    print(format_table(headers, [[row[h] for h in headers] for row in rows]))
    idle: list[float] = []
    if not args.core_only:
        idle = asyncio.run(measure_pipe(ChildConfig(args.models_dir, threads=args.threads), 200))
        p50, p90 = median(idle), percentile(idle, 90)
        print(f"empty batch through the pipe: p50 {p50:.3f} ms, p90 {p90:.3f} ms")
    if args.json is not None:
        document = {"benchmark": "verifier", "rows": rows, "empty_batch_pipe_ms": idle}
        write_json(args.json, document)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
