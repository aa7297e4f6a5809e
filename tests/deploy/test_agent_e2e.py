"""An agent installed from its wheel alone gets a draft over the air and decodes like the target.

The whole path of a new device: `devices provision`, `flash --target-dir` from the wheelhouse
(a fresh venv with the `agent` extra only), `models deploy` of a real draft over the artifact
API, then `specfleet-agent ask` from the installed venv: a greedy session over the bus through
the real coordinator and a verifier process, whose tokens must equal the target's own greedy
decoding (what `specfleet generate --mode target` prints).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest
from deploy_support import flash, run_cli
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from broker.mosquitto import free_port
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import DeviceStatus
from coordinator.stack import http_api
from coordinator.web.api.routes import artifacts
from core.settings import Settings
from inference.artifacts import default_models_dir
from inference.sampling import SamplingParams
from inference.speculative import decode_target
from localfleet.fleet import local_fleet
from modelbuild.target_build import load_target

# The machine's own Mosquitto (anonymous, loopback), which the coordinator tests share too.
SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
PROMPT = "Name three primary colours."
MAX_TOKENS = 16
ONLINE_TIMEOUT_S = 60.0

# In the slow set (the default suite's budget): the default suite installs the same wheel in
# test_agent_wheel and test_agent_package and brings the agent online; this one also decodes.
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow, pytest.mark.shared_mosquitto]


def ask(root: Path, port: int, draft: str) -> dict[str, object]:
    """`specfleet-agent ask` from the installed venv, through the running agent's local API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    done = subprocess.run(
        [
            str(root / "current" / "venv" / "bin" / "specfleet-agent"), "ask", PROMPT,
            "--max-tokens", str(MAX_TOKENS), "--draft", draft, "--local-api-port", str(port),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary: dict[str, object] = json.loads(done.stdout)
    return summary


async def scenario(
    tmp_path: Path, database_url: str, engine: Engine, wheelhouse: Path, draft_dir: Path
) -> tuple[dict[str, object], list[str]]:
    device_id = f"e2e-{secrets.token_hex(3)}"
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        models_dir=default_models_dir(),
        coordinator_id=f"coordinator-e2e-{secrets.token_hex(4)}",
    )
    root = tmp_path / "device" / "specfleet-agent"
    local_api_port = free_port()
    async with local_fleet(
        settings,
        [],
        [f"verifier-e2e-{secrets.token_hex(3)}"],
        workdir=tmp_path / "fleet",
        external_broker=SHARED_MOSQUITTO,
    ) as fleet:
        app = FastAPI()
        app.state.settings = settings
        app.state.sessions = make_sessionmaker(engine)
        app.include_router(artifacts.router, prefix="/api/v1")
        http_port = free_port()
        async with http_api(app, "127.0.0.1", http_port):
            bundle = tmp_path / "bundle"
            argv = ["devices", "provision", device_id, "--kind", "pi", "--out", str(bundle)]
            argv += ["--device-broker-url", SHARED_MOSQUITTO, "--database-url", database_url]
            assert await asyncio.to_thread(run_cli, argv) == 0
            with (bundle / "agent.toml").open("a") as config:  # an operator's own setting
                config.write(f"local_api_port = {local_api_port}\n")
            code = await asyncio.to_thread(
                flash,
                device_id,
                "--target-dir", str(root), "--bundle", str(bundle),
                "--wheelhouse", str(wheelhouse), "--start", "--no-wait",
            )  # fmt: skip
            assert code == 0
            registry = fleet.coordinator.registry
            deadline = time.monotonic() + ONLINE_TIMEOUT_S
            while (await asyncio.to_thread(registry.get, device_id)).status != DeviceStatus.ONLINE:
                assert time.monotonic() < deadline, "the installed agent never came online"
                await asyncio.sleep(0.2)

            deploy = ["models", "deploy", draft_dir.name, "--to", device_id, "--wave", "100"]
            deploy += ["--models-dir", str(draft_dir.parent), "--database-url", database_url]
            deploy += ["--artifact-url", f"http://127.0.0.1:{http_port}/api/v1"]
            assert await asyncio.to_thread(run_cli, deploy) == 0
            installed = (await asyncio.to_thread(registry.get, device_id)).installed_models

            summary = await asyncio.to_thread(ask, root, local_api_port, draft_dir.name)
    return summary, installed


def test_an_installed_agent_decodes_greedily_exactly_like_the_target(
    tmp_path: Path,
    pg_db: tuple[str, Engine],
    agent_wheelhouse: Path,
    draft_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, engine = pg_db
    monkeypatch.setenv("SPECFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECFLEET_BROKER_URL", SHARED_MOSQUITTO)
    root = tmp_path / "device" / "specfleet-agent"
    try:
        summary, installed = asyncio.run(
            scenario(tmp_path, url, engine, agent_wheelhouse, draft_dir)
        )
    finally:
        agentctl = root / "current" / "bin" / "agentctl"
        if agentctl.exists():
            subprocess.run([str(agentctl), "stop"], check=False, timeout=30)

    assert draft_dir.name in installed
    assert summary["status"] == "finished", summary
    # The OTA-installed draft drafted (the policy may switch drafters later in a session).
    assert summary["draft_models"][0] == draft_dir.name  # type: ignore[index]
    target, tokenizer = load_target(default_models_dir())
    reference = decode_target(
        target,
        tokenizer.apply_chat_template(PROMPT),
        MAX_TOKENS,
        SamplingParams(temperature=0.0),
        tokenizer.eos_id,
    )
    assert summary["token_ids"] == reference.tokens
