"""Artifact downloads on the real PostgreSQL: a device fetches with the download token from its
command; its bus credential opens nothing, and a token opens one artifact, for one device, for a
while."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import Device, DeviceStatus
from coordinator.db.registry import DeviceRegistry
from coordinator.ops.releases import (
    StoredRelease,
    issue_download_token,
    load_or_create_release_key,
    store_release,
)
from coordinator.web.api.routes import artifacts
from core.settings import Settings


@dataclass(frozen=True)
class Site:
    client: TestClient
    home: Path
    stored: StoredRelease
    credential: str  # pi-1's bus credential
    engine: Engine

    def token(self, device_id: str = "pi-1", ttl_s: float = 60.0) -> str:
        key = load_or_create_release_key(self.home)
        return issue_download_token(key, self.stored.release.sha256, device_id, ttl_s)

    def get(self, authorization: str | None, sha256: str | None = None) -> int:
        headers = {"Authorization": authorization} if authorization else {}
        url = f"/api/v1/artifacts/{sha256 or self.stored.release.sha256}"
        return self.client.get(url, headers=headers).status_code


@pytest.fixture
def site(pg_db: tuple[str, Engine], tmp_path: Path, draft_dir: Path) -> Iterator[Site]:
    url, engine = pg_db
    sessions = make_sessionmaker(engine)
    registry = DeviceRegistry(sessions, hash_iterations=10)
    _, credential = registry.provision("pi-1", "pi")
    registry.provision("pi-2", "pi")
    home = tmp_path / "coordinator"
    stored = store_release(home, draft_dir)
    app = FastAPI()
    app.state.settings = Settings(home=home, database_url=url)
    app.state.sessions = sessions
    app.include_router(artifacts.router, prefix="/api/v1")
    with TestClient(app) as client:
        yield Site(client, home, stored, credential, engine)


def test_a_download_token_fetches_its_artifact(site: Site) -> None:
    response = site.client.get(
        f"/api/v1/artifacts/{site.stored.release.sha256}",
        headers={"Authorization": f"Bearer {site.token()}"},
    )
    assert response.status_code == 200
    assert response.content == site.stored.path.read_bytes()


def test_the_bus_credential_is_not_a_download_credential(site: Site) -> None:
    basic = base64.b64encode(f"pi-1:{site.credential}".encode()).decode()
    assert site.get(f"Basic {basic}") == 401
    assert site.get(f"Bearer {site.credential}") == 401
    assert site.get(None) == 401


def test_a_token_opens_one_artifact_for_a_while(site: Site) -> None:
    other_sha = "0" * 64
    assert site.get(f"Bearer {site.token()}", sha256=other_sha) == 401
    assert site.get(f"Bearer {site.token(ttl_s=-1)}") == 401
    forged = issue_download_token(
        Ed25519PrivateKey.generate(), site.stored.release.sha256, "pi-1", 60
    )
    assert site.get(f"Bearer {forged}") == 401
    assert site.get(f"Bearer {site.token(device_id='pi-404')}") == 401


def test_a_retired_device_token_opens_nothing(site: Site) -> None:
    token = site.token(device_id="pi-2")
    assert site.get(f"Bearer {token}") == 200
    with site.engine.begin() as connection:
        connection.execute(
            sa.update(Device).where(Device.id == "pi-2").values(status=DeviceStatus.RETIRED)
        )
    assert site.get(f"Bearer {token}") == 401
