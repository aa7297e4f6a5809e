"""The agent installs from its own wheel (`specfleet-agent[onnx]`) alone, offline, and runs as a
device.

`specfleet flash --target-dir` builds the release (a fresh venv filled from the wheelhouse with
`pip install --no-index`), starts `specfleet-agent run` from it, and waits until the agent
reports online on a private Mosquitto with its own credential.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from deploy_support import Lab, flash, isolated

REPO_ROOT = Path(__file__).resolve().parents[2]
CLOUD_DISTRIBUTIONS = {"fastapi", "sqlalchemy", "uvicorn", "alembic", "psycopg", "amqtt", "gguf"}
CLOUD_MODULES = {
    "coordinator", "verifier", "modelbuild", "bench", "fastapi", "sqlalchemy", "alembic",
    "uvicorn", "psycopg", "onnx",
}  # fmt: skip


def venv_python(root: Path, code: str, *args: str) -> str:
    python = root / "current" / "venv" / "bin" / "python"
    # Run from the install root: in a checkout, its specfleet.egg-info would count as installed
    # and its packages would import.
    done = subprocess.run(
        [str(python), "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_agent_installs_from_its_wheel_alone_and_goes_online(
    lab: Lab,
    agent_wheelhouse: Path,
    draft_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = lab.provision("img-1")
    root = tmp_path / "image" / "opt" / "specfleet-agent"
    lab.roots.append(root)
    args = ["img-1", "--target-dir", str(root), "--bundle", str(bundle)]
    assert flash(*args, "--wheelhouse", str(agent_wheelhouse), "--start") == 0
    assert "img-1: online" in capsys.readouterr().out
    credential = (bundle / "credential").read_text().strip()
    assert isolated(lab, "img-1", credential)

    # Only the agent's dependencies are installed, and the agent imports none of the cloud's.
    names = venv_python(
        root,
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))",
    )
    installed = set(json.loads(names))
    assert "specfleet-agent" in installed and "onnxruntime" in installed
    assert not installed & CLOUD_DISTRIBUTIONS
    assert "specfleet" not in installed and "onnx" not in installed  # the agent's own wheel
    agent_modules = sorted(
        f"device_agent.{p.stem}" for p in (REPO_ROOT / "device_agent").glob("*.py")
    )
    loaded = venv_python(
        root,
        "import importlib, json, sys; [importlib.import_module(n) for n in sys.argv[1:]]; "
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))",
        *agent_modules,
    )
    assert not set(json.loads(loaded)) & CLOUD_MODULES

    # The installed agent drafts with a real model through the same path an OTA install checks.
    tokens = venv_python(
        root,
        "import sys; from pathlib import Path; "
        "from device_agent.models_store import smoke_draft; "
        "print(smoke_draft(Path(sys.argv[1]), sys.argv[2], 'onnx'))",
        str(draft_dir.parent),
        draft_dir.name,
    )
    assert len(json.loads(tokens)) > 0

    unit = (root / "current" / "specfleet-agent.service").read_text()
    assert f"ExecStart={root}/current/venv/bin/specfleet-agent run" in unit
