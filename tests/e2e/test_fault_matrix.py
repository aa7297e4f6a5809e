"""The fault matrix: three concurrent greedy sessions, each fault hitting them mid-generation.

Every process is real and separate: a private Mosquitto (so that it can be restarted), the
coordinator (`specfleet up`, so that it can be SIGKILLed), two verifiers, and three agents, each
behind its own network emulator on the way to the broker, against a PostgreSQL database. The
fleet is started once for the module; each fault leaves it whole again for the next.

For every fault: each session's final text is byte-identical to the fault-free output (the
target alone, which the fault-free runs in test_dsd_bus.py equal), no token is lost or
duplicated (each session's rounds are contiguous and rebuild its committed tokens), and the time
from the end of the fault to the first token committed after it is measured and reported at the
end of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from rounds_check import assert_rounds_rebuild
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session
from test_dsd_bus import shared_prompts, target_answer

from broker.mosquitto import PrivateMosquitto, free_port, wait_for_port
from coordinator.db.models import DecodingSession, Round, SessionStatus
from coordinator.db.registry import DeviceRegistry
from coordinator.stack import VERIFIER_USER, prepare_database
from core.settings import Settings
from device_agent.local_api import HOST, ApiError, SseEvent, request_json, stream_session
from localfleet.fleet import AgentSpec, ChildProcess, FleetProcesses, _provision
from netem.control import send_command

AGENTS = [
    AgentSpec("fault-pi", "pi", "hybrid+draft-l1", "tflite"),
    AgentSpec("fault-jetson", "jetson", "draft-l1", "onnx"),
    AgentSpec("fault-phone", "phone", "hybrid+draft-l2", "onnx"),
]
VERIFIERS = ["fault-verifier-1", "fault-verifier-2"]
MAX_TOKENS = 40
MID_GENERATION_TOKENS = 6  # every session has streamed this many tokens when the fault hits
START_TIMEOUT_S = 180.0
SESSION_TIMEOUT_S = 240.0
ONLINE = re.compile(r"^specfleet:verifiers_online(?:\{[^}]*\})? (\d+(?:\.\d+)?)$", re.MULTILINE)

REPORT: dict[str, dict[str, Any]] = {}


@dataclass
class Link:
    """A network emulator between one agent and the broker, as its own process."""

    process: ChildProcess
    port: int
    control: int

    async def command(self, line: str) -> dict[str, Any]:
        reply = await send_command("127.0.0.1", self.control, line)
        assert reply["ok"], reply
        return reply


@dataclass
class Rig:
    mosquitto: PrivateMosquitto
    fleet: FleetProcesses
    engine: Engine
    links: dict[str, Link] = field(default_factory=dict)

    def start_agent(self, spec: AgentSpec) -> ChildProcess:
        link = self.links[spec.device_id]
        return self.fleet.start_agent(
            spec, broker_url=f"mqtt://127.0.0.1:{link.port}", extra=["--connect-wait", "60"]
        )

    async def verifiers_online(self) -> int:
        url = f"http://127.0.0.1:{self.fleet.coordinator_http_port}/metrics"
        async with httpx.AsyncClient(timeout=5.0) as client:
            try:
                text = (await client.get(url)).text
            except httpx.HTTPError:
                return 0
        found = ONLINE.search(text)
        return int(float(found.group(1))) if found else 0

    async def wait_whole(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the coordinator sees both verifiers and every agent is on the bus."""
        deadline = time.monotonic() + timeout_s
        for child in [*self.fleet.verifiers.values(), self.fleet.coordinator_child]:
            assert child is not None and child.alive(), f"{child} exited"
        while await self.verifiers_online() < len(VERIFIERS):
            if time.monotonic() > deadline:
                raise TimeoutError(f"verifiers not online; logs in {self.fleet.workdir}")
            await asyncio.sleep(0.2)
        await self.fleet.wait_agents(deadline)
        for device_id, port in self.fleet.agent_ports.items():
            while True:
                status, health = await request_json(HOST, port, "GET", "/v1/health")
                if status == 200 and health["connected"]:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agent {device_id} not connected")
                await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def rig(
    tmp_path_factory: pytest.TempPathFactory,
    create_pg_database: Callable[[], str],
) -> Iterator[Rig]:
    workdir = tmp_path_factory.mktemp("faults")
    with PrivateMosquitto() as mosquitto:
        settings = Settings(
            home=workdir / "home",
            models_dir=Settings().resolved_models_dir,  # the built target and drafts
            database_url=create_pg_database(),
            broker_url=mosquitto.url,
            coordinator_id=f"coord-faults-{uuid.uuid4().hex[:6]}",
        )
        engine = prepare_database(settings)
        from coordinator.db.engine import make_sessionmaker

        registry = DeviceRegistry(make_sessionmaker(engine))
        credentials = {spec.device_id: _provision(registry, spec) for spec in AGENTS}
        credentials[VERIFIER_USER] = ""
        fleet = FleetProcesses(
            settings=settings,
            broker_url=mosquitto.url,
            credentials=credentials,
            workdir=workdir / "fleet",
        )
        fleet.workdir.mkdir(parents=True)
        rig = Rig(mosquitto, fleet, engine)
        try:
            fleet.start_coordinator()
            for verifier_id in VERIFIERS:
                fleet.start_verifier(verifier_id)
            for spec in AGENTS:
                port, control = free_port(), free_port()
                argv = [
                    sys.executable,
                    "-m",
                    "specfleet",
                    "netem",
                    "--listen",
                    str(port),
                    "--upstream",
                    f"127.0.0.1:{mosquitto.port}",
                    "--control",
                    str(control),
                ]
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                child = ChildProcess(
                    f"netem-{spec.device_id}",
                    argv,
                    env,
                    fleet.workdir / f"netem-{spec.device_id}.log",
                )
                child.start()
                wait_for_port("127.0.0.1", control, 30.0)
                rig.links[spec.device_id] = Link(child, port, control)
                rig.start_agent(spec)
            asyncio.run(rig.wait_whole())
            yield rig
        finally:
            asyncio.run(fleet.stop_children())
            for link in rig.links.values():
                asyncio.run(link.process.stop())
            engine.dispose()


def report_lines() -> list[str]:
    """The matrix as measured in this run, for the end of pytest's output (tests/e2e/conftest)."""
    if not REPORT:
        return []
    lines = ["fault matrix: recovery after the fault ends (3 concurrent greedy sessions)"]
    lines.append(f"{'fault':<40} {'recovery s':>10} {'hit':>4} {'identical':>9}")
    for name, row in REPORT.items():
        lines.append(
            f"{name:<40} {row['recovery_s']:>10.2f} {row['sessions_hit']:>4} "
            f"{row['identical']!s:>9}"
        )
    target = os.environ.get("SPECFLEET_FAULT_REPORT")
    if target:
        Path(target).write_text(json.dumps(REPORT, indent=2) + "\n")
    return lines


@dataclass
class Watched:
    """One session as its caller on the device sees it: each SSE event with its arrival time."""

    device_id: str
    prompt: dict[str, str]
    events: list[tuple[float, SseEvent]] = field(default_factory=list)
    session_id: str = ""
    summary: dict[str, Any] | None = None

    @property
    def tokens_seen(self) -> int:
        return sum(1 for _, e in self.events if e.event == "text")

    def first_progress_after(self, moment: float) -> float | None:
        for at, event in self.events:
            if at > moment and event.event in ("text", "reconciled", "done"):
                return at
        return None


async def _watch(rig: Rig, watched: Watched) -> None:
    port = rig.fleet.agent_ports[watched.device_id]
    body = {
        "prompt": watched.prompt["prompt"],
        "task_type": watched.prompt["task"],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
        async for event in stream_session(HOST, port, body, timeout_s=30.0):
            watched.events.append((time.monotonic(), event))
            if event.event == "session":
                watched.session_id = str(event.data["session_id"])
            elif event.event == "done":
                watched.summary = dict(event.data)
    # A stream cut short (the agent was killed): follow the session by polling until it ends.
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    unknown_since: float | None = None
    while watched.summary is None:
        assert watched.session_id, f"{watched.device_id}: no session started"
        assert time.monotonic() < deadline, f"{watched.device_id}: session did not finish"
        # A restarting agent refuses connections: request_json says so with ApiError(0).
        with contextlib.suppress(ConnectionError, OSError, ApiError):
            status, summary = await request_json(
                HOST, port, "GET", f"/v1/sessions/{watched.session_id}"
            )
            if status == 404:  # a restarted agent knows it once its journal is read
                unknown_since = unknown_since or time.monotonic()
                assert time.monotonic() - unknown_since < 15.0, f"{watched.device_id}: lost"
            if status == 200:
                seen = len(summary.get("token_ids") or [])
                if seen > watched.tokens_seen:
                    watched.events.append((time.monotonic(), SseEvent("text", {"delta": ""})))
                if summary["status"] == "finished":
                    watched.summary = summary
                    break
                assert summary["status"] in ("active", "opening", "fallback"), summary
        await asyncio.sleep(0.1)


def _check_database(rig: Rig, watched: list[Watched]) -> None:
    with Session(rig.engine) as db:
        for w in watched:
            assert w.summary is not None
            assert_rounds_rebuild(db, w.session_id, w.summary["token_ids"])


def run_fault(
    rig: Rig,
    name: str,
    inject: Callable[[], Awaitable[float]],
    restore: Callable[[], object] | None = None,
) -> list[Watched]:
    """Three sessions, one per agent; `inject` hits them once each has streamed a few tokens and
    returns the monotonic time the fault ended; `restore` makes the fleet whole again once the
    sessions are done. Then every check of the matrix."""
    prompts = [p for p in shared_prompts() if p["task"] in ("chat", "code", "summarize")]
    chosen = [prompts[(i * 5 + len(REPORT)) % len(prompts)] for i in range(len(AGENTS))]
    watched = [Watched(spec.device_id, p) for spec, p in zip(AGENTS, chosen, strict=True)]

    async def scenario() -> tuple[float, int]:
        await rig.wait_whole()
        watchers = [asyncio.create_task(_watch(rig, w)) for w in watched]
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        while not all(w.tokens_seen >= MID_GENERATION_TOKENS or w.summary for w in watched):
            assert time.monotonic() < deadline, "sessions did not get going"
            for task in watchers:
                if task.done():
                    task.result()
            await asyncio.sleep(0.01)
        hit = sum(1 for w in watched if w.summary is None)
        ended = await inject()
        try:
            await asyncio.wait_for(asyncio.gather(*watchers), SESSION_TIMEOUT_S)
        finally:
            if restore is not None:
                restore()
        await rig.wait_whole()
        return ended, hit

    ended, hit = asyncio.run(scenario())
    assert hit >= 1, "every session finished before the fault hit"
    recoveries = [t - ended for w in watched if (t := w.first_progress_after(ended)) is not None]
    identical = True
    for w in watched:
        assert w.summary is not None and w.summary["status"] == "finished", w.summary
        expected = target_answer(w.prompt["prompt"], MAX_TOKENS)
        identical &= tuple(w.summary["token_ids"]) == expected
        assert tuple(w.summary["token_ids"]) == expected, f"{name}: {w.device_id} differs"
    _check_database(rig, watched)
    REPORT[name] = {
        "recovery_s": max(recoveries, default=0.0),
        "recovery_per_session_s": recoveries,
        "sessions_hit": hit,
        "identical": identical,
    }
    return watched


def _pg_terminate(rig: Rig) -> int:
    """Drop every connection to the fleet's database but this one (the coordinator's pool)."""
    url = make_url(rig.fleet.settings.database_url)
    with psycopg.connect(
        host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
    ) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


def test_device_link_cut_for_2_s(rig: Rig) -> None:
    async def inject() -> float:
        await asyncio.gather(*(link.command("cut 2") for link in rig.links.values()))
        await asyncio.sleep(2.0)
        return time.monotonic()

    run_fault(rig, "device link cut 2 s", inject)


def test_broker_restarted(rig: Rig) -> None:
    async def inject() -> float:
        await asyncio.to_thread(rig.mosquitto.restart)
        return time.monotonic()

    run_fault(rig, "broker restarted", inject)


def test_coordinator_sigkilled_and_restarted(rig: Rig) -> None:
    async def inject() -> float:
        coordinator = rig.fleet.coordinator_child
        assert coordinator is not None
        coordinator.kill()
        rig.fleet.start_coordinator()
        return time.monotonic()

    run_fault(rig, "coordinator SIGKILL + restart", inject)


def _serving_verifiers(rig: Rig, session_ids: list[str] | None = None) -> dict[str, set[str]]:
    """Per session (the given ones, else those active now), the verifiers its rounds ran on."""
    with Session(rig.engine) as db:
        query = sa.select(Round.session_id, Round.verifier_id).join(DecodingSession)
        if session_ids is None:
            query = query.where(DecodingSession.status == SessionStatus.ACTIVE)
        else:
            query = query.where(Round.session_id.in_([uuid.UUID(s) for s in session_ids]))
        served: dict[str, set[str]] = {}
        for session_id, verifier_id in db.execute(query):
            served.setdefault(str(session_id), set()).add(verifier_id or "")
    return served


def test_verifier_sigkilled(rig: Rig) -> None:
    """The verifier that has served the most running sessions dies; they move to the other."""
    victims: list[str] = []

    async def inject() -> float:
        served = await asyncio.to_thread(_serving_verifiers, rig)
        counts = {v: sum(v in s for s in served.values()) for v in VERIFIERS}
        victim = max(VERIFIERS, key=lambda v: counts[v])
        victims.append(victim)
        rig.fleet.verifiers[victim].kill()
        return time.monotonic()

    watched = run_fault(
        rig, "verifier SIGKILL", inject, lambda: rig.fleet.start_verifier(victims[0])
    )
    served = _serving_verifiers(rig, [w.session_id for w in watched])
    survivor = next(v for v in VERIFIERS if v != victims[0])
    moved = [s for s, verifiers in served.items() if {victims[0], survivor} <= verifiers]
    assert moved, f"no session moved from {victims[0]} to {survivor}: {served}"


def test_postgresql_connections_dropped(rig: Rig) -> None:
    async def inject() -> float:
        dropped = await asyncio.to_thread(_pg_terminate, rig)
        assert dropped >= 1, "the coordinator held no database connection"
        return time.monotonic()

    run_fault(rig, "PostgreSQL connections dropped", inject)


def test_agent_sigkilled_and_restarted(rig: Rig) -> None:
    async def inject() -> float:
        for spec in AGENTS:
            rig.fleet.agents[spec.device_id].kill()
        for spec in AGENTS:
            rig.start_agent(spec)
        return time.monotonic()

    run_fault(rig, "agent SIGKILL + restart", inject)


def test_device_link_cut_for_60_s(rig: Rig) -> None:
    async def inject() -> float:
        await asyncio.gather(*(link.command("cut 60") for link in rig.links.values()))
        await asyncio.sleep(60.0)
        return time.monotonic()

    run_fault(rig, "device link cut 60 s (local fallback)", inject)
