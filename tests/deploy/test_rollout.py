"""`specfleet models deploy` to three real agents over a private Mosquitto, artifacts over HTTP.

The fleet side (the HTTP API serving artifacts, three agents and a corrupting proxy) runs in a
thread of its own, because the command under test owns the main thread's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import re
import threading
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from deploy_support import broken_release, copy_release, run_cli
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from broker.mosquitto import PrivateMosquitto, free_port
from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventLog
from coordinator.db.models import DeploymentState, DeviceDeploymentState
from coordinator.db.registry import DeviceRegistry
from coordinator.ops.provisioning import sync_broker_files
from coordinator.ops.releases import release_public_key_pem
from coordinator.ops.rollout import Deployments, RolloutEvent
from core.settings import Settings
from device_agent.agent import Agent
from device_agent.models_store import smoke_draft
from device_agent.settings import load_agent_settings

T = TypeVar("T")
DEVICES = ("dev-a", "dev-b", "dev-c")  # waves of 50% are [dev-a, dev-b] and [dev-c]
CORRUPTED = "dev-c"
LOOP_TIMEOUT_S = 60.0


class CorruptingProxy:
    """An HTTP proxy that, once `corrupt` is set, flips one byte in the middle of what it relays."""

    def __init__(self) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                request = urllib.request.Request(self.path)  # absolute-form: the origin URL
                if "Authorization" in self.headers:
                    request.add_header("Authorization", self.headers["Authorization"])
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(request, timeout=30) as upstream:
                    body = bytearray(upstream.read())
                if proxy.corrupt:
                    body[len(body) // 2] ^= 0xFF
                    proxy.corrupted += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(bytes(body))

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.corrupt = False
        self.corrupted = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # The stdlib server blocks in serve_forever; its thread lives as long as the test.
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    # The command under test runs asyncio.run in the main thread; the fleet needs a loop beside it.
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(LOOP_TIMEOUT_S)


@dataclass
class Fleet:
    agents: dict[str, Agent]
    registry: DeviceRegistry
    deployments: Deployments
    events: EventLog
    proxy: CorruptingProxy

    def active(self, device_id: str, name: str) -> str | None:
        return self.agents[device_id].models.active(name)


@pytest.fixture
def fleet(
    tmp_path: Path,
    pg_db: tuple[str, Engine],
    broker_dir: Path,
    secured_mosquitto: Callable[[], PrivateMosquitto],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Fleet]:
    url, engine = pg_db
    home = tmp_path / "coordinator"
    assert run_cli(["broker", "write-config", "--out", str(broker_dir), "--database-url", url]) == 0
    found = re.search(r"user coordinator: credential (\S+)", capsys.readouterr().out)
    assert found is not None
    sessions = make_sessionmaker(engine)
    registry = DeviceRegistry(sessions, hash_iterations=1000)
    credentials = {d: registry.provision(d, "pi", ["lab"])[1] for d in DEVICES}
    sync_broker_files(broker_dir, registry.broker_accounts(), DEVICES)
    broker = secured_mosquitto()

    http_port = free_port()
    for key, value in {
        "HOME": str(home),
        "DATABASE_URL": url,
        "BROKER_URL": broker.url,
        "BROKER_USERNAME": "coordinator",
        "BROKER_PASSWORD": found.group(1),
        "HTTP_PORT": str(http_port),
    }.items():
        monkeypatch.setenv(f"SPECFLEET_{key}", value)
    key_file = tmp_path / "release-key.pub.pem"
    key_file.write_bytes(release_public_key_pem(home))

    from coordinator.web.api.routes import artifacts

    app = FastAPI()
    app.state.settings = Settings()
    app.state.sessions = sessions
    app.include_router(artifacts.router, prefix="/api/v1")
    proxy = CorruptingProxy()
    with loop_thread() as loop:
        server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=http_port, log_level="warning", log_config=None
            )
        )
        serving = asyncio.run_coroutine_threadsafe(server.serve(), loop)
        agents = {}
        for device_id in DEVICES:
            settings = load_agent_settings(
                device_id=device_id,
                credential=credentials[device_id],
                broker_url=broker.url,
                home=tmp_path / device_id,
                release_key_file=key_file,
                http_proxy=proxy.url if device_id == CORRUPTED else None,
                local_api=False,
            )
            agents[device_id] = Agent(settings)
        running = [asyncio.run_coroutine_threadsafe(a.run(), loop) for a in agents.values()]
        for agent in agents.values():
            on(loop, asyncio.wait_for(agent.connected.wait(), 10))
        try:
            yield Fleet(agents, registry, Deployments(sessions), EventLog(sessions), proxy)
        finally:
            for agent in agents.values():
                on(loop, agent.stop())
            for future in running:
                future.result(10)
            server.should_exit = True
            serving.result(10)
            proxy.close()


def deploy(models_dir: Path, name: str, *args: str) -> int:
    port = Settings().http_port
    return run_cli(
        [
            "models", "deploy", name, "--models-dir", str(models_dir),
            "--artifact-url", f"http://127.0.0.1:{port}/api/v1", "--device-timeout", "60",
            *args,
        ]
    )  # fmt: skip


def device_states(fleet: Fleet, deployment_id: int) -> dict[str, DeviceDeploymentState]:
    _, rows = fleet.deployments.get(deployment_id)
    return {row.device_id: row.state for row in rows}


def test_rollout_in_two_waves_refuses_a_corrupted_download_and_aborts_a_bad_build(
    fleet: Fleet, draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = draft_dir.name
    v1 = draft_dir.parent
    # Every device starts on v1 (dev-c's proxy relays faithfully for now).
    assert deploy(v1, name, "--to", "lab", "--wave", "100") == 0
    first = {d: fleet.active(d, name) for d in DEVICES}
    assert len(set(first.values())) == 1 and None not in first.values()

    # v2 to the tag, in two waves; dev-c's download is corrupted on the way.
    v2 = copy_release(draft_dir, tmp_path / "v2" / name, note="v2").parent
    fleet.proxy.corrupt = True
    capsys.readouterr()
    assert deploy(v2, name, "--to", "lab", "--wave", "50", "--abort-at", "60") == 0
    out = capsys.readouterr().out
    deployment_id = int(re.search(r"deployment (\d+):", out).group(1))  # type: ignore[union-attr]
    deployment, rows = fleet.deployments.get(deployment_id)
    assert deployment.state is DeploymentState.DONE
    assert {r.device_id: r.wave for r in rows} == {"dev-a": 0, "dev-b": 0, "dev-c": 1}
    assert device_states(fleet, deployment_id) == {
        "dev-a": DeviceDeploymentState.INSTALLED,
        "dev-b": DeviceDeploymentState.INSTALLED,
        "dev-c": DeviceDeploymentState.ROLLED_BACK,
    }
    assert "sha256 mismatch" in next(r.detail or "" for r in rows if r.device_id == CORRUPTED)
    assert fleet.proxy.corrupted == 1
    v2_sha = deployment.artifact_sha256
    assert fleet.active("dev-a", name) == fleet.active("dev-b", name) == v2_sha
    # The corrupted device refused it and keeps serving v1.
    assert fleet.active(CORRUPTED, name) == first[CORRUPTED]
    assert smoke_draft(fleet.agents[CORRUPTED].models.models_dir, name, "onnx")
    kinds = [e.kind for e in fleet.events.list(limit=100)]
    for kind in (
        RolloutEvent.CREATED,
        RolloutEvent.WAVE_STARTED,
        RolloutEvent.DEVICE_INSTALLED,
        RolloutEvent.DEVICE_ROLLED_BACK,
        RolloutEvent.DONE,
    ):
        assert kind.value in kinds
    assert name in fleet.registry.get("dev-a").installed_models

    # A bad build: every device of the first wave rolls it back, so the second never gets it.
    bad = broken_release(draft_dir, tmp_path / "bad" / name).parent
    capsys.readouterr()
    assert deploy(bad, name, "--to", "lab", "--wave", "50", "--abort-at", "50") == 1
    out = capsys.readouterr().out
    bad_id = int(re.search(r"deployment (\d+):", out).group(1))  # type: ignore[union-attr]
    deployment, _ = fleet.deployments.get(bad_id)
    assert deployment.state is DeploymentState.FAILED
    assert device_states(fleet, bad_id) == {
        "dev-a": DeviceDeploymentState.ROLLED_BACK,
        "dev-b": DeviceDeploymentState.ROLLED_BACK,
        "dev-c": DeviceDeploymentState.PENDING,
    }
    assert fleet.active("dev-a", name) == fleet.active("dev-b", name) == v2_sha
    assert fleet.active(CORRUPTED, name) == first[CORRUPTED]
    aborted = fleet.events.list(kind=RolloutEvent.ABORTED.value, limit=1)[0]
    assert aborted.detail["waves_run"] == 1 and aborted.detail["failed"] == 2


def test_an_older_release_is_refused_and_only_a_signed_rollback_goes_back(
    fleet: Fleet, draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = draft_dir.name
    v1 = draft_dir.parent
    v2 = copy_release(draft_dir, tmp_path / "v2" / name, note="v2").parent
    assert deploy(v1, name, "--to", "lab", "--wave", "100") == 0
    v1_sha = fleet.active("dev-a", name)
    assert deploy(v2, name, "--to", "lab", "--wave", "100") == 0
    v2_sha = fleet.active("dev-a", name)
    assert v2_sha != v1_sha

    # Release 1 again, as it was signed then: every device refuses it and keeps release 2.
    capsys.readouterr()
    assert deploy(v1, name, "--to", "lab", "--wave", "100") == 1
    out = capsys.readouterr().out
    assert f"{name} release 1 (" in out
    replay_id = int(re.search(r"deployment (\d+):", out).group(1))  # type: ignore[union-attr]
    assert set(device_states(fleet, replay_id).values()) == {DeviceDeploymentState.ROLLED_BACK}
    _, rows = fleet.deployments.get(replay_id)
    assert all("signed rollback" in (row.detail or "") for row in rows)
    assert {fleet.active(d, name) for d in DEVICES} == {v2_sha}

    # The explicit rollback, signed as one, goes back.
    capsys.readouterr()
    assert deploy(v1, name, "--to", "lab", "--wave", "100", "--rollback-to", "1") == 0
    assert "release 1 (rollback from 2)" in capsys.readouterr().out
    assert {fleet.active(d, name) for d in DEVICES} == {v1_sha}
