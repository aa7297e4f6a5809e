"""`/healthz` and `/readyz`: readiness follows the real database and the coordinator's real
broker connection (a private Mosquitto that the test stops)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from coordinator_rig import rig_settings, running_coordinator
from sqlalchemy.engine import Engine

from broker.mosquitto import PrivateMosquitto, free_port
from coordinator.db.engine import make_engine
from coordinator.web.api.main import create_app
from coordinator.web.control import attach_service
from core.settings import Settings

DISCONNECT_WAIT_S = 20.0


def _client(app: object) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://coordinator")


async def _ready_then_broker_lost(tmp_path: Path, engine: Engine) -> list[tuple[int, str]]:
    answers = []
    broker = PrivateMosquitto()
    broker.start()
    try:
        settings = rig_settings(tmp_path, engine, broker.url)
        app = create_app(settings, engine)
        async with running_coordinator(settings, engine) as coordinator, _client(app) as http:
            attach_service(app, coordinator)
            for path in ("/healthz", "/readyz"):
                response = await http.get(path)
                answers.append((response.status_code, response.text))
            broker.stop()
            async with asyncio.timeout(DISCONNECT_WAIT_S):
                while coordinator.connected.is_set():
                    await asyncio.sleep(0.05)
            for path in ("/healthz", "/readyz"):
                response = await http.get(path)
                answers.append((response.status_code, response.text))
    finally:
        broker.stop()
    return answers


def test_ready_while_connected_and_not_ready_once_the_broker_is_gone(
    tmp_path: Path, pg_clean_engine: Engine
) -> None:
    answers = asyncio.run(_ready_then_broker_lost(tmp_path, pg_clean_engine))
    assert answers[0] == (200, "ok\n")
    assert answers[1] == (200, "ready\n")
    # Liveness stays up: a restart would not bring the broker back.
    assert answers[2] == (200, "ok\n")
    assert answers[3] == (503, "the coordinator is not connected to the broker\n")


async def _probe(app: object) -> tuple[int, str]:
    async with _client(app) as http:
        response = await http.get("/readyz")
        return response.status_code, response.text


def test_an_api_process_without_a_coordinator_is_not_ready(
    tmp_path: Path, pg_clean_engine: Engine
) -> None:
    app = create_app(Settings(home=tmp_path), pg_clean_engine)
    status, text = asyncio.run(_probe(app))
    assert (status, text) == (503, "no coordinator service is attached to this API process\n")


def test_a_database_that_does_not_answer_is_reported(tmp_path: Path) -> None:
    # A PostgreSQL URL on a port where nothing listens: every query fails to connect.
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test")
    try:
        app = create_app(Settings(home=tmp_path), engine)
        status, text = asyncio.run(_probe(app))
    finally:
        engine.dispose()
    assert status == 503
    assert text.splitlines() == [
        "the database refused a query: OperationalError",
        "no coordinator service is attached to this API process",
    ]
