"""The device agent's own wheel, `specfleet-agent` (deploy/agent-wheel/): the device packages and
nothing else, and an install of it that loads no cloud, build or bench module.

The install is a fresh venv outside the repository with the wheel installed `--no-deps`; the
libraries it depends on come from this checkout's venv through a path file, offline (that path
holds no specfleet package: the checkout's own are reachable only through its editable finder,
which a path file does not run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from coordinator.ops.packaging import AGENT_PACKAGES, AGENT_WHEEL_CONFIG, build_agent_wheel

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[2]
# Top-level modules a device never loads: our cloud, build, harness and bench packages, and the
# libraries only they use.
NOT_ON_A_DEVICE = frozenset(
    {
        "coordinator", "verifier", "modelbuild", "bench", "sim", "localfleet", "specfleet",
        "netem", "migrations", "sqlalchemy", "alembic", "fastapi", "uvicorn", "psycopg",
        "amqtt", "onnx", "torch", "tensorflow", "gguf", "tqdm",
    }
)  # fmt: skip
# Run by the installed venv's Python: import every module of the agent, draft a few tokens with
# a real model as an installed agent checks a new one, then list what is loaded and from where.
PROBE = """
import importlib, json, pkgutil, sys
from pathlib import Path
import device_agent
from device_agent.models_store import smoke_draft
names = [i.name for i in pkgutil.walk_packages(device_agent.__path__, "device_agent.")]
for name in names:
    importlib.import_module(name)
tokens = smoke_draft(Path(sys.argv[1]), sys.argv[2], "onnx")
print(json.dumps({
    "agent_modules": names,
    "tokens": tokens,
    "loaded": sorted({n.split(".")[0] for n in sys.modules}),
    "files": {n: sys.modules[n].__file__ for n in ("core", "broker", "inference", "device_agent")},
    "missing": [n for n in ("coordinator", "modelbuild", "bench", "verifier")
                if importlib.util.find_spec(n) is None],
}))
"""


@pytest.fixture(scope="module")
def agent_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_wheel(tmp_path_factory.mktemp("agent-wheel"))


@pytest.fixture(scope="module")
def agent_venv(agent_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv, outside the checkout, with the agent's wheel and nothing else of ours."""
    venv = tmp_path_factory.mktemp("agent-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
            "--no-deps", "--no-index", str(agent_wheel),
        ],
        check=True,
        timeout=300,
    )  # fmt: skip
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    libraries = sysconfig.get_paths()["purelib"]  # this checkout's venv: numpy, onnxruntime, ...
    (Path(site) / "checkout_libraries.pth").write_text(libraries + "\n")
    return venv


def test_the_wheel_carries_the_device_packages_and_the_agent_command(agent_wheel: Path) -> None:
    assert agent_wheel.name.startswith("specfleet_agent-")
    with zipfile.ZipFile(agent_wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        (entry_points_name,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = archive.read(entry_points_name).decode()
    packages = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert packages == set(AGENT_PACKAGES)
    # Every module of those packages is in it (a package left out by find would fail an import).
    for package in AGENT_PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            assert path.relative_to(REPO_ROOT).as_posix() in names
    requirements = [r.split(";")[0].split("[")[0] for r in metadata.get_all("Requires-Dist")]
    names_only = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in requirements}
    assert "onnxruntime" in names_only and "ai-edge-litert" in names_only  # the two extras
    assert not names_only & NOT_ON_A_DEVICE
    assert sorted(metadata.get_all("Provides-Extra")) == ["litert", "onnx"]
    assert "specfleet-agent = device_agent.cli:main" in entry_points


def test_its_dependencies_are_the_projects_base_ones_and_its_agent_extras() -> None:
    """The agent's wheel lists its dependencies itself; they stay those of the main project's
    `agent` / `agent-litert` extras (each is the base set, the shared libraries and a runtime)."""
    main = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    agent = tomllib.loads((REPO_ROOT / AGENT_WHEEL_CONFIG).read_text())["project"]
    extras = main["optional-dependencies"]
    for runtime, main_extra in (("onnx", "agent"), ("litert", "agent-litert")):
        wheel_side = set(agent["dependencies"]) | set(agent["optional-dependencies"][runtime])
        assert wheel_side == set(main["dependencies"]) | set(extras[main_extra]), runtime
    assert not any(r.startswith("onnx>") for r in extras["agent"])


def test_an_installed_agent_loads_no_cloud_build_or_bench_module(
    agent_venv: Path, draft_dir: Path, tmp_path: Path
) -> None:
    python = str(agent_venv / "bin" / "python")
    done = subprocess.run(
        [python, "-c", PROBE, str(draft_dir.parent), draft_dir.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # outside the checkout: nothing of ours on the path but the wheel's
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, file in report["files"].items():
        assert Path(file).is_relative_to(agent_venv), f"{name} came from {file}"
    assert set(report["missing"]) == {"coordinator", "modelbuild", "bench", "verifier"}
    assert "device_agent.agent" in report["agent_modules"]
    assert len(report["tokens"]) > 0
    assert not set(report["loaded"]) & NOT_ON_A_DEVICE, report["loaded"]


def test_the_installed_command_runs(agent_venv: Path, tmp_path: Path) -> None:
    command = agent_venv / "bin" / "specfleet-agent"
    done = subprocess.run(
        [str(command), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "run" in done.stdout and "completion" in done.stdout
    # Its own parse of `--help` loads nothing of the cloud either.
    probe = (
        "import json, sys; from device_agent.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))"
    )
    done = subprocess.run(
        [str(agent_venv / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "device_agent" in loaded
    assert not loaded & NOT_ON_A_DEVICE, loaded
