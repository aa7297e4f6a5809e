"""`/api/v1/devices` against a real PostgreSQL database."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from core.settings import Settings

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def registry(pg_clean_engine: Engine) -> DeviceRegistry:
    registry = DeviceRegistry(make_sessionmaker(pg_clean_engine), hash_iterations=10)
    registry.provision("jet-1", "jetson", ["lab"], hardware={"gpu": "orin"})
    registry.provision("phone-1", "phone", ["field"])
    registry.provision("pi-1", "pi", ["lab", "field"])
    registry.provision("pi-2", "pi")
    registry.mark_online("pi-1", T0)
    registry.record_telemetry("pi-1", T0, rtt_ms=14.0, cpu_percent=35.0)
    return registry


@pytest.fixture
def client(pg_clean_engine: Engine, registry: DeviceRegistry) -> Iterator[TestClient]:
    settings = Settings(database_url=pg_clean_engine.url.render_as_string(hide_password=False))
    _, token = AdminStore(make_sessionmaker(pg_clean_engine)).create("viewer", "viewer")
    with TestClient(create_app(settings, pg_clean_engine)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client


def test_list_returns_every_device_with_the_total(client: TestClient) -> None:
    response = client.get("/api/v1/devices")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 4
    assert [d["id"] for d in body["data"]] == ["jet-1", "phone-1", "pi-1", "pi-2"]
    pi = body["data"][2]
    assert pi["status"] == "online"
    assert pi["kind"] == "pi"
    assert pi["tags"] == ["field", "lab"]
    assert datetime.fromisoformat(pi["last_seen"]) == T0
    assert pi["telemetry"] == {"rtt_ms": 14.0, "cpu_percent": 35.0}
    assert body["data"][0]["hardware"] == {"gpu": "orin"}


def test_no_response_carries_the_credential_hash(client: TestClient) -> None:
    for url in ("/api/v1/devices", "/api/v1/devices/pi-1"):
        text = client.get(url).text
        assert "credential" not in text
        assert "$7$" not in text


@pytest.mark.parametrize(
    ("query", "ids", "count"),
    [
        ("status=online", ["pi-1"], 1),
        ("status=offline&kind=pi", ["pi-2"], 1),
        ("kind=jetson", ["jet-1"], 1),
        ("tag=lab", ["jet-1", "pi-1"], 2),
        ("tag=la", [], 0),
        ("skip=1&limit=2", ["phone-1", "pi-1"], 4),
        ("tag=field&limit=1", ["phone-1"], 2),
        ("skip=10", [], 4),
    ],
)
def test_list_filters_and_pages(client: TestClient, query: str, ids: list[str], count: int) -> None:
    response = client.get(f"/api/v1/devices?{query}")
    assert response.status_code == 200
    body = response.json()
    assert [d["id"] for d in body["data"]] == ids
    assert body["count"] == count


def test_read_one_device(client: TestClient) -> None:
    response = client.get("/api/v1/devices/jet-1")
    assert response.status_code == 200
    assert response.json()["kind"] == "jetson"


def test_an_unknown_device_is_404_with_a_reason(client: TestClient) -> None:
    response = client.get("/api/v1/devices/ghost-7")
    assert response.status_code == 404
    assert response.json() == {"detail": "no device 'ghost-7'"}


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/devices?status=sleeping",
        "/api/v1/devices?kind=toaster",
        "/api/v1/devices?limit=0",
        "/api/v1/devices?limit=100000",
        "/api/v1/devices?limit=ten",
        "/api/v1/devices?skip=-1",
        "/api/v1/devices?tag=",
        "/api/v1/devices/-starts-with-dash",
        "/api/v1/devices/has%20space",
    ],
)
def test_malformed_input_is_422_never_500(client: TestClient, url: str) -> None:
    response = client.get(url)
    assert response.status_code == 422
    assert response.json()["detail"]
