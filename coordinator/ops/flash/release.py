"""A release as flash stages it: the options, what the device reports, the steps, and the
archive it uploads (wheels, bundle, config, and the service files rendered from the
templates in this package)."""

from __future__ import annotations

import io
import shlex
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.ops.flash.transport import Transport

if TYPE_CHECKING:
    from coordinator.ops.packaging import DevicePlatform, Runtime


DEFAULT_ROOT = "specfleet-agent"  # relative to the device user's home


DEFAULT_ONLINE_TIMEOUT_S = 90.0


STEP_TIMEOUT_S = 900.0


KEEP_RELEASES = 2


UNIT_NAME = "specfleet-agent.service"


MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class FlashOptions:
    device_id: str
    bundle: Path
    transport: Transport
    python: str = "python3"
    root: str = DEFAULT_ROOT
    runtime: Runtime = "onnx"
    systemd: bool = True
    start: bool = True
    wait_online: bool = True
    online_timeout_s: float = DEFAULT_ONLINE_TIMEOUT_S
    device_broker_url: str | None = None  # overrides the bundle's
    wheelhouse: Path | None = None  # prebuilt; else built (and cached) here
    cache_dir: Path | None = None  # where built wheelhouses are kept


@dataclass
class DeviceFacts:
    """What the probe found on the device."""

    platform: DevicePlatform
    home: str
    root: str  # absolute
    systemd: bool
    uid: int
    current: str | None  # the active release's directory name, if any
    has_credential: bool  # the active release holds a credential file


@dataclass
class Step:
    name: str
    description: str
    action: Callable[[], None]
    script: str | None = None  # shown by --dry-run


def _q(value: str) -> str:
    return shlex.quote(value)


def probe_script(python: str, root: str) -> str:
    from coordinator.ops.packaging import DevicePlatform

    root_expr = root if root.startswith("/") else f'"$HOME"/{_q(root)}'
    return "\n".join(
        [
            "set -e",
            f"PY={_q(python)}",
            'command -v "$PY" >/dev/null 2>&1 || { echo "no $PY on the device" >&2; exit 3; }',
            f'"$PY" -c {_q(DevicePlatform.PROBE)}',
            f"ROOT={root_expr}",
            'echo "home=$HOME"',
            'echo "root=$ROOT"',
            'echo "uid=$(id -u)"',
            "if [ -d /run/systemd/system ]; then echo systemd=yes; else echo systemd=no; fi",
            'if [ -L "$ROOT/current" ]; then',
            '  echo "current=$(basename "$(readlink "$ROOT/current")")"',
            "else echo current=; fi",
            'if [ -f "$ROOT/current/bundle/credential" ]; then echo credential=yes;'
            " else echo credential=no; fi",
            '"$PY" -c "import venv" >/dev/null 2>&1 && echo venv=yes || echo venv=no',
        ]
    )


def parse_probe(output: str) -> tuple[DevicePlatform, dict[str, str]]:
    from coordinator.ops.packaging import DevicePlatform

    lines = output.strip().splitlines()
    platform_line = next((line for line in lines if line.startswith("{")), "")
    facts = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("{"))
    return DevicePlatform.from_probe(platform_line), facts


def release_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


def render_template(path: Traversable, values: dict[str, str]) -> str:
    text = path.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


# The service files a release installs, shipped with this package (package data), so that flash
# runs from an installed wheel as from a checkout; rendered per device by render_template.
TEMPLATES = resources.files("coordinator.ops.flash") / "templates"


def service_files(root: str, user: str) -> list[tuple[str, str, int]]:
    """The release's start/stop script and systemd unit, rendered for its root and user:
    (path in the release, text, mode)."""
    values = {"ROOT": root, "USER": user}
    return [
        ("bin/agentctl", render_template(TEMPLATES / "agentctl", values), 0o755),
        (UNIT_NAME, render_template(TEMPLATES / UNIT_NAME, values), 0o644),
    ]


def release_archive(
    options: FlashOptions,
    *,
    release_dir: str,
    root: str,
    user: str,
    wheels: Sequence[Path],
) -> bytes:
    """The new release as a tar: wheels, bundle, the device's config and the service files."""
    from coordinator.ops import provisioning

    device = provisioning.read_bundle_device(options.bundle)
    broker_url = options.device_broker_url or str(device["broker_url"])
    has_ca = (options.bundle / provisioning.CA_FILE).is_file()
    # The bundle's own settings (an operator may have added some, e.g. default_draft) with its
    # relative paths made absolute for this release.
    config = provisioning.read_bundle_config(options.bundle)
    config.update(
        provisioning.agent_config(
            device_id=options.device_id,
            kind=str(device["kind"]),
            broker_url=broker_url,
            directory=Path(release_dir) / "bundle",
            has_ca=has_ca,
        )
    )
    config["home"] = f"{root}/state"
    files: list[tuple[str, bytes, int]] = [
        ("agent.toml", provisioning.render_toml(config).encode(), 0o600),
        *((name, text.encode(), mode) for name, text, mode in service_files(root, user)),
    ]
    for path in sorted(options.bundle.iterdir()):
        if path.is_file() and path.name != provisioning.CONFIG_FILE:
            mode = 0o600 if path.name == provisioning.CREDENTIAL_FILE else 0o644
            files.append((f"bundle/{path.name}", path.read_bytes(), mode))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, payload, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(payload), mode, int(time.time())
            tar.addfile(info, io.BytesIO(payload))
        for wheel in wheels:
            tar.add(wheel, arcname=f"wheels/{wheel.name}")
    return buffer.getvalue()
