"""Paging and tailing parameters past what the database holds are 422, never a 500 or a cut stream
(real PostgreSQL, whose OFFSET and ids are bigint)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from coordinator.web.api.main import create_app
from coordinator.web.api.paging import MAX_ROW_ID
from coordinator.web.api.routes import events as events_route
from coordinator.web.auth import AdminStore
from core.settings import Settings

HUGE = str(10**20)  # past bigint: PostgreSQL refuses it as an OFFSET or an id


@pytest.fixture
def client(pg_clean_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    sessions = make_sessionmaker(pg_clean_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision("pi-1", "pi")
    # A stream that ends soon, so a test can read it whole.
    monkeypatch.setattr(events_route, "STREAM_LIFETIME_S", 0.3)
    monkeypatch.setattr(events_route, "POLL_INTERVAL_S", 0.05)
    settings = Settings(database_url=pg_clean_engine.url.render_as_string(hide_password=False))
    _, token = AdminStore(sessions).create("viewer", "viewer")
    with TestClient(create_app(settings, pg_clean_engine), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client


PAGED = ["/api/v1/devices", "/api/v1/sessions", "/api/v1/events", "/api/v1/models"]


@pytest.mark.parametrize("url", PAGED)
def test_a_skip_past_bigint_is_422_with_a_reason(client: TestClient, url: str) -> None:
    response = client.get(url, params={"skip": HUGE})
    assert response.status_code == 422, response.text
    assert "skip" in response.text


@pytest.mark.parametrize("url", PAGED)
def test_the_largest_skip_is_an_empty_page(client: TestClient, url: str) -> None:
    response = client.get(url, params={"skip": str(MAX_ROW_ID)})
    assert response.status_code == 200, response.text
    assert response.json()["data"] == []


def test_an_after_id_past_bigint_is_422(client: TestClient) -> None:
    response = client.get("/api/v1/events/stream", params={"after_id": HUGE})
    assert response.status_code == 422
    assert "after_id" in response.text


def test_the_largest_after_id_tails_until_the_stream_ends(client: TestClient) -> None:
    response = client.get("/api/v1/events/stream", params={"after_id": str(MAX_ROW_ID)})
    assert response.status_code == 200
    assert f": tail after {MAX_ROW_ID}" in response.text


def test_a_huge_last_event_id_tails_from_now(client: TestClient) -> None:
    response = client.get("/api/v1/events/stream", headers={"Last-Event-ID": HUGE})
    assert response.status_code == 200
    assert ": tail after" in response.text
    assert HUGE not in response.text
    # The log's own events (the device provisioned) are older than "now": none is sent.
    assert "data:" not in response.text
