"""The agent's wheel, and an offline wheelhouse of it and its dependencies for a device's platform.

Devices install from the wheelhouse with `pip install --no-index`, so they need no internet and
no compiler; the operator's machine downloads the wheels once per platform.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
# What goes into the wheel: pyproject's package list plus the files setuptools reads.
SOURCE_FILES = ("pyproject.toml", "README.md")
# The device agent's wheel: its build config, and the packages it carries (the layers a device
# runs: pyproject.toml's [tool.importlinter] keeps the agent's imports inside them).
AGENT_WHEEL_CONFIG = Path("deploy") / "agent-wheel" / "pyproject.toml"
AGENT_PACKAGES = ("core", "broker", "inference", "device_agent")
SOURCE_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
PIP_TIMEOUT_S = 900.0
# The oldest manylinux (glibc 2.17, manylinux2014) that current wheels of the agent's libraries
# still target; a device older than that cannot run them.
MIN_GLIBC_MINOR = 17

Runtime = Literal["onnx", "litert"]
# Which optional-dependency set installs the agent with which draft runtime.
AGENT_EXTRAS: dict[Runtime, str] = {"onnx": "agent", "litert": "agent-litert"}
# The same, in the agent's own wheel (deploy/agent-wheel/pyproject.toml).
AGENT_WHEEL_EXTRAS: dict[Runtime, str] = {"onnx": "onnx", "litert": "litert"}


class PackagingError(Exception):
    """The wheel could not be built, or the wheelhouse could not be filled for the platform."""


def source_root() -> Path:
    """The checkout this code runs from; the wheel is built from it."""
    if not (REPO_ROOT / "pyproject.toml").is_file():
        raise PackagingError(
            "specfleet is not running from a source checkout: pass a built wheel (--wheel) or a "
            "wheelhouse (--wheelhouse)"
        )
    return REPO_ROOT


def _packages(root: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns: list[str] = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(
        {p.rstrip("*") for p in patterns if (root / p.rstrip("*") / "__init__.py").is_file()}
    )


def _run(command: Sequence[str], what: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            cwd=cwd,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PackagingError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise PackagingError(f"{what} failed: " + " | ".join(tail))
    return done.stdout


def build_wheel(out_dir: Path, root: Path | None = None) -> Path:
    """Build the specfleet wheel (every package) from a copy of the packages (a build in the
    checkout would leave build/ and *.egg-info beside other people's work)."""
    root = root or source_root()
    files = {name: root / name for name in SOURCE_FILES if (root / name).is_file()}
    return _build(out_dir, files, [root / p for p in _packages(root)], "specfleet")


def build_agent_wheel(out_dir: Path, root: Path | None = None) -> Path:
    """Build the device agent's wheel, `specfleet-agent`: the device packages alone, with the
    build config in deploy/agent-wheel/ (the agent's dependencies, the `onnx` and `litert`
    extras, the `specfleet-agent` command)."""
    root = root or source_root()
    files = {"pyproject.toml": root / AGENT_WHEEL_CONFIG}
    return _build(out_dir, files, [root / p for p in AGENT_PACKAGES], "specfleet_agent")


def _build(out_dir: Path, files: dict[str, Path], packages: list[Path], dist: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specfleet-wheel-") as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        for name, path in files.items():
            shutil.copy2(path, source / name)
        for package in packages:
            shutil.copytree(package, source / package.name, ignore=SOURCE_IGNORE)
        wheels = Path(tmp) / "wheels"
        _run(
            [
                sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--quiet", "--wheel-dir", str(wheels), str(source),
            ],
            f"building the {dist} wheel",
            cwd=Path(tmp),
        )  # fmt: skip
        (built,) = wheels.glob(f"{dist}-*.whl")
        target = out_dir / built.name
        shutil.copy2(built, target)
    return target


@dataclass(frozen=True)
class DevicePlatform:
    """What decides which wheels fit a device: its Python, CPU and C library."""

    python: str  # "3.11"
    machine: str  # "x86_64", "aarch64", "armv7l"
    libc: str  # "glibc", or "" where platform.libc_ver() knows none (Android's bionic, musl)
    libc_version: str  # "2.36"

    # Run on the device by its Python; prints one JSON object.
    PROBE = (
        "import json, platform, sys; "
        "libc, version = platform.libc_ver(); "
        "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
        "'machine': platform.machine(), 'libc': libc, 'libc_version': version}))"
    )

    @classmethod
    def from_probe(cls, output: str) -> DevicePlatform:
        try:
            document = json.loads(output.strip().splitlines()[-1])
            return cls(
                str(document["python"]),
                str(document["machine"]),
                str(document["libc"]),
                str(document["libc_version"]),
            )
        except (ValueError, KeyError, IndexError) as exc:
            raise PackagingError(f"cannot read the device's platform from {output!r}") from exc

    @classmethod
    def local(cls) -> DevicePlatform:
        return cls.from_probe(_run([sys.executable, "-c", cls.PROBE], "probing this machine"))

    @property
    def tag(self) -> str:
        """A directory name for the wheelhouse of this platform."""
        libc = f"{self.libc or 'nolibc'}{self.libc_version}"
        return f"cp{self.python.replace('.', '')}-{self.machine}-{libc}"

    def pip_platforms(self) -> list[str]:
        """pip's --platform tags this device accepts, newest first."""
        if self.libc != "glibc":
            raise PackagingError(
                f"no prebuilt wheels fit a {self.machine} device without glibc (Android, musl): "
                "install the agent on the device itself (see deploy/README.md) or pass a "
                "wheelhouse built there (--wheelhouse)"
            )
        try:
            major, minor = (int(x) for x in self.libc_version.split(".")[:2])
        except ValueError as exc:
            raise PackagingError(f"unreadable glibc version {self.libc_version!r}") from exc
        if (major, minor) < (2, MIN_GLIBC_MINOR):
            raise PackagingError(f"glibc {self.libc_version} is older than any wheel supports")
        arch = {"armv7l": "armv7l", "arm64": "aarch64"}.get(self.machine, self.machine)
        tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, MIN_GLIBC_MINOR - 1, -1)]
        return [*tags, f"manylinux2014_{arch}", f"linux_{arch}"]


def agent_requirement(wheel: Path, runtime: Runtime) -> str:
    """What pip installs from `wheel` on a device that drafts with `runtime`:
    `specfleet-agent[onnx]` from the agent's own wheel, `specfleet[agent]` from the whole
    project's."""
    if wheel.name.startswith("specfleet_agent-"):
        return f"specfleet-agent[{AGENT_WHEEL_EXTRAS[runtime]}]"
    return f"specfleet[{AGENT_EXTRAS[runtime]}]"


def build_wheelhouse(
    wheel: Path, runtime: Runtime, platform: DevicePlatform, dest: Path
) -> list[Path]:
    """Download the agent's dependencies for `platform` into `dest`, beside the wheel itself."""
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in ("specfleet-*.whl", "specfleet_agent-*.whl"):  # pip adds the one given below
        for old in dest.glob(pattern):
            old.unlink()
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
        "--only-binary=:all:", "--implementation", "cp", "--python-version", platform.python,
    ]  # fmt: skip
    for tag in platform.pip_platforms():
        command += ["--platform", tag]
    # pip itself too: the device runs it from its wheel, so its Python needs no ensurepip
    # (Raspberry Pi OS Lite and Debian ship python3 without python3-venv's ensurepip).
    command += ["pip", f"{agent_requirement(wheel, runtime)} @ {wheel.resolve().as_uri()}"]
    _run(command, f"downloading the agent's wheels for {platform.tag}")
    return sorted(dest.glob("*.whl"))
