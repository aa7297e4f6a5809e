"""`specfleet demo`: a fleet on one machine answers the shared prompts, streams, tabulates."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import httpx

from core.report import format_table, write_json
from localfleet.fleet import AgentSpec, LocalFleet, local_fleet
from localfleet.prompts import DEFAULT_PROMPTS, BenchPrompt, read_prompts

if TYPE_CHECKING:
    from core.settings import Settings

# Three devices, three drafters: prompt lookup and a 4-gram table in front of the distilled
# 1-layer draft on LiteRT; that draft alone on ONNX Runtime; lookup and the table alone.
DEMO_AGENTS = (
    AgentSpec("demo-pi", "pi", "hybrid+draft-l1", "tflite"),
    AgentSpec("demo-jetson", "jetson", "draft-l1", "onnx"),
    AgentSpec("demo-phone", "phone", "hybrid", "none"),
)
DEMO_VERIFIERS = ("demo-verifier-1", "demo-verifier-2")


class TokenStream:
    """Several sessions' answers, streamed into one terminal at once.

    On a terminal (`live`), each running session has a line at the bottom that grows token by
    token as its tokens arrive; a finished line scrolls up, labelled, above them. Elsewhere (a
    pipe, a log), each line is written once it is complete, so that sessions never interleave
    within a line.
    """

    def __init__(self, out: TextIO, *, live: bool | None = None) -> None:
        self._out = out
        self._live = out.isatty() if live is None else live
        self._open: dict[str, str] = {}  # label -> its unfinished line
        self._drawn = 0  # live lines on screen below the finished ones

    def write(self, label: str, delta: str) -> None:
        *done, current = (self._open.get(label, "") + delta).split("\n")
        self._clear()
        for line in done:
            self._out.write(f"[{label}] {line}\n")
        self._open[label] = current
        self._draw()

    def end(self, label: str) -> None:
        """The session is done: its unfinished line becomes a finished one."""
        self._clear()
        rest = self._open.pop(label, "")
        if rest:
            self._out.write(f"[{label}] {rest}\n")
        self._draw()

    def _clear(self) -> None:
        if self._drawn:
            # Up to the first live line's start, then erase to the end of the screen.
            self._out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self) -> None:
        if self._live:
            width = shutil.get_terminal_size().columns - 1
            for label, text in self._open.items():
                line = f"[{label}] {text}"
                # A live line never wraps (a wrapped one would not be erased): its tail shows.
                self._out.write((line if len(line) <= width else "…" + line[-width + 1 :]) + "\n")
            self._drawn = len(self._open)
        self._out.flush()


async def ask(
    client: httpx.AsyncClient,
    port: int,
    request: dict[str, Any],
    label: str,
    stream: bool,
    printer: TokenStream | None = None,
) -> dict[str, Any]:
    """One session through an agent's local API; with `stream`, its text goes to the terminal
    token by token (through `printer`, shared by concurrent sessions, or a private one).

    Returns the agent's summary of the session (session_id, token_ids, text, rounds, ...).
    """
    out = printer or TokenStream(sys.stdout)
    summary: dict[str, Any] = {}
    event = ""
    async with client.stream(
        "POST", f"http://127.0.0.1:{port}/v1/sessions", json=request, timeout=None
    ) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"{label}: agent refused the session: {body}")
        async for raw in response.aiter_lines():
            if raw.startswith("event:"):
                event = raw[6:].strip()
            elif raw.startswith("data:"):
                data = json.loads(raw[5:].strip())
                if event == "text" and stream:
                    out.write(label, data["delta"])
                elif event == "done":
                    summary = data
                elif event == "error":
                    raise RuntimeError(f"{label}: {data}")
    if stream:
        out.end(label)
    return summary


def demo_settings(args: argparse.Namespace) -> Settings:
    from core.settings import Settings

    settings = Settings()
    if args.database_url:
        settings = settings.model_copy(update={"database_url": args.database_url})
    return settings


def log_to_file(path: Path, log_format: str) -> None:
    """This process's log goes to `path`, not between the streamed answers (`-v` keeps it on
    the terminal); the fleet's other processes log beside it."""
    from core.logs import TEXT_FORMAT, JsonFormatter

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.FileHandler(path)
    json_lines = log_format == "json"
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)


async def run_demo(
    args: argparse.Namespace, prompts: list[BenchPrompt], settings: Settings, workdir: Path
) -> tuple[list[dict[str, Any]], float]:
    """The sessions' results, and the seconds the fleet spent answering (start-up excluded)."""
    from coordinator.stack import home_lock
    from modelbuild.distill import ensure_drafts
    from modelbuild.target_build import ensure_target

    target_dir = await asyncio.to_thread(ensure_target, settings.resolved_models_dir)
    # The drafts are built from the weights committed in models/drafts/ (once; then cached).
    await asyncio.to_thread(ensure_drafts, settings.resolved_models_dir, target_dir)
    agents = list(DEMO_AGENTS[: args.agents])
    verifiers = list(DEMO_VERIFIERS[: args.verifiers])
    print(
        f"starting {len(verifiers)} verifiers and {len(agents)} agents (logs in {workdir})",
        flush=True,
    )
    own_broker = args.broker is None  # its files live in the home, as `up`'s do
    with home_lock(settings.home, "demo") if own_broker else contextlib.nullcontext():
        async with local_fleet(
            settings,
            agents,
            verifiers,
            workdir=workdir,
            external_broker=args.broker,
            local_broker=args.local_broker,
        ) as fleet:
            own = fleet.own_broker
            if own is not None:
                print(f"broker    {own.device_url}  {own.description}", flush=True)
            else:
                print(f"broker    {fleet.broker_url}  (external)", flush=True)
            print(f"database  {settings.database_url}", flush=True)
            started = time.perf_counter()
            results = await _answer_all(fleet, agents, prompts, args)
            return results, time.perf_counter() - started


async def _answer_all(
    fleet: LocalFleet, agents: list[AgentSpec], prompts: list[BenchPrompt], args: argparse.Namespace
) -> list[dict[str, Any]]:
    queues: dict[str, list[BenchPrompt]] = {spec.device_id: [] for spec in agents}
    for index, prompt in enumerate(prompts):
        queues[agents[index % len(agents)].device_id].append(prompt)
    results: list[dict[str, Any]] = []
    printer = TokenStream(sys.stdout)
    async with httpx.AsyncClient() as client:

        async def serve(spec: AgentSpec) -> None:
            for prompt in queues[spec.device_id]:
                started = time.perf_counter()
                request: dict[str, Any] = {
                    "prompt": prompt.prompt,
                    "task_type": prompt.task,
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "seed": args.seed,
                }
                if args.k is not None:
                    request["k"] = args.k
                label = f"{spec.device_id} {prompt.id}"
                port = fleet.agent_ports[spec.device_id]
                summary = await ask(client, port, request, label, not args.quiet, printer)
                summary.setdefault("wall_s", time.perf_counter() - started)
                results.append(
                    {
                        "prompt_id": prompt.id,
                        "task": prompt.task,
                        "prompt": prompt.prompt,
                        "device_id": spec.device_id,
                        "draft": spec.draft,
                        "runtime": spec.runtime,
                        **summary,
                    }
                )

        await asyncio.gather(*(serve(spec) for spec in agents))
    await asyncio.to_thread(_add_verifiers, fleet, results)
    return results


def _add_verifiers(fleet: LocalFleet, results: list[dict[str, Any]]) -> None:
    """Which verifiers served each session, from the rounds in the database."""
    import sqlalchemy as sa

    from coordinator.db.models import Round

    with fleet.coordinator.sessions() as db:
        for result in results:
            session_id = result.get("session_id")
            if not session_id:
                continue
            served = db.scalars(
                sa.select(Round.verifier_id).where(Round.session_id == uuid.UUID(session_id))
            ).all()
            counts = Counter(v for v in served if v)
            result["verifiers"] = dict(counts)


@dataclass(frozen=True)
class TargetAlone:
    """One prompt answered by the target alone, one token per pass, nothing else running."""

    tokens: int
    decode_s: float  # after the prefill, as the sessions' tokens/s counts
    total_s: float  # with the prefill
    same: bool | None  # its tokens equal the session's (greedy only; None when sampling)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0


def target_alone(
    results: list[dict[str, Any]], args: argparse.Namespace, settings: Settings
) -> dict[str, TargetAlone]:
    """The baseline of the table's last columns, by prompt id: the target decodes each prompt by
    itself, after the fleet has stopped, so that it has the machine to itself."""
    from tqdm import tqdm

    from inference.sampling import SamplingParams
    from inference.speculative import decode_target
    from modelbuild.target_build import load_target

    target, tokenizer = load_target(settings.resolved_models_dir, threads=1)
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    greedy = args.temperature == 0
    baseline: dict[str, TargetAlone] = {}
    for result in tqdm(results, desc="target alone", unit="prompt"):
        ids = tokenizer.apply_chat_template(result["prompt"])
        decoded = decode_target(target, ids, args.max_tokens, params, tokenizer.eos_id)
        session = result.get("token_ids")
        baseline[result["prompt_id"]] = TargetAlone(
            tokens=len(decoded.tokens),
            decode_s=decoded.decode_ms / 1e3,
            total_s=decoded.total_ms / 1e3,
            same=(decoded.tokens == session) if greedy and session is not None else None,
        )
    return baseline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSONL prompts (id, task, prompt); default ../shared/bench/prompts.jsonl",
    )
    parser.add_argument("--limit", type=int, default=None, help="answer the first N prompts only")
    parser.add_argument("--max-tokens", type=int, default=96, help="per answer (default 96)")
    parser.add_argument(
        "--k", type=int, default=None, help="speculation window (default: each drafter's own)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the sessions")
    parser.add_argument(
        "--agents", type=int, default=3, choices=[1, 2, 3], help="device agents (default 3)"
    )
    parser.add_argument(
        "--verifiers", type=int, default=2, choices=[1, 2], help="verifier workers (default 2)"
    )
    parser.add_argument(
        "--broker", metavar="URL", help="an external broker instead of one of the demo's own"
    )
    parser.add_argument(
        "--local-broker",
        choices=("auto", "mosquitto", "amqtt"),
        default="auto",
        help="without --broker: a private Mosquitto with the production config (ACLs, "
        "TCP_NODELAY, MQTT 5) where it is installed (auto, the default), or the pure-Python amqtt",
    )
    parser.add_argument("--database-url", metavar="URL", help="instead of the SQLite default")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the per-session results as JSON",
    )
    parser.add_argument("--quiet", action="store_true", help="no streaming, the table only")
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the target alone on the same prompts (one pass per token, about 40 ms each "
        "on one CPU core) and the speedup columns",
    )


def _prompts_path(args: argparse.Namespace) -> Path:
    if args.prompts is not None:
        return Path(args.prompts)
    # Installed or not, the shared prompts sit beside the repository.
    for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
        candidate = base.parent / "shared" / "bench" / "prompts.jsonl"
        if candidate.exists():
            return candidate
    return DEFAULT_PROMPTS


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError

    if args.max_tokens < 1 or (args.k is not None and args.k < 1) or args.temperature < 0:
        raise CommandError("--max-tokens and --k must be >= 1, --temperature >= 0")
    path = _prompts_path(args)
    try:
        prompts = read_prompts(path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read prompts: {exc}") from exc
    if args.limit is not None:
        prompts = prompts[: args.limit]
    from coordinator.stack import StackError

    settings = demo_settings(args)
    workdir = Path(tempfile.mkdtemp(prefix="specfleet-demo-"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to the agents
    if not getattr(args, "verbose", False):
        log_to_file(workdir / "demo.log", getattr(args, "log_format", "text"))
    try:
        results, fleet_s = asyncio.run(run_demo(args, prompts, settings, workdir))
    except StackError as exc:
        raise CommandError(str(exc)) from exc
    results.sort(key=lambda r: r["prompt_id"])
    baseline = target_alone(results, args, settings) if args.baseline else {}
    print()
    print(results_table(results, baseline))
    if baseline:
        print(throughput_line(results, baseline, fleet_s))
    if args.json is not None:
        document: dict[str, Any] = {"sessions": results, "answering_s": fleet_s}
        if baseline:
            document["target_alone"] = {
                prompt_id: {
                    "tokens": b.tokens,
                    "decode_s": b.decode_s,
                    "total_s": b.total_s,
                    "tokens_per_s": b.tokens_per_s,
                    "same_tokens": b.same,
                }
                for prompt_id, b in baseline.items()
            }
        write_json(args.json, document)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _same(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def results_table(results: list[dict[str, Any]], baseline: dict[str, TargetAlone]) -> str:
    """One row per session; with a baseline, the target alone's tokens/s on the same prompt,
    the session's speedup over it, and whether the two answers are the same tokens."""
    headers = ["prompt", "device", "draft", "tokens", "α", "tokens/s", "rounds", "verifier"]
    if baseline:
        headers += ["target tok/s", "speedup", "same"]
    rows = []
    for r in results:
        row = [
            r["prompt_id"],
            r["device_id"],
            r["draft"],
            r.get("tokens", 0),
            r.get("alpha", 0.0),
            r.get("tokens_per_s", 0.0),
            r.get("rounds", 0),
            ",".join(sorted(r.get("verifiers", {}))),
        ]
        alone = baseline.get(r["prompt_id"])
        if alone is not None:
            speedup = r.get("tokens_per_s", 0.0) / alone.tokens_per_s if alone.tokens_per_s else 0
            row += [f"{alone.tokens_per_s:.1f}", f"{speedup:.2f}x", _same(alone.same)]
        rows.append(row)
    return format_table(headers, rows)


def throughput_line(
    results: list[dict[str, Any]], baseline: dict[str, TargetAlone], fleet_s: float
) -> str:
    """The fleet's throughput against the target answering the same prompts one at a time."""
    fleet_tokens = sum(int(r.get("tokens", 0)) for r in results)
    alone_tokens = sum(b.tokens for b in baseline.values())
    alone_s = sum(b.total_s for b in baseline.values())
    fleet_rate = fleet_tokens / fleet_s if fleet_s > 0 else 0.0
    alone_rate = alone_tokens / alone_s if alone_s > 0 else 0.0
    same = [b.same for b in baseline.values() if b.same is not None]
    identical = f"; {sum(same)} of {len(same)} answers token-identical" if same else ""
    return (
        f"fleet (DSD): {fleet_tokens} tokens in {fleet_s:.1f} s of answering, "
        f"{fleet_rate:.1f} tokens/s | target alone, one prompt at a time: {alone_tokens} tokens in "
        f"{alone_s:.1f} s, {alone_rate:.1f} tokens/s | "
        f"speedup {fleet_rate / alone_rate if alone_rate else 0:.2f}x{identical}"
    )
