"""What the end-to-end tests of drafts on demand share: a local fleet's coordinator with the
artifact API that devices download releases from, agents with models directories of their own
(no drafts) that check releases with the coordinator's key, and readings of the sessions."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from rounds_check import assert_rounds_rebuild

from broker.mosquitto import free_port
from coordinator.db.models import Round
from coordinator.ops.releases import release_public_key_pem
from core.settings import Settings
from device_agent.catalog import find_tokenizer_dir
from localfleet.demo import ask
from localfleet.fleet import AgentSpec, LocalFleet


def on_demand_settings(tmp_path: Path, models_dir: Path) -> tuple[Settings, Path]:
    """The coordinator's settings (it releases the drafts built in `models_dir`), and the file
    of its release key's public half, which its devices check releases with."""
    home = tmp_path / "home"
    settings = Settings(
        home=home,
        coordinator_id=f"c-{uuid.uuid4().hex[:8]}",
        http_port=free_port(),
        models_dir=models_dir,
    )
    key_file = tmp_path / "release-key.pub.pem"
    key_file.write_bytes(release_public_key_pem(home))
    return settings, key_file


@asynccontextmanager
async def artifact_api(fleet: LocalFleet, port: int) -> AsyncIterator[None]:
    """The coordinator's artifact route, as `specfleet up` serves it."""
    from coordinator.web.api.routes import artifacts

    app = FastAPI()
    app.state.settings = fleet.settings
    app.state.sessions = fleet.coordinator.sessions
    app.include_router(artifacts.router, prefix="/api/v1")
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)
    )
    serving = asyncio.create_task(server.serve(), name="artifact-api")
    try:
        while not server.started:
            assert not serving.done(), "the artifact API did not start"
            await asyncio.sleep(0.05)
        yield
    finally:
        server.should_exit = True
        await serving


def start_agent(
    fleet: LocalFleet, spec: AgentSpec, tmp_path: Path, *flags: str, **config: Path
) -> None:
    """Provision and start an agent; `config` goes to a TOML file of its own."""
    registry = fleet.coordinator.registry
    _, credential = registry.provision(spec.device_id, "phone", (), actor="test")
    fleet.credentials[spec.device_id] = credential
    extra = ["--telemetry-interval", "1", *flags]
    if config:
        toml = tmp_path / f"{spec.device_id}.toml"
        toml.write_text("".join(f'{key} = "{value}"\n' for key, value in config.items()))
        extra += ["--config", str(toml)]
    fleet.start_agent(spec, broker_url=fleet.broker_url, extra=extra)


def start_own_agent(
    fleet: LocalFleet, spec: AgentSpec, tmp_path: Path, key_file: Path, models_dir: Path
) -> None:
    """An agent with a models directory of its own (no drafts), the target's tokenizer, and
    `key_file` to check releases with."""
    tokenizer_dir = find_tokenizer_dir(models_dir)
    assert tokenizer_dir is not None
    own = own_models_dir(tmp_path, spec)
    own.mkdir()
    # The flag: the fleet's environment names the shared models directory, which beats a file.
    start_agent(
        fleet, spec, tmp_path, "--models-dir", str(own),
        release_key_file=key_file, tokenizer_dir=tokenizer_dir,
    )  # fmt: skip


def own_models_dir(tmp_path: Path, spec: AgentSpec) -> Path:
    return tmp_path / f"{spec.device_id}-models"


def installed(tmp_path: Path, spec: AgentSpec) -> list[str]:
    """The models in an agent's own models directory."""
    own = own_models_dir(tmp_path, spec)
    return sorted(p.name for p in own.iterdir() if not p.name.startswith("."))


async def answer(
    fleet: LocalFleet, client: httpx.AsyncClient, spec: AgentSpec, request: dict[str, Any]
) -> tuple[dict[str, Any], list[Round]]:
    """The agent's answer to `request`, finished, and its rounds, checked to rebuild it."""
    port = fleet.agent_ports[spec.device_id]
    reply = await ask(client, port, request, spec.device_id, False)
    assert reply["status"] == "finished", reply
    with fleet.coordinator.sessions() as db:
        _, rounds = assert_rounds_rebuild(db, reply["session_id"], reply["token_ids"])
        db.expunge_all()
    return reply, rounds


async def until(what: str, done: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def fetches_for(fleet: LocalFleet, device_id: str) -> list[Any]:
    """The drafts-on-demand fetches that ended for the device, oldest first."""
    fetches = fleet.coordinator.book.fetches
    assert fetches is not None
    return [o for o in fetches.outcomes if o.device_id == device_id]


def device_notes(rounds: list[Round]) -> list[str]:
    """Why the device drafted a round with another drafter than the one asked for."""
    return [r.policy["device"]["note"] for r in rounds if r.policy and "device" in r.policy]
