"""A session started from the admin API completes on a real agent: the coordinator service, a
verifier and an agent process on the real Mosquitto, the real PostgreSQL and the real target.
The finished session then replays and re-verifies from the database, and a second one is
cancelled from the API."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker.mosquitto import free_port
from coordinator import replay
from coordinator.db.engine import make_engine, make_sessionmaker
from coordinator.db.events import EventLog
from coordinator.db.models import DecodingSession, Round
from coordinator.stack import http_api
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from coordinator.web.control import attach_service
from core.settings import Settings
from inference.artifacts import default_models_dir
from inference.sampling import SamplingParams
from inference.speculative import decode_target
from localfleet.fleet import AgentSpec, local_fleet
from modelbuild.target_build import load_target

SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
PROMPT = "Name the four seasons of the year."
MAX_TOKENS = 24


async def _wait_for_status(
    client: httpx.AsyncClient, session_id: str, wanted: set[str], timeout_s: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(f"/api/v1/sessions/{session_id}")
        if response.status_code == 200 and response.json()["session"]["status"] in wanted:
            body: dict[str, Any] = response.json()
            return body
        assert time.monotonic() < deadline, f"session {session_id}: {response.text[:300]}"
        await asyncio.sleep(0.2)


LOOKUP = (("draft_model", "lookup"),)


def _samples(metrics: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }


async def _metrics_once_counted(client: httpx.AsyncClient, tokens: int) -> str:
    """/metrics once `tokens` committed tokens are counted there (or after 10 s, as it is). A
    leased session's verifier persists each round before it reports it to the coordinator, whose
    observer counts it: the database says finished a moment before the last report arrives."""
    deadline = time.monotonic() + 10
    while True:
        metrics = (await client.get("/metrics")).text
        counted = _samples(metrics).get(("specfleet:committed_tokens_total", LOOKUP), 0.0)
        if counted >= tokens or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


async def _read_text_stream(client: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    """The coordinator's SSE text stream of a session, read as a client would."""
    for _ in range(100):  # the agent opens the session a moment after the API accepts it
        async with client.stream("GET", f"/api/v1/sessions/{session_id}/stream") as response:
            if response.status_code == 404:
                await asyncio.sleep(0.1)
                continue
            assert response.status_code == 200, await response.aread()
            deltas: list[str] = []
            done: dict[str, Any] = {}
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if event == "text":
                        deltas.append(data["delta"])
                    elif event == "done":
                        done = data
            return {"deltas": deltas, "done": done}
    raise AssertionError(f"session {session_id} never appeared")


async def _scenario(database_url: str, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    device_id = f"pi-api-{secrets.token_hex(3)}"
    settings = Settings(
        home=workdir,
        database_url=database_url,
        models_dir=default_models_dir(),
        secret_key="a-test-secret-of-32-characters!!",
        coordinator_id=f"coordinator-api-{secrets.token_hex(4)}",
    )
    verifier_id = f"verifier-api-{secrets.token_hex(3)}"
    async with local_fleet(
        settings,
        [AgentSpec(device_id, "pi", "lookup", "none")],
        [verifier_id],
        workdir=workdir / "fleet",
        external_broker=SHARED_MOSQUITTO,
    ) as fleet:
        engine = make_engine(database_url)
        try:
            _, token = AdminStore(make_sessionmaker(engine)).create("alice")
            app = create_app(settings, engine)
            attach_service(app, fleet.coordinator)
            port = free_port()
            async with (
                http_api(app, "127.0.0.1", port),
                httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}",
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=60,
                ) as client,
            ):
                # The agent's presence reaches the registry a moment after it is up.
                deadline = time.monotonic() + 20
                while (await client.get(f"/api/v1/devices/{device_id}")).json()[
                    "status"
                ] != "online":
                    assert time.monotonic() < deadline, "the agent never came online"
                    await asyncio.sleep(0.1)
                # Other verifiers may share the broker (the retained statuses of those gone
                # too, more than a page of them: online ones are asked for); ours comes online
                # once its model has loaded, which on a loaded host can be after the agent.
                deadline = time.monotonic() + 60
                while True:
                    verifiers = (
                        await client.get("/api/v1/verifiers", params={"online": "true"})
                    ).json()
                    online = {v["verifier_id"]: v["online"] for v in verifiers["data"]}
                    if verifiers["live"] and online.get(verifier_id):
                        break
                    assert time.monotonic() < deadline, f"verifier never online: {verifiers}"
                    await asyncio.sleep(0.1)

                started = await client.post(
                    "/api/v1/sessions",
                    json={
                        "device_id": device_id,
                        "prompt": PROMPT,
                        "max_tokens": MAX_TOKENS,
                        "draft_model": "lookup",
                        "k": 4,
                    },
                )
                assert started.status_code == 202, started.text
                streamed = asyncio.create_task(_read_text_stream(client, started.json()["id"]))
                finished = await _wait_for_status(
                    client, started.json()["id"], {"finished", "failed", "cancelled"}, 90
                )
                finished["metrics"] = await _metrics_once_counted(
                    client, sum(len(r["tokens"]) for r in finished["rounds"])
                )
                finished["streamed"] = await asyncio.wait_for(streamed, 30)
                finished["events"] = (
                    await client.get("/api/v1/events", params={"session_id": started.json()["id"]})
                ).json()["data"]

                long_one = await client.post(
                    "/api/v1/sessions",
                    json={
                        "device_id": device_id,
                        "prompt": "Count to a thousand.",
                        "max_tokens": 2000,
                    },
                )
                assert long_one.status_code == 202, long_one.text
                long_id = long_one.json()["id"]
                await _wait_for_status(client, long_id, {"active"}, 30)
                cancelled = await client.post(
                    f"/api/v1/sessions/{long_id}/cancel", json={"reason": "from the test"}
                )
                assert cancelled.status_code == 202, cancelled.text
                stopped = await _wait_for_status(
                    client, long_id, {"cancelled", "finished", "failed"}, 30
                )
        finally:
            engine.dispose()
    return finished, stopped


def _story(finished: dict[str, Any], fleet_dir: Path, database_url: str) -> str:
    """What a failure needs to be understood: the session and its rounds as the API read them and
    as the database holds them now, its events, and the agent's and verifier's logs (they ran in
    processes of their own)."""
    keys = ("round", "base_len", "k", "n_accepted", "committed_len", "provisional", "verifier_id")
    lines = [f"session as read: {finished['session']}", "rounds as read:"]
    lines += [
        str({key: r[key] for key in keys} | {"at": r["created_at"]}) for r in finished["rounds"]
    ]
    engine = make_engine(database_url)
    try:
        with Session(engine) as db:
            row = db.get(DecodingSession, uuid.UUID(finished["session"]["id"]))
            assert row is not None
            lines.append(
                f"session now: {row.status} {len(row.committed_ids)} tokens, committed_len "
                f"{row.committed_len}, updated {row.updated_at}, finished {row.finished_at}"
            )
            for rnd in db.scalars(
                sa.select(Round).where(Round.session_id == row.id).order_by(Round.round_index)
            ):
                lines.append(
                    f"round now: {rnd.round_index} base {rnd.base_len} committed "
                    f"{rnd.committed_len} by {rnd.verifier_id} at {rnd.created_at}"
                )
    finally:
        engine.dispose()
    lines += ["events:", *(f"{e['kind']} {e['detail']}" for e in finished["events"][::-1])]
    for log_file in sorted(fleet_dir.glob("*.log")):
        lines += [f"{log_file.name}:", *log_file.read_text(errors="replace").splitlines()[-60:]]
    return "\n".join(lines)


def test_a_session_started_from_the_api_completes_on_an_agent(
    tmp_path: Path, create_pg_database: Callable[[], str]
) -> None:
    database_url = create_pg_database()
    finished, stopped = asyncio.run(_scenario(database_url, tmp_path))

    assert finished["session"]["status"] == "finished", finished["session"]
    story = _story(finished, tmp_path / "fleet", database_url)
    assert finished["problems"] == [], story
    generated = [t["id"] for r in finished["rounds"] for t in r["tokens"]]
    # Greedy over the bus is the target's own output.
    target, tokenizer = load_target(default_models_dir())
    prompt_ids = tokenizer.apply_chat_template(PROMPT)
    reference = decode_target(
        target, prompt_ids, MAX_TOKENS, SamplingParams(temperature=0.0), tokenizer.eos_id
    )
    assert generated == reference.tokens, story
    assert finished["text"] == tokenizer.decode(reference.tokens)
    # The coordinator's stream gave the same text, as it was committed, then the end.
    assert "".join(finished["streamed"]["deltas"]) == finished["text"]
    assert finished["streamed"]["done"] == {"status": "finished", "tokens": len(generated)}
    # Every persisted round reached /metrics through the service's round observer.
    samples = _samples(finished["metrics"])
    assert samples[("specfleet:committed_tokens_total", LOOKUP)] == len(generated)
    drafted = sum(r["k"] for r in finished["rounds"])
    assert samples[("specfleet:spec_decode_num_draft_tokens_total", LOOKUP)] == drafted

    # The finished session replays from the database and its every verdict is reproduced.
    engine: Engine = make_engine(database_url)
    try:
        sessions = make_sessionmaker(engine)
        record = replay.load_session(sessions, uuid.UUID(finished["session"]["id"]))
        report = replay.verify_session(record, target, decoder=tokenizer)
        assert report.ok, report.mismatches
        assert report.verified == len(record.rounds) == finished["rounds_count"]
        events = _event_kinds(sessions, record.id)
    finally:
        engine.dispose()
    assert "session.start_requested" in events

    assert stopped["session"]["status"] == "cancelled", stopped["session"]
    assert stopped["stats"]["generated"] < 2000


def _event_kinds(sessions: sessionmaker[Session], session_id: uuid.UUID) -> list[str]:
    return [e.kind for e in EventLog(sessions).list(session_id=session_id)]


# A coordinator on the shared Mosquitto: one such module at a time (tests/conftest.py).
pytestmark = [pytest.mark.timeout(240), pytest.mark.shared_mosquitto]
