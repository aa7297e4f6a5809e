"""`specfleet bench soak`: many short sessions opened and closed for minutes; does the coordinator
hold its memory?

A private Mosquitto, a coordinator (`specfleet up`, its own process, so its RSS is its own) and a
verifier with the real target run on this machine. Device workers in this process open a short
greedy session, draft its rounds, and close it, over and over (one in four is cancelled after two
rounds). The coordinator's RSS is sampled throughout; the report gives its growth after warm-up,
the sessions and rounds done, and every error: refusals, unanswered messages, and tracebacks in
the coordinator's log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.report import add_json_argument, format_table, write_json

DEFAULT_JSON = Path("bench-results/soak.json")
REPLY_TIMEOUT_S = 30.0
START_TIMEOUT_S = 180.0
# A chat-templated prompt's worth of ids inside the target's vocabulary (49,152); its content does
# not matter to the coordinator's memory.
PROMPT_IDS = (1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 504, 3575, 282)
CANCEL_EVERY = 4  # every fourth session is cancelled after CANCEL_AFTER_ROUNDS rounds
CANCEL_AFTER_ROUNDS = 2
# Each worker cycles through this many device ids, so that no device opens sessions faster than
# a real one would (the coordinator's per-device session-open quota stays out of the way).
DEVICES_PER_WORKER = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    parser.add_argument(
        "--warmup-minutes",
        type=float,
        default=None,
        help="RSS growth is measured from the end of this (default: a third of --minutes, "
        "at most 5)",
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="devices running sessions at once (default 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per session (default 8)")
    parser.add_argument(
        "--sample-s", type=float, default=5.0, help="RSS sampling interval (default 5 s)"
    )
    parser.add_argument("--database-url", metavar="URL", default=None, help="instead of SQLite")
    add_json_argument(parser, DEFAULT_JSON)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad input with a one-line reason (CommandError: exit status 2)."""
    from core.errors import CommandError

    if not 0 < args.minutes <= 24 * 60:
        raise CommandError("--minutes must be in (0, 1440]")
    if args.warmup_minutes is not None and not 0 <= args.warmup_minutes < args.minutes:
        raise CommandError("--warmup-minutes must be in [0, --minutes)")
    if not 1 <= args.workers <= 64:
        raise CommandError("--workers must be in 1..64")
    if not 2 <= args.max_tokens <= 256:
        raise CommandError("--max-tokens must be in 2..256")
    if not 0.1 <= args.sample_s <= 600:
        raise CommandError("--sample-s must be in 0.1..600")


def warmup_minutes(args: argparse.Namespace) -> float:
    if args.warmup_minutes is not None:
        return float(args.warmup_minutes)
    return min(5.0, float(args.minutes) / 3.0)


# --- what is measured ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What the workers did, and what went wrong."""

    opened: int = 0
    finished: int = 0
    cancelled: int = 0
    rounds: int = 0
    refusals: list[str] = field(default_factory=list)  # ErrorReply reasons
    timeouts: int = 0  # a message that got no answer in time

    @property
    def errors(self) -> int:
        return len(self.refusals) + self.timeouts


def rss_bytes(pid: int) -> int:
    """The resident set of a process: psutil where installed, else /proc."""
    try:
        import psutil
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {pid}") from None
    return int(psutil.Process(pid).memory_info().rss)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far (/proc; psutil where installed)."""
    try:
        import psutil
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def host_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    total = sum(fields[:8])  # guest time is counted in user already
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def growth(samples: list[tuple[float, int]], warmup_s: float) -> dict[str, Any]:
    """RSS after warm-up against the end of the run: the median of the first and of the last
    fifth of the samples taken after warm-up (a median each, so one GC pause moves neither)."""
    after = [rss for t, rss in samples if t >= warmup_s]
    if len(after) < 2:
        return {"samples_after_warmup": len(after), "growth_percent": None}
    fifth = max(1, len(after) // 5)
    start = statistics.median(after[:fifth])
    end = statistics.median(after[-fifth:])
    return {
        "samples_after_warmup": len(after),
        "rss_start_mb": start / 2**20,
        "rss_end_mb": end / 2**20,
        "rss_max_mb": max(after) / 2**20,
        "growth_percent": (end - start) / start * 100.0,
    }


def report(
    samples: list[tuple[float, int]], tally: Tally, tracebacks: int, args: argparse.Namespace
) -> dict[str, Any]:
    warmup_s = warmup_minutes(args) * 60.0
    document: dict[str, Any] = {
        "benchmark": "soak",
        "minutes": args.minutes,
        "warmup_minutes": warmup_minutes(args),
        "workers": args.workers,
        "max_tokens": args.max_tokens,
        "sessions_opened": tally.opened,
        "sessions_finished": tally.finished,
        "sessions_cancelled": tally.cancelled,
        "rounds": tally.rounds,
        "refusals": len(tally.refusals),
        "refusal_reasons": sorted(set(tally.refusals))[:20],
        "timeouts": tally.timeouts,
        "coordinator_tracebacks": tracebacks,
        "errors": tally.errors + tracebacks,
        "rss_samples": [{"t_s": round(t, 1), "rss_mb": rss / 2**20} for t, rss in samples],
        **growth(samples, warmup_s),
    }
    return document


def table(document: dict[str, Any]) -> str:
    growth_percent = document["growth_percent"]
    rows = [
        ["minutes", f"{document['minutes']:g} (warm-up {document['warmup_minutes']:g})"],
        ["sessions opened", document["sessions_opened"]],
        [
            "finished / cancelled",
            f"{document['sessions_finished']} / {document['sessions_cancelled']}",
        ],
        ["rounds", document["rounds"]],
        ["RSS after warm-up MB", _mb(document.get("rss_start_mb"))],
        ["RSS at the end MB", _mb(document.get("rss_end_mb"))],
        ["RSS max MB", _mb(document.get("rss_max_mb"))],
        ["RSS growth %", "n/a" if growth_percent is None else f"{growth_percent:+.2f}"],
        ["refusals", document["refusals"]],
        ["timeouts", document["timeouts"]],
        ["coordinator tracebacks", document["coordinator_tracebacks"]],
        ["errors", document["errors"]],
    ]
    return format_table(["coordinator soak", "value"], rows)


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


# --- the fleet and its load ---------------------------------------------------------------------


async def run_soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tqdm import tqdm

    from broker.mosquitto import PrivateMosquitto
    from coordinator.stack import VERIFIER_USER, prepare_database
    from core.settings import Settings
    from localfleet.fleet import FleetProcesses

    with PrivateMosquitto(workdir=_mkdir(workdir / "mosquitto")) as mosquitto:
        settings = Settings(
            home=workdir / "home",
            models_dir=Settings().resolved_models_dir,
            database_url=args.database_url or f"sqlite:///{workdir / 'soak.db'}",
            broker_url=mosquitto.url,
            coordinator_id=f"coordinator-soak-{secrets.token_hex(3)}",
        )
        engine = await asyncio.to_thread(prepare_database, settings)
        engine.dispose()
        fleet = FleetProcesses(
            settings=settings,
            broker_url=mosquitto.url,
            credentials={VERIFIER_USER: ""},
            workdir=_mkdir(workdir / "fleet"),
        )
        try:
            coordinator = fleet.start_coordinator()
            fleet.start_verifier("soak-verifier")
            await wait_for_verifier(mosquitto.url, fleet)
            tally = Tally()
            samples: list[tuple[float, int]] = []
            duration_s = args.minutes * 60.0
            started = time.monotonic()
            stop = asyncio.Event()
            with tqdm(total=round(duration_s), desc="soak", unit="s", file=sys.stderr) as bar:
                workers = [
                    asyncio.create_task(
                        device_worker(mosquitto.url, i, args.max_tokens, tally, stop),
                        name=f"soak-worker-{i}",
                    )
                    for i in range(args.workers)
                ]
                while (elapsed := time.monotonic() - started) < duration_s:
                    if not coordinator.alive():
                        raise RuntimeError(f"the coordinator exited: see {coordinator.log_path}")
                    samples.append((elapsed, rss_bytes(coordinator.pid)))
                    bar.n = min(round(elapsed), bar.total)
                    bar.set_postfix(
                        rss_mb=f"{samples[-1][1] / 2**20:.0f}",
                        sessions=tally.opened,
                        errors=tally.errors,
                    )
                    await asyncio.sleep(min(args.sample_s, max(0.0, duration_s - elapsed)))
                stop.set()
                await asyncio.gather(*workers)
                samples.append((time.monotonic() - started, rss_bytes(coordinator.pid)))
                bar.n = bar.total
                bar.refresh()
        finally:
            await fleet.stop_children()
        tracebacks = count_tracebacks(fleet.workdir / "coordinator.log")
    return report(samples, tally, tracebacks, args)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def count_tracebacks(log_path: Path) -> int:
    if not log_path.exists():
        return 0
    return sum(
        1
        for line in log_path.read_text(errors="replace").splitlines()
        if line.startswith("Traceback")
    )


async def wait_for_verifier(broker_url: str, fleet: Any) -> None:
    """Until the verifier's retained heartbeat says online (its target is loaded)."""
    from broker.client import BrokerAddress, ConnectOptions, connect
    from broker.topics import VerifierChannel, verifier_subscription

    options = ConnectOptions(client_id=f"soak-watch-{secrets.token_hex(3)}")
    deadline = time.monotonic() + START_TIMEOUT_S
    async with connect(BrokerAddress.from_url(broker_url), options) as client:
        await client.subscribe(verifier_subscription(VerifierChannel.STATUS))
        async with _inbox(client) as inbox:
            await _until_online(inbox, fleet, deadline)


async def _until_online(inbox: asyncio.Queue[Any], fleet: Any, deadline: float) -> None:
    from broker import messages as m

    while True:
        for child in [*fleet.verifiers.values(), fleet.coordinator_child]:
            if child is not None and not child.alive():
                raise RuntimeError(f"{child.name} exited: see {child.log_path}")
        try:
            incoming = await asyncio.wait_for(inbox.get(), 1.0)
        except (asyncio.TimeoutError, TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError("the verifier did not come up") from None
            continue
        status = m.decode(incoming.payload)
        if isinstance(status, m.VerifierStatus) and status.state is m.DeviceState.ONLINE:
            return


@contextlib.asynccontextmanager
async def _inbox(client: Any) -> AsyncIterator[asyncio.Queue[Any]]:
    """The client's messages in a queue: a timed-out wait on a queue loses nothing, where one on
    the message iterator would close it."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        async for incoming in client.messages():
            queue.put_nowait(incoming)

    task = asyncio.create_task(pump(), name="soak-inbox")
    try:
        yield queue
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def _device_connection(broker_url: str, device_ids: list[str]) -> AsyncIterator[Any]:
    from broker.client import BrokerAddress, ConnectOptions, connect
    from broker.topics import DeviceChannel, device_topic

    options = ConnectOptions(client_id=f"soak-{device_ids[0]}-{secrets.token_hex(3)}")
    async with connect(BrokerAddress.from_url(broker_url), options) as client:
        for device_id in device_ids:
            await client.subscribe(device_topic(device_id, DeviceChannel.VERDICT))
        yield client


async def device_worker(
    broker_url: str, index: int, max_tokens: int, tally: Tally, stop: asyncio.Event
) -> None:
    """Short sessions one after another, each on the next of this worker's devices."""
    device_ids = [f"soak-{index}-{d}" for d in range(DEVICES_PER_WORKER)]
    async with _device_connection(broker_url, device_ids) as client, _inbox(client) as inbox:
        session = _SessionRunner(client, inbox, tally)
        n = 0
        while not stop.is_set():
            cancel = n % CANCEL_EVERY == CANCEL_EVERY - 1
            await session.run(device_ids[n % len(device_ids)], max_tokens, cancel)
            n += 1


class _SessionRunner:
    """One greedy session at a time, spoken by hand: open, draft every round, close."""

    def __init__(self, client: Any, inbox: asyncio.Queue[Any], tally: Tally) -> None:
        self.client = client
        self.inbox = inbox
        self.tally = tally

    async def run(self, device_id: str, max_tokens: int, cancel: bool) -> None:
        from broker import messages as m
        from broker.topics import DeviceChannel, device_topic

        session_id = str(uuid.uuid4())
        opening = m.SessionOpen(
            session_id=session_id,
            prompt="soak",
            prompt_ids=PROMPT_IDS,
            max_tokens=max_tokens,
            draft_model="lookup",
            k=4,
        )
        await self.client.publish(device_topic(device_id, DeviceChannel.SESSION), m.encode(opening))
        state = await self._answer(session_id)
        if not isinstance(state, m.SessionState):
            return
        self.tally.opened += 1
        committed = state.committed_len
        round_index = state.next_round
        while True:
            if cancel and round_index >= CANCEL_AFTER_ROUNDS:
                break
            draft = m.Draft(
                session_id=session_id,
                round=round_index,
                base_len=committed,
                tokens=(),  # an empty window: the verifier's next token alone
                draft_model="lookup",
                timings=m.DraftTimings(sent_at=time.time()),
            )
            await self.client.publish(device_topic(device_id, DeviceChannel.DRAFT), m.encode(draft))
            verdict = await self._answer(session_id, round_index)
            if not isinstance(verdict, m.Verdict):
                return
            self.tally.rounds += 1
            committed, round_index = verdict.committed_len, verdict.round + 1
            if verdict.finished:
                self.tally.finished += 1
                break
        close = m.SessionClose(session_id=session_id, reason="soak")
        await self.client.publish(device_topic(device_id, DeviceChannel.SESSION), m.encode(close))
        closed = await self._answer(session_id)
        if cancel and isinstance(closed, m.SessionState):
            self.tally.cancelled += 1

    async def _answer(self, session_id: str, round_index: int | None = None) -> Any:
        """The reply about this session (for a round: its verdict); None, counted, if none comes
        in time or if it is a refusal."""
        from broker import messages as m

        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                incoming = await asyncio.wait_for(self.inbox.get(), left)
            except (asyncio.TimeoutError, TimeoutError):
                break
            reply = m.decode(incoming.payload)
            if getattr(reply, "session_id", None) != session_id:
                continue
            if isinstance(reply, m.ErrorReply):
                self.tally.refusals.append(f"{reply.refused_type}: {reply.reason}")
                return None
            if round_index is not None and isinstance(reply, m.SessionState):
                continue  # a resynchronisation would be followed by its verdict or an error
            if round_index is not None and getattr(reply, "round", round_index) != round_index:
                continue
            return reply
        self.tally.timeouts += 1
        return None


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from core.settings import Settings

    if not (Settings().resolved_models_dir).exists():
        from core.errors import CommandError

        raise CommandError("no models directory: run `specfleet models build-target` first")
    with tempfile.TemporaryDirectory(prefix="specfleet-soak-") as tmp:
        document = asyncio.run(run_soak(args, Path(tmp)))
    print(table(document))
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    return 0 if document["errors"] == 0 else 1
