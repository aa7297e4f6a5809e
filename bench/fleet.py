"""`specfleet bench fleet`: thousands of lightweight agents against the control plane.

A LOAD TEST OF THE CONTROL PLANE: a private Mosquitto, the coordinator (`specfleet up`, its own
process, so its RSS is its own), replay verifiers (`bench.replay_verifier`: answers from recorded
target answers, no model) and agent swarms (`bench.fleet_agents`: real MQTT clients, one
connection per device, the real protocol, drafting from the same recordings). A distributed round
goes as it goes in production: the coordinator opens the session and leases it to a verifier,
and each round goes agent -> broker -> verifier (persisted) -> broker -> agent, the coordinator
hearing of it afterwards. With `--via-coordinator` the verifiers take no leases and every round
goes agent -> broker -> coordinator -> verifier -> coordinator (persisted) -> broker -> agent. It
measures what the coordinator, the broker and the database add; it says nothing of output
quality, which the recordings fix in advance.

Reported: agents connected, sessions, rounds/s, per-round overhead p50/p99 (a draft's publish to
its verdict at the agent; the replay verifier's own time is included and is microseconds), every
error, rounds lost or duplicated (the agents' verdicts against the database's rows, which must be
contiguous from round 0), and the coordinator's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.report import add_json_argument, format_table, percentile, write_json

DEFAULT_JSON = Path("bench-results/fleet.json")
START_TIMEOUT_S = 120.0
# Connecting a swarm: the handshakes, its subscriptions and its retained presence.
CONNECT_S_PER_AGENT = 0.1
# The coordinator taking each agent's online status (3.9 to 10 agents/s measured on the loaded
# host with two runs at once, one status after another on its bus loop).
PRESENCE_S_PER_AGENT = 0.5
RSS_SAMPLE_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=int, default=1000, help="connected agents (default 1000)")
    parser.add_argument(
        "--sessions",
        type=int,
        default=200,
        help="sessions, all started at once, one per agent (default 200)",
    )
    parser.add_argument(
        "--coordinators",
        type=int,
        default=1,
        help="coordinators sharing the fleet (default 1; more need PostgreSQL)",
    )
    parser.add_argument(
        "--kill-coordinator-after",
        type=float,
        default=None,
        metavar="S",
        help="SIGKILL the first coordinator S seconds into the sessions (needs 2+)",
    )
    parser.add_argument("--verifiers", type=int, default=1, help="replay verifiers (default 1)")
    parser.add_argument(
        "--via-coordinator",
        action="store_true",
        help="the verifiers take no session leases, so every round crosses the coordinator "
        "(the path of a verifier without the database) instead of going to the verifier "
        "directly",
    )
    parser.add_argument(
        "--processes", type=int, default=2, help="agent swarm processes (default 2)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens per session at most (default 64)"
    )
    parser.add_argument("--k", type=int, default=4, help="draft window (default 4)")
    parser.add_argument(
        "--round-interval-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="each session offers a round every MS (a device's draft time and link): the "
        "offered rate is sessions x 1000 / MS rounds/s; 0 (default) drafts again at once, "
        "which measures queueing at saturation rather than the per-round overhead",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=0.8,
        help="chance each drafted token is the recorded one (default 0.8)",
    )
    parser.add_argument(
        "--answers", type=Path, default=None, help="recorded answers (default: the shipped 64)"
    )
    parser.add_argument("--database-url", metavar="URL", default=None, help="instead of SQLite")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drafts (default 0)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the logs, plans and results here (default: a temporary directory)",
    )
    add_json_argument(parser, DEFAULT_JSON)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad input with a one-line reason (CommandError: exit status 2)."""
    from core.errors import CommandError

    if not 1 <= args.coordinators <= 8:
        raise CommandError("--coordinators must be in 1..8")
    postgres = (args.database_url or "").startswith("postgresql")
    if args.coordinators > 1 and not postgres:
        raise CommandError(
            f"--coordinators {args.coordinators}: coordinators share a fleet through "
            "PostgreSQL advisory locks; pass --database-url postgresql://..."
        )
    if args.kill_coordinator_after is not None and (
        args.coordinators < 2 or args.kill_coordinator_after <= 0
    ):
        raise CommandError("--kill-coordinator-after needs --coordinators 2+ and S > 0")
    if not 1 <= args.agents <= 20_000:
        raise CommandError("--agents must be in 1..20000")
    if not 1 <= args.sessions <= args.agents:
        raise CommandError("--sessions must be in 1..--agents (one session per agent)")
    if not 1 <= args.verifiers <= 16:
        raise CommandError("--verifiers must be in 1..16")
    if not 1 <= args.processes <= min(32, args.agents):
        raise CommandError("--processes must be in 1..32 and at most --agents")
    if not 2 <= args.max_tokens <= 8192:
        raise CommandError("--max-tokens must be in 2..8192")
    if not 1 <= args.k <= 64:
        raise CommandError("--k must be in 1..64")
    if not 0.0 <= args.alpha <= 1.0:
        raise CommandError("--alpha must be in [0, 1]")
    if not 0.0 <= args.round_interval_ms <= 60_000:
        raise CommandError("--round-interval-ms must be in 0..60000")


# --- the plan -----------------------------------------------------------------------------------


def make_plans(args: argparse.Namespace, answers_path: Path, n_answers: int) -> list[Any]:
    """Agents dealt round-robin to swarms; the first `sessions` agents each run one session."""
    from bench.fleet_agents import SessionPlan, SwarmPlan

    run = secrets.token_hex(3)
    device_ids = [f"fleet-{run}-{i:05d}" for i in range(args.agents)]
    rng = random.Random(args.seed)
    # The seed fixes what is drafted; the session ids are new each run, so that a second run
    # against the same database is not refused as a replay of the first one's sessions.
    sessions = {
        device_ids[i]: SessionPlan(
            device_ids[i], rng.randrange(n_answers), rng.getrandbits(63), str(uuid.uuid4())
        )
        for i in range(args.sessions)
    }
    plans = []
    for p in range(args.processes):
        mine = device_ids[p :: args.processes]
        plans.append(
            SwarmPlan(
                swarm=f"swarm-{p}",
                device_ids=mine,
                sessions=[sessions[d] for d in mine if d in sessions],
                answers=str(answers_path),
                k=args.k,
                alpha=args.alpha,
                max_tokens=args.max_tokens,
                round_interval_ms=args.round_interval_ms,
            )
        )
    return plans


# --- what is measured ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredLegs:
    """A stored round's legs as the coordinator timed them (ms; None when not recorded)."""

    uplink_ms: float | None  # the draft's sent_at (agent) to its arrival where it is answered
    # Via the coordinator: to the verifier and back, beyond its compute (bus hops, its queue);
    # a direct round: the verifier's own wait before it verifies.
    queue_ms: float | None
    verify_ms: float | None  # the verifier's compute


@dataclass(frozen=True)
class StoredRounds:
    """The database's rounds of this run's sessions: session id -> round indices, as stored."""

    by_session: dict[str, list[int]]
    rows: int
    legs: dict[tuple[str, int], StoredLegs] = field(default_factory=dict)


def stored_rounds(database_url: str, session_ids: list[str]) -> StoredRounds:
    import sqlalchemy as sa

    from coordinator.db.engine import make_engine
    from coordinator.db.models import Round

    engine = make_engine(database_url)
    by_session: dict[str, list[int]] = defaultdict(list)
    legs: dict[tuple[str, int], StoredLegs] = {}
    rows = 0
    try:
        with engine.connect() as conn:
            for start in range(0, len(session_ids), 500):
                chunk = [uuid.UUID(s) for s in session_ids[start : start + 500]]
                query = sa.select(
                    Round.session_id,
                    Round.round_index,
                    Round.t_uplink_ms,
                    Round.t_queue_ms,
                    Round.t_verify_ms,
                ).where(Round.session_id.in_(chunk))
                for session_id, round_index, uplink, queue, verify in conn.execute(query):
                    by_session[str(session_id)].append(round_index)
                    legs[(str(session_id), round_index)] = StoredLegs(uplink, queue, verify)
                    rows += 1
    finally:
        engine.dispose()
    return StoredRounds({k: sorted(v) for k, v in by_session.items()}, rows, legs)


def check_rounds(sessions: list[dict[str, Any]], stored: StoredRounds) -> dict[str, int]:
    """Lost: a verdict an agent holds whose round the database lacks. Duplicated: a round stored
    twice. Gaps: a session whose stored rounds are not 0..n-1. Unconfirmed: stored rounds whose
    verdict no agent received (a timeout, counted as an error already)."""
    lost = duplicated = gaps = unconfirmed = 0
    for session in sessions:
        seen = set(session["rounds"])
        rows = stored.by_session.get(session["session_id"], [])
        duplicated += len(rows) - len(set(rows))
        lost += len(seen - set(rows))
        unconfirmed += len(set(rows) - seen)
        if sorted(set(rows)) != list(range(len(set(rows)))):
            gaps += 1
    return {"lost": lost, "duplicated": duplicated, "gaps": gaps, "unconfirmed": unconfirmed}


def round_legs(sessions: list[dict[str, Any]], stored: StoredRounds) -> dict[str, list[float]]:
    """Each answered round's time split by where it went (ms). `overhead` is the round beyond
    the verifier's compute: the draft's publish to its verdict read by the session, less the
    stored verify time. It splits into `uplink` (agent publish, broker, the answerer reading
    it), `verifier_hops` (via the coordinator: coordinator to verifier and back, beyond compute;
    a direct round: the verifier's own queue), `answerer` (the rest inside the process that
    persists the round and answers, the coordinator or the verifier holding the lease: the
    round's checks, the group commit, the verdict's encoding) and `downlink` (the verdict's
    sent_at to the session reading it: broker, the agent's client, and `agent_wait`, the time it
    sat in the swarm's own queue). Uplink and downlink compare two processes' wall clocks on one
    host."""
    legs: dict[str, list[float]] = defaultdict(list)
    for session in sessions:
        rows = zip(session["rounds"], session["latencies_ms"], session["downlink_ms"],
                   session["agent_wait_ms"], strict=True)  # fmt: skip
        for round_index, total, downlink, agent_wait in rows:
            stored_legs = stored.legs.get((session["session_id"], round_index))
            verify = (stored_legs.verify_ms if stored_legs else None) or 0.0
            overhead = max(0.0, total - verify)
            legs["overhead"].append(overhead)
            # A session's first round comes while the fleet's sessions are being opened (all
            # at once by default): its tail is the opening's, the later rounds' the steady state's.
            legs["overhead_first" if round_index == 0 else "overhead_later"].append(overhead)
            legs["downlink"].append(downlink)
            legs["agent_wait"].append(agent_wait)
            if stored_legs is None or stored_legs.uplink_ms is None or stored_legs.queue_ms is None:
                continue
            legs["uplink"].append(stored_legs.uplink_ms)
            legs["verifier_hops"].append(stored_legs.queue_ms)
            inside = total - verify - stored_legs.uplink_ms - stored_legs.queue_ms - downlink
            legs["answerer"].append(max(0.0, inside))
    return legs


LEGS = ("uplink", "verifier_hops", "answerer", "downlink", "agent_wait", "loop_lag")


def spread(values: list[float]) -> dict[str, float]:
    """p50, p99 and the count of a set of times, as the report gives each."""
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def report(
    results: list[dict[str, Any]],
    stored: StoredRounds,
    rss: list[tuple[float, int]],
    tracebacks: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    sessions = [s for r in results for s in r["sessions"]]
    latencies = [ms for s in sessions for ms in s["latencies_ms"]]
    rounds = len(latencies)
    legs = round_legs(sessions, stored)
    legs["loop_lag"] = [ms for r in results for ms in r["loop_lag_ms"]]
    started = min((r["first_sent"] for r in results if r["first_sent"]), default=0.0)
    ended = max((r["last_answer"] for r in results), default=0.0)
    duration = max(ended - started, 1e-9) if rounds else 0.0
    checks = check_rounds(sessions, stored)
    refusals = [reason for r in results for reason in r["refusals"]]
    connect_failures = [f for r in results for f in r["connect_failures"]]
    timeouts = sum(r["timeouts"] for r in results)
    duplicate_verdicts = sum(r["duplicate_verdicts"] for r in results)
    conflicting_verdicts = sum(r.get("conflicting_verdicts", 0) for r in results)
    errors = len(refusals) + len(connect_failures) + timeouts + tracebacks
    return {
        "benchmark": "fleet",
        "load_tool": "replay verifier and recorded-answer agents: control plane only",
        "agents": args.agents,
        "agents_connected": sum(r["connected"] for r in results),
        "coordinators": args.coordinators,
        # direct: leased to the verifier, which persists and answers; else via the coordinator.
        "rounds_path": "via_coordinator" if args.via_coordinator else "direct",
        "coordinator_killed_at_s": getattr(args, "killed_at_s", None),
        "retries": sum(r["retries"] for r in results),
        "resyncs": sum(r["resyncs"] for r in results),
        "verifiers": args.verifiers,
        "processes": args.processes,
        "k": args.k,
        "alpha": args.alpha,
        "max_tokens": args.max_tokens,
        "sessions": args.sessions,
        "sessions_opened": sum(1 for s in sessions if s["opened"]),
        "sessions_finished": sum(1 for s in sessions if s["finished"]),
        "tokens_committed": sum(s["committed"] for s in sessions),
        "rounds": rounds,
        "seconds": duration,
        "rounds_per_s": rounds / duration if rounds else 0.0,
        "round_interval_ms": args.round_interval_ms,
        # Offered while every session runs: each asks for a round per interval (none: as fast as
        # answered, a closed loop at saturation).
        "offered_rounds_per_s": args.sessions * 1000.0 / args.round_interval_ms
        if args.round_interval_ms
        else None,
        # Beyond the verifier's compute (which the replay verifier makes microseconds).
        "overhead_ms_p50": percentile(legs["overhead"], 50),
        "overhead_ms_p99": percentile(legs["overhead"], 99),
        "overhead_ms_max": max(legs["overhead"], default=float("nan")),
        # The same, of the sessions' first rounds and of the rounds after them.
        "overhead_by_round_ms": {
            part: spread(legs[f"overhead_{part}"]) for part in ("first", "later")
        },
        "round_trip_ms_p50": percentile(latencies, 50),
        "round_trip_ms_p99": percentile(latencies, 99),
        # Where the overhead goes (see round_legs); loop_lag: how late the swarms' timers fired.
        "legs_ms": {leg: spread(legs[leg]) for leg in LEGS},
        "refusals": len(refusals),
        "refusal_reasons": sorted(set(refusals))[:20],
        "connect_failures": len(connect_failures),
        "connect_failure_reasons": connect_failures[:20],
        "timeouts": timeouts,
        "coordinator_tracebacks": tracebacks,
        "errors": errors,
        "rounds_stored": stored.rows,
        "rounds_lost": checks["lost"],
        # Rounds stored twice, or answered twice with different verdicts: must be 0.
        "rounds_duplicated": checks["duplicated"] + conflicting_verdicts,
        # The same verdict delivered again, for a round drafted again (the protocol's
        # idempotent answer with the stored verdict; counted, not an error).
        "verdicts_repeated": duplicate_verdicts,
        "sessions_with_gaps": checks["gaps"],
        "rounds_unconfirmed": checks["unconfirmed"],
        # The largest coordinator at each sample.
        "coordinator_rss_mb_start": rss[0][1] / 2**20 if rss else None,
        "coordinator_rss_mb_max": max(b for _, b in rss) / 2**20 if rss else None,
        "coordinator_rss_mb_end": rss[-1][1] / 2**20 if rss else None,
        "rss_samples": [{"t_s": round(t, 1), "rss_mb": b / 2**20} for t, b in rss],
    }


def table(document: dict[str, Any]) -> str:
    def mb(key: str) -> str:
        value = document[key]
        return "n/a" if value is None else f"{value:.1f}"

    by_round = document.get("overhead_by_round_ms") or {}
    rows = [
        ["agents connected", f"{document['agents_connected']} / {document['agents']}"],
        ["coordinators / verifiers", f"{document['coordinators']} / {document['verifiers']}"],
        ["rounds go", "via the coordinator" if document.get("rounds_path") == "via_coordinator"
         else "to the verifier holding the lease (direct)"],
        ["coordinator SIGKILLed at s", document["coordinator_killed_at_s"] or "-"],
        ["round retries / resyncs", f"{document['retries']} / {document['resyncs']}"],
        [
            "sessions opened / finished",
            f"{document['sessions_opened']} / {document['sessions_finished']} "
            f"of {document['sessions']}",
        ],
        ["rounds", document["rounds"]],
        ["  verifier verdicts: direct / all",
         "{direct} / {answered}".format(**document.get("verifier_answers") or
                                        {"direct": "?", "answered": "?"})],
        *(
            [f"  direct rounds in the verifier: {leg} p50 / p99 ms",
             f"{answers[key]['p50']:.2f} / {answers[key]['p99']:.2f}"]
            for answers in [document.get("verifier_answers") or {}]
            for leg, key in (("held", "held_ms"), ("of it, persist", "persist_ms"))
            if isinstance(answers.get(key), dict) and answers[key]["n"]
        ),
        ["round interval ms (offered rounds/s)",
         f"{document['round_interval_ms']:g} ({document['offered_rounds_per_s']:.0f})"
         if document["offered_rounds_per_s"] else "0 (saturation: closed loop)"],
        ["rounds/s served", f"{document['rounds_per_s']:.1f}"],
        ["overhead p50 ms", f"{document['overhead_ms_p50']:.2f}"],
        ["overhead p99 ms", f"{document['overhead_ms_p99']:.2f}"],
        *(
            [f"  {name} p50 / p99 ms", f"{by_round[part]['p50']:.2f} / {by_round[part]['p99']:.2f}"]
            for part, name in (("first", "sessions' first rounds"), ("later", "later rounds"))
            if isinstance(by_round.get(part), dict) and by_round[part]["n"]
        ),
        *(
            [f"  {leg} p50 / p99 ms",
             f"{document['legs_ms'][leg]['p50']:.2f} / {document['legs_ms'][leg]['p99']:.2f}"]
            for leg in LEGS
        ),
        ["errors", document["errors"]],
        ["  refusals / timeouts", f"{document['refusals']} / {document['timeouts']}"],
        ["  connect failures", document["connect_failures"]],
        ["  coordinator tracebacks", document["coordinator_tracebacks"]],
        ["rounds lost / duplicated",
         f"{document['rounds_lost']} / {document['rounds_duplicated']}"],
        ["  the same verdict again (a draft re-sent)", document["verdicts_repeated"]],
        ["sessions with gaps", document["sessions_with_gaps"]],
        *(
            [f"CPU while the sessions ran: {role.replace('_', ' ')} (cores)",
             f"{document['cpu_cores'][role]:.2f}"]
            for role in ("coordinators", "verifiers", "agent_swarms", "broker", "rest_of_host")
            if document.get("cpu_cores")
        ),
        *(
            [["CPU: host busy (cores of all)",
              f"{document['cpu_cores']['host_busy']:.2f} of {document['cpu_cores']['host_cores']}"]]
            if document.get("cpu_cores") else []
        ),
        ["coordinator RSS MB start / max / end",
         f"{mb('coordinator_rss_mb_start')} / {mb('coordinator_rss_mb_max')} / "
         f"{mb('coordinator_rss_mb_end')}"],
    ]  # fmt: skip
    return format_table(["fleet load (replay verifier: control plane only)", "value"], rows)


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Coordinators:
    """The coordinators under load: children of this process, each with its HTTP port."""

    children: list[Any]
    http_ports: list[int]
    killed: set[str]

    def alive(self) -> list[Any]:
        return [c for c in self.children if c.name not in self.killed]

    async def stop(self) -> None:
        await asyncio.gather(*(child.stop() for child in self.children))


def start_coordinators(fleet: Any, n: int) -> Coordinators:
    """`specfleet up` N times against the fleet's broker and database; N > 1 share the fleet."""
    from broker.mosquitto import free_port
    from localfleet.fleet import ChildProcess

    children, ports = [], []
    for i in range(n):
        port = free_port()
        argv = [sys.executable, "-m", "specfleet", "up", "--broker", fleet.broker_url,
                "--database-url", fleet.settings.database_url,
                "--http-port", str(port)]  # fmt: skip
        env = fleet._child_env()
        env["SPECFLEET_COORDINATOR_ID"] = f"{fleet.settings.coordinator_id}-{i}"
        if n > 1:
            env["SPECFLEET_SHARED_FLEET"] = "true"
        name = f"coordinator-{i}"
        child = ChildProcess(name, argv, env, fleet.workdir / f"{name}.log")
        child.start()
        children.append(child)
        ports.append(port)
    return Coordinators(children, ports, set())


def shards_settled(database_url: str, n: int) -> bool:
    """Every shard locked, by N coordinators present (the locks of
    coordinator/runtime/shards.py)."""
    import psycopg
    from sqlalchemy.engine import make_url

    from coordinator.runtime.shards import N_SHARDS, PRESENCE_LOCKS, SHARD_LOCKS

    dsn = make_url(database_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT classid::bigint, count(*), count(DISTINCT pid) FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND classid::bigint IN (%s, %s) "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "GROUP BY classid",
            (SHARD_LOCKS, PRESENCE_LOCKS),
        ).fetchall()
    counts = {int(str(classid)): (int(str(c)), int(str(holders))) for classid, c, holders in rows}
    shards, holders = counts.get(SHARD_LOCKS, (0, 0))
    return counts.get(PRESENCE_LOCKS, (0, 0))[0] == n and shards == N_SHARDS and holders == n


async def run_fleet(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from bench.recorded import DEFAULT_ANSWERS, load_answers
    from bench.soak import count_tracebacks, wait_for_verifier
    from broker.mosquitto import PrivateMosquitto
    from coordinator.stack import VERIFIER_USER, prepare_database
    from core.settings import Settings
    from localfleet.fleet import FleetProcesses

    answers_path = (args.answers or DEFAULT_ANSWERS).resolve()
    answers = load_answers(answers_path)
    plans = make_plans(args, answers_path, len(answers))
    (workdir / "mosquitto").mkdir()
    with PrivateMosquitto(workdir=workdir / "mosquitto") as mosquitto:
        settings = Settings(
            home=workdir / "home",
            database_url=args.database_url or f"sqlite:///{workdir / 'fleet.db'}",
            broker_url=mosquitto.url,
            models_dir=workdir / "no-models",  # nothing loads a model here
            coordinator_id=f"coordinator-fleet-{secrets.token_hex(3)}",
        )
        engine = await asyncio.to_thread(prepare_database, settings)
        try:
            device_ids = [d for plan in plans for d in plan.device_ids]
            await asyncio.to_thread(register_devices, engine, device_ids)
        finally:
            engine.dispose()
        fleet = FleetProcesses(
            settings=settings,
            broker_url=mosquitto.url,
            credentials={VERIFIER_USER: ""},
            workdir=workdir,
        )
        coordinators = start_coordinators(fleet, args.coordinators)
        try:
            for i in range(args.verifiers):
                leases = [] if args.via_coordinator else ["--database-url", settings.database_url]
                argv = ["-m", "bench.replay_verifier", "--broker-url", mosquitto.url,
                        "--id", f"replay-{i}", "--answers", str(answers_path),
                        "--report", str(workdir / f"replay-{i}.json"), *leases]  # fmt: skip
                _start_child(fleet, f"replay-{i}", argv, fleet.verifiers)
            await wait_for_verifier(mosquitto.url, fleet)
            for child, port in zip(coordinators.children, coordinators.http_ports, strict=True):
                await wait_until_ready(port, child)
            if args.coordinators > 1:
                await _wait_for_shards(settings.database_url, args.coordinators)
            results, rss, cpu = await _drive(
                args, fleet, coordinators, mosquitto.url, plans, workdir, mosquitto.pid
            )
            # Counted before the coordinators stop: what they log while stopping is not load.
            tracebacks = sum(count_tracebacks(c.log_path) for c in coordinators.children)
        finally:
            await fleet.stop_children()
            await coordinators.stop()
        session_ids = [s["session_id"] for r in results for s in r["sessions"]]
        stored = await asyncio.to_thread(stored_rounds, settings.database_url, session_ids)
    document = report(results, stored, rss, tracebacks, args)
    document["verifier_answers"] = replay_counts(workdir, args.verifiers)
    document["cpu_cores"] = cpu
    return document


def replay_counts(workdir: Path, verifiers: int) -> dict[str, Any]:
    """What the replay verifiers answered, summed from the reports they wrote at exit: every
    verdict (`answered`), those of rounds leased to them (`direct`; the rest crossed the
    coordinator) and the refusals; and a direct round's time inside them (ms, p50 / p99): `held`
    from its draft's arrival until its verdict was queued, `persist` the group commit in it.
    None where a verifier left no report."""
    totals: dict[str, Any] = {"answered": 0, "direct": 0, "refused": 0}
    held: list[float] = []
    persist: list[float] = []
    for i in range(verifiers):
        path = workdir / f"replay-{i}.json"
        try:
            counts = json.loads(path.read_text())
        except (OSError, ValueError):
            return dict.fromkeys([*totals, "held_ms", "persist_ms"])
        for key in totals:
            totals[key] += int(counts.get(key, 0))
        held += counts.get("held_ms", [])
        persist += counts.get("persist_ms", [])
    for key, values in (("held_ms", held), ("persist_ms", persist)):
        totals[key] = spread(values)
    return totals


async def _wait_for_shards(database_url: str, n: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not await asyncio.to_thread(shards_settled, database_url, n):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {n} coordinators did not share the shards in time")
        await asyncio.sleep(0.5)


def register_devices(engine: Any, device_ids: list[str]) -> None:
    """Provision the agents before they connect, as a fleet's devices are: a device unknown to
    the quickstart's coordinator would be enrolled on its first status, a credential hash each,
    which is a registration cost, not a round's. One PBKDF2 iteration: the broker here is
    anonymous and nothing checks these credentials."""
    from tqdm import tqdm

    from coordinator.db.engine import make_sessionmaker
    from coordinator.db.registry import DeviceRegistry

    registry = DeviceRegistry(make_sessionmaker(engine), hash_iterations=1)
    for device_id in tqdm(device_ids, desc="registering", unit="device", file=sys.stderr):
        registry.provision(device_id, "other", ("fleet-bench",), actor="bench-fleet")


async def wait_until_ready(http_port: int, coordinator: Any) -> None:
    """Until the coordinator's /readyz answers 200: its database answers and it holds its bus
    connection. Drafts sent before it subscribed would be lost with no session to queue them."""
    import urllib.error
    import urllib.request

    def ready() -> bool:
        url = f"http://127.0.0.1:{http_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False  # not listening yet, or 503 until it is ready

    deadline = time.monotonic() + START_TIMEOUT_S
    while not await asyncio.to_thread(ready):
        if not coordinator.alive():
            raise RuntimeError(f"the coordinator exited: see {coordinator.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError("the coordinator did not become ready")
        await asyncio.sleep(0.2)


def _start_child(fleet: Any, name: str, argv: list[str], registry: dict[str, Any]) -> Any:
    from localfleet.fleet import ChildProcess

    child = ChildProcess(name, [sys.executable, *argv], fleet._child_env(),
                         fleet.workdir / f"{name}.log")  # fmt: skip
    child.start()
    registry[name] = child
    return child


async def _drive(
    args: argparse.Namespace, fleet: Any, coordinators: Coordinators, broker_url: str,
    plans: list[Any], workdir: Path, broker_pid: int | None,
) -> tuple[list[dict[str, Any]], list[tuple[float, int]], dict[str, Any]]:  # fmt: skip
    """Start the swarms, wait until every agent is connected, say go, sample the coordinators'
    RSS (and kill one, if asked) until every swarm is done, say stop; the swarms' results, the
    RSS samples and the CPU each role used meanwhile."""
    from tqdm import tqdm

    from bench.fleet_agents import GO_TOPIC, STOP_TOPIC, done_topic, ready_topic
    from bench.soak import _inbox
    from broker.client import BrokerAddress, ConnectOptions, connect

    options = ConnectOptions(client_id=f"bench-fleet-parent-{secrets.token_hex(3)}")
    async with connect(BrokerAddress.from_url(broker_url), options) as control:
        for plan in plans:
            await control.subscribe(ready_topic(plan.swarm))
            await control.subscribe(done_topic(plan.swarm))
        async with _inbox(control) as inbox:
            for plan in plans:
                plan_path = workdir / f"{plan.swarm}.plan.json"
                plan.write(plan_path)
                _start_child(fleet, plan.swarm, ["-m", "bench.fleet_agents", "--broker-url",
                             broker_url, "--plan", str(plan_path), "--out",
                             str(workdir / f"{plan.swarm}.result.json")], fleet.agents)  # fmt: skip
            budget = START_TIMEOUT_S + CONNECT_S_PER_AGENT * args.agents
            with tqdm(total=args.agents, desc="connecting", unit="agent", file=sys.stderr) as bar:
                await _collect(inbox, "ready", plans, fleet, coordinators, budget, bar)
                connected = bar.n
            device_ids = [d for plan in plans for d in plan.device_ids]
            with tqdm(total=connected, desc="online", unit="agent", file=sys.stderr) as bar:
                await _wait_for_presence(
                    fleet.settings.database_url, device_ids, connected,
                    START_TIMEOUT_S + PRESENCE_S_PER_AGENT * connected, coordinators, bar,
                )  # fmt: skip
            rss: list[tuple[float, int]] = []
            started = time.monotonic()
            cpu_before = cpu_snapshot(fleet, coordinators, broker_pid)
            await control.publish(GO_TOPIC, b"{}")
            jobs = [asyncio.create_task(_sample_rss(coordinators, started, rss))]
            if args.kill_coordinator_after is not None:
                jobs.append(asyncio.create_task(_kill_later(coordinators, args)))
            with tqdm(total=len(plans), desc="sessions", unit="swarm", file=sys.stderr) as bar:
                try:
                    await _collect(inbox, "done", plans, fleet, coordinators, None, bar)
                finally:
                    for job in jobs:
                        job.cancel()
            cpu = cpu_used(cpu_before, cpu_snapshot(fleet, coordinators, broker_pid),
                           time.monotonic() - started)  # fmt: skip
            await control.publish(STOP_TOPIC, b"{}")
    results = [json.loads((workdir / f"{plan.swarm}.result.json").read_text()) for plan in plans]
    return results, rss, cpu


CpuSnapshot = tuple[dict[str, dict[int, float]], tuple[float, float]]


def cpu_snapshot(fleet: Any, coordinators: Coordinators, broker_pid: int | None) -> CpuSnapshot:
    """CPU seconds used so far by each process of each role, and the host's (busy, total)."""
    from bench.soak import cpu_seconds, host_cpu_seconds

    roles = {
        "coordinators": [child.pid for child in coordinators.alive()],
        "verifiers": [child.pid for child in fleet.verifiers.values()],
        "agent_swarms": [child.pid for child in fleet.agents.values()],
        "broker": [] if broker_pid is None else [broker_pid],
    }
    used: dict[str, dict[int, float]] = {}
    for role, pids in roles.items():
        used[role] = {}
        for pid in pids:
            with contextlib.suppress(Exception):  # gone (a killed coordinator): not counted
                used[role][pid] = cpu_seconds(pid)
    return used, host_cpu_seconds()


def cpu_used(before: CpuSnapshot, after: CpuSnapshot, wall_s: float) -> dict[str, Any]:
    """Cores each role kept busy on average while the sessions ran (CPU seconds / wall
    seconds), the host's busy cores of all it has, and the rest of the host's busy time
    (PostgreSQL, this process, anything else running)."""
    wall_s = max(wall_s, 1e-9)
    cores: dict[str, Any] = {}
    for role, pids in after[0].items():
        seconds = sum(t - before[0][role][pid] for pid, t in pids.items() if pid in before[0][role])
        cores[role] = seconds / wall_s
    busy_s, all_s = after[1][0] - before[1][0], after[1][1] - before[1][1]
    host_cores = round(all_s / wall_s)
    # The busy share of the host's own time, read in the same snapshots, times its cores: busy
    # seconds over this process's wall clock came out at 2.004 of 2 cores on a saturated host
    # (the two clocks are read a moment apart). A share of all of it is 1 (the float product
    # read 2.000000000000565 of 2).
    busy = min(1.0, busy_s / all_s) * host_cores if all_s > 0 else 0.0
    cores["rest_of_host"] = max(0.0, busy - sum(cores.values()))
    cores["host_busy"] = busy
    cores["host_cores"] = host_cores
    return cores


def devices_online(engine: Any, device_ids: list[str]) -> int:
    """How many of these devices the registry holds online."""
    import sqlalchemy as sa

    from coordinator.db.models import Device, DeviceStatus

    online = 0
    with engine.connect() as conn:
        for start in range(0, len(device_ids), 500):
            query = sa.select(sa.func.count()).where(
                Device.id.in_(device_ids[start : start + 500]),
                Device.status == DeviceStatus.ONLINE,
            )
            online += conn.scalar(query) or 0
    return online


async def _wait_for_presence(
    database_url: str, device_ids: list[str], connected: int, budget_s: float,
    coordinators: Coordinators, bar: Any,
) -> None:  # fmt: skip
    """Until the coordinators have taken every connected agent's online status (a database
    write or three each, one status after another on their bus loop): sessions opened before
    then waited behind 1,000 statuses, and on a loaded host every open timed out (60 s). A
    fleet's devices come online long before its rounds; this measures the rounds."""
    from coordinator.db.engine import make_engine

    engine = make_engine(database_url)
    deadline = time.monotonic() + budget_s
    try:
        while (online := await asyncio.to_thread(devices_online, engine, device_ids)) < connected:
            bar.update(online - bar.n)
            for child in coordinators.alive():
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited: see {child.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{online} of {connected} agents online in time")
            await asyncio.sleep(1.0)
        bar.update(online - bar.n)
    finally:
        engine.dispose()


async def _kill_later(coordinators: Coordinators, args: argparse.Namespace) -> None:
    """SIGKILL the first coordinator midway, as a crash would: its shards go to the others."""
    await asyncio.sleep(args.kill_coordinator_after)
    victim = coordinators.children[0]
    coordinators.killed.add(victim.name)
    victim.kill()
    args.killed_at_s = args.kill_coordinator_after
    print(f"\nkilled {victim.name} (SIGKILL) at {args.kill_coordinator_after:g} s", file=sys.stderr)


async def _collect(
    inbox: asyncio.Queue[Any], kind: str, plans: list[Any], fleet: Any,
    coordinators: Coordinators, budget_s: float | None, bar: Any,
) -> None:  # fmt: skip
    """Until every swarm has said `kind`; a child that dies ends the run with its log."""
    waiting = {plan.swarm for plan in plans}
    deadline = None if budget_s is None else time.monotonic() + budget_s
    while waiting:
        watched = [*coordinators.alive(), *fleet.verifiers.values()]
        watched += [child for child in fleet.agents.values() if child.name in waiting]
        for child in watched:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited: see {child.log_path}")
        try:
            incoming = await asyncio.wait_for(inbox.get(), 1.0)
        except (asyncio.TimeoutError, TimeoutError):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"swarms {sorted(waiting)} not {kind} in time") from None
            continue
        swarm = incoming.topic.rsplit("/", 1)[-1]
        if f"/{kind}/" in incoming.topic and swarm in waiting:
            waiting.discard(swarm)
            if kind == "ready":
                bar.update(json.loads(incoming.payload)["connected"])
            else:
                bar.update(1)


async def _sample_rss(
    coordinators: Coordinators, started: float, rss: list[tuple[float, int]]
) -> None:
    """The largest coordinator's RSS, every RSS_SAMPLE_S."""
    from bench.soak import rss_bytes

    while True:
        sizes = []
        for child in coordinators.alive():
            with contextlib.suppress(OSError, RuntimeError):
                sizes.append(rss_bytes(child.pid))
        if sizes:
            rss.append((time.monotonic() - started, max(sizes)))
        await asyncio.sleep(RSS_SAMPLE_S)


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from bench.recorded import RecordingError, load_answers
    from core.errors import CommandError

    if args.answers is not None:
        try:
            load_answers(args.answers)
        except RecordingError as exc:
            raise CommandError(str(exc)) from exc
    if args.workdir is not None:
        if args.workdir.exists() and any(args.workdir.iterdir()):
            raise CommandError(f"--workdir {args.workdir} is not empty")
        args.workdir.mkdir(parents=True, exist_ok=True)
        document = asyncio.run(run_fleet(args, args.workdir.resolve()))
    else:
        with tempfile.TemporaryDirectory(prefix="specfleet-fleet-") as tmp:
            document = asyncio.run(run_fleet(args, Path(tmp)))
    print(table(document))
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    clean = document["errors"] == 0 and document["rounds_lost"] == 0
    return 0 if clean and document["rounds_duplicated"] == 0 else 1
