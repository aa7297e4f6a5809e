"""`specfleet flash`: install the agent over SSH, or into a directory, as one staged release.

On the device, under its install root (default `~/specfleet-agent`):

    releases/<stamp>/   venv/, wheels/, bundle/, agent.toml, bin/agentctl, specfleet-agent.service
    current             -> releases/<stamp>, swapped with one rename
    state/              the agent's home (model store, pid and log): kept across upgrades

Every step before the swap writes only into the new release directory, so a failure there
removes it and leaves the device as it was. A failure after the swap (the service does not
start, or the agent never reports online) swaps the previous release back and restarts it.
An upgrade keeps the device's identity: the same id, the credential (from the bundle, or from
the device when the bundle no longer holds it) and the state directory.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from core.errors import CommandError

if TYPE_CHECKING:
    from coordinator.ops.packaging import DevicePlatform, Runtime
    from coordinator.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_ROOT = "specfleet-agent"  # relative to the device user's home
DEFAULT_ONLINE_TIMEOUT_S = 90.0
STEP_TIMEOUT_S = 900.0
KEEP_RELEASES = 2
UNIT_NAME = "specfleet-agent.service"
MIN_PYTHON = (3, 10)


class FlashError(Exception):
    """A step failed; `step` names it and `restored` says what state the device was left in."""

    def __init__(self, step: str, reason: str, restored: str) -> None:
        super().__init__(f"step {step!r} failed: {reason}; {restored}")
        self.step = step
        self.reason = reason
        self.restored = restored


# --- running commands on the device --------------------------------------------------------------


class Transport(Protocol):
    """Where the device's shell runs: over SSH, or here for --target-dir."""

    @property
    def description(self) -> str: ...

    def argv(self, script: str) -> list[str]:
        """The local command line that runs `script` with the device's POSIX shell."""
        ...


@dataclass(frozen=True)
class SshTransport:
    target: str  # user@host
    port: int | None = None
    identity: Path | None = None
    options: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        return f"ssh {self.target}" + (f" -p {self.port}" if self.port else "")

    def argv(self, script: str) -> list[str]:
        command = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15"]
        if self.port is not None:
            command += ["-p", str(self.port)]
        if self.identity is not None:
            command += ["-i", str(self.identity), "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            command += ["-o", option]
        # The remote login shell parses the command line once; sh -c gets the script intact.
        return [*command, self.target, f"sh -c {shlex.quote(script)}"]


@dataclass(frozen=True)
class LocalTransport:
    @property
    def description(self) -> str:
        return "this machine"

    def argv(self, script: str) -> list[str]:
        return ["sh", "-c", script]


def run_on_device(
    transport: Transport, script: str, *, stdin: bytes | None = None, timeout_s: float
) -> str:
    """Run `script`; its stdout, or RuntimeError with the end of its stderr."""
    try:
        done = subprocess.run(
            transport.argv(script),
            input=stdin,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            # pip on the device must not read the operator's pip configuration.
            env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout_s:g}s") from None
    except OSError as exc:
        raise RuntimeError(str(exc)) from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"exit {done.returncode}: " + " | ".join(tail or ["no output"]))
    return done.stdout.decode(errors="replace")


# --- the plan ------------------------------------------------------------------------------------


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


def render_template(path: Path, values: dict[str, str]) -> str:
    text = path.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def deploy_dir() -> Path:
    from coordinator.ops.packaging import source_root

    return source_root() / "deploy"


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
    templates = deploy_dir()
    values = {"ROOT": root, "USER": user}
    files: list[tuple[str, bytes, int]] = [
        ("agent.toml", provisioning.render_toml(config).encode(), 0o600),
        ("bin/agentctl", render_template(templates / "agentctl", values).encode(), 0o755),
        (UNIT_NAME, render_template(templates / "systemd" / UNIT_NAME, values).encode(), 0o644),
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


class Flash:
    """Plans and runs the steps of one flash; `steps()` is what --dry-run prints."""

    def __init__(
        self, options: FlashOptions, settings: Settings, log: Callable[[str], None] = print
    ) -> None:
        self.options = options
        self.settings = settings
        self.log = log
        self.facts: DeviceFacts | None = None
        self.stamp = release_stamp()
        self.wheels: list[Path] = []
        self.swapped = False
        self.previous: str | None = None

    # --- facts -------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        if self.facts is not None:
            return self.facts.root
        root = self.options.root
        return root if root.startswith("/") else f"~/{root}"

    @property
    def release_dir(self) -> str:
        return f"{self.root}/releases/{self.stamp}"

    def _run(self, script: str, stdin: bytes | None = None) -> str:
        return run_on_device(self.options.transport, script, stdin=stdin, timeout_s=STEP_TIMEOUT_S)

    # --- the steps ---------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        o = self.options
        q = _q
        rel, root = self.release_dir, self.root
        pip = f"{q(rel)}/venv/bin/python {q(rel)}/wheels/pip-*.whl/pip"
        service = (
            "install the systemd unit, enable and restart it"
            if o.systemd
            else "restart the agent with nohup (bin/agentctl; no systemd)"
        )
        steps = [
            Step(
                "probe",
                f"look at the device ({o.transport.description}): Python, CPU, systemd, "
                "an existing install",
                self.probe,
                probe_script(o.python, o.root),
            ),
            Step(
                "wheelhouse",
                "build the specfleet wheel and gather its dependencies for the device's platform"
                if o.wheelhouse is None
                else f"use the wheelhouse {o.wheelhouse}",
                self.wheelhouse,
            ),
            Step(
                "upload",
                f"copy wheels, bundle, config and service files into {rel}",
                self.upload,
                f"mkdir -p {q(rel)} && tar -x -C {q(rel)}",
            ),
            Step(
                "venv",
                f"create a virtual environment with {o.python} (pip runs from its wheel)",
                self.venv,
                f"{q(o.python)} -m venv --without-pip {q(rel)}/venv",
            ),
            Step(
                "install",
                f"install specfleet[{self._extra()}] from the uploaded wheels only",
                self.install,
                f"{pip} install --no-index --find-links {q(rel)}/wheels "
                f"'specfleet[{self._extra()}]'",
            ),
            Step(
                "check",
                "load the agent's config with the new install",
                self.check,
                f"{q(rel)}/venv/bin/python -c 'from device_agent.settings import ...'",
            ),
            Step(
                "swap",
                f"point {root}/current at the new release (one rename)",
                self.swap,
                f"ln -s releases/{self.stamp} {q(root)}/current.new && rename it over current",
            ),
        ]
        if o.start:
            steps.append(Step("service", service, self.service))
            if o.wait_online:
                steps[-1].description += f"; wait up to {o.online_timeout_s:g}s for 'online'"
        steps.append(Step("prune", f"keep the newest {KEEP_RELEASES} releases", self.prune))
        return steps

    def _extra(self) -> str:
        from coordinator.ops.packaging import AGENT_EXTRAS

        return AGENT_EXTRAS[self.options.runtime]

    def probe(self) -> None:
        platform, facts = parse_probe(
            self._run(probe_script(self.options.python, self.options.root))
        )
        python = tuple(int(x) for x in platform.python.split("."))
        if python < MIN_PYTHON:
            raise RuntimeError(f"Python {platform.python} on the device; the agent needs 3.10+")
        if facts.get("venv") != "yes":
            raise RuntimeError(
                f"{self.options.python} has no venv module (Debian: apt install python3-venv)"
            )
        systemd = facts.get("systemd") == "yes"
        if self.options.systemd and self.options.start and not systemd:
            raise RuntimeError("systemd is not running on the device: use --no-systemd")
        self.facts = DeviceFacts(
            platform=platform,
            home=facts["home"],
            root=facts["root"],
            systemd=systemd,
            uid=int(facts["uid"]),
            current=facts.get("current") or None,
            has_credential=facts.get("credential") == "yes",
        )
        from coordinator.ops.provisioning import CREDENTIAL_FILE

        if not (self.options.bundle / CREDENTIAL_FILE).is_file() and not self.facts.has_credential:
            raise RuntimeError(
                "neither the bundle nor the device holds a credential: "
                f"run `specfleet devices provision {self.options.device_id} --rotate`"
            )
        self.log(
            f"  device: Python {platform.python} on {platform.machine} ({platform.libc} "
            f"{platform.libc_version}), systemd {'yes' if systemd else 'no'}, "
            f"{'upgrading ' + self.facts.current if self.facts.current else 'first install'}"
        )

    def wheelhouse(self) -> None:
        from coordinator.ops import packaging

        if self.options.wheelhouse is not None:
            self.wheels = sorted(self.options.wheelhouse.glob("*.whl"))
            for needed in ("specfleet-", "pip-"):
                if not any(w.name.startswith(needed) for w in self.wheels):
                    raise RuntimeError(f"no {needed}*.whl in {self.options.wheelhouse}")
            return
        assert self.facts is not None
        cache = self.options.cache_dir or self.settings.home / "wheelhouse"
        dest = cache / f"{self.facts.platform.tag}-{self.options.runtime}"
        wheel = packaging.build_wheel(cache / "built")
        self.wheels = packaging.build_wheelhouse(
            wheel, self.options.runtime, self.facts.platform, dest
        )
        self.log(f"  {len(self.wheels)} wheels in {dest}")

    def upload(self) -> None:
        assert self.facts is not None
        archive = release_archive(
            self.options,
            release_dir=self.release_dir,
            root=self.root,
            user=self._user(),
            wheels=self.wheels,
        )
        rel = _q(self.release_dir)
        script = [f"set -e; mkdir -p {rel}; chmod 700 {rel}; tar -x -C {rel}"]
        from coordinator.ops.provisioning import CREDENTIAL_FILE

        if not (self.options.bundle / CREDENTIAL_FILE).is_file():
            # Keep the identity the device already has.
            script.append(f"cp -p {_q(self.root)}/current/bundle/{CREDENTIAL_FILE} {rel}/bundle/")
        self._run("; ".join(script), stdin=archive)
        self.log(f"  {len(archive) / 1e6:.1f} MB into {self.release_dir}")

    def _user(self) -> str:
        target = getattr(self.options.transport, "target", "")
        if "@" in target:
            return str(target.split("@", 1)[0])
        import getpass

        return getpass.getuser()

    def venv(self) -> None:
        self._run(f"{_q(self.options.python)} -m venv --without-pip {_q(self.release_dir)}/venv")

    def install(self) -> None:
        rel = _q(self.release_dir)
        # Byte-compiling every library at install costs more than compiling what is imported.
        self._run(
            f'set -e; pip=$(ls {rel}/wheels/pip-*.whl | head -n 1); [ -n "$pip" ]; '
            f'{rel}/venv/bin/python "$pip/pip" install --quiet --disable-pip-version-check '
            f"--no-compile --no-index --find-links {rel}/wheels 'specfleet[{self._extra()}]'"
        )

    def check(self) -> None:
        rel = self.release_dir
        code = (
            "import sys; from pathlib import Path; "
            "from device_agent.settings import load_agent_settings; "
            "import device_agent.agent; "
            "s = load_agent_settings(Path(sys.argv[1])); "
            "assert s.device_id == sys.argv[2], s.device_id; "
            "assert s.credential, 'no credential'; print(s.device_id)"
        )
        self._run(
            f"{_q(rel)}/venv/bin/python -c {_q(code)} {_q(rel)}/agent.toml "
            f"{_q(self.options.device_id)}"
        )

    def _point_current(self, release: str | None) -> None:
        root = _q(self.root)
        if release is None:
            self._run(f"rm -f {root}/current")
            return
        swap = "import os, sys; os.replace(sys.argv[1], sys.argv[2])"  # atomic, unlike ln -sf
        self._run(
            f"set -e; rm -f {root}/current.new; ln -s releases/{_q(release)} {root}/current.new; "
            f"{_q(self.options.python)} -c {_q(swap)} {root}/current.new {root}/current"
        )

    def swap(self) -> None:
        assert self.facts is not None
        self.previous = self.facts.current
        self._point_current(self.stamp)
        self.swapped = True

    def _restart_script(self) -> str:
        root = _q(self.root)
        if not self.options.systemd:
            return f"{root}/current/bin/agentctl restart"
        assert self.facts is not None
        sudo = "" if self.facts.uid == 0 else "sudo -n "
        unit = f"/etc/systemd/system/{UNIT_NAME}"
        return (
            f"set -e; {sudo}install -m 0644 {root}/current/{UNIT_NAME} {unit}; "
            f"{sudo}systemctl daemon-reload; {sudo}systemctl enable --quiet {UNIT_NAME}; "
            f"{sudo}systemctl restart {UNIT_NAME}"
        )

    def service(self) -> None:
        if not self.options.wait_online:
            self._run(self._restart_script())
            return
        started = time.monotonic()
        asyncio.run(self._restart_and_wait())
        self.log(f"  online after {time.monotonic() - started:.1f}s")

    async def _restart_and_wait(self) -> None:
        from broker import messages as m
        from broker.client import BrokerAddress, ConnectOptions, connect
        from broker.topics import DeviceChannel, device_topic
        from core.aio import timeout

        options = ConnectOptions(
            client_id=f"flash-{self.options.device_id}-{os.getpid()}"[:64],
            username=self.settings.broker_username,
            password=self.settings.broker_password,
            protocol=self.settings.mqtt_protocol,
        )
        address = BrokerAddress.from_url(self.settings.broker_url)
        async with connect(address, options) as client:
            # Subscribed before the restart: a live (not retained) "online" is the new agent's.
            await client.subscribe(device_topic(self.options.device_id, DeviceChannel.STATUS))
            await asyncio.to_thread(self._run, self._restart_script())
            try:
                async with timeout(self.options.online_timeout_s):
                    async for incoming in client.messages():
                        if incoming.retain:
                            continue
                        try:
                            status = m.decode_as(incoming.payload, m.Status)
                        except m.BusError:
                            continue
                        if status.state is m.DeviceState.ONLINE:
                            return
            except TimeoutError:
                raise RuntimeError(
                    f"the agent did not report online within {self.options.online_timeout_s:g}s"
                    f" (see {self.root}/state/agent.log or journalctl -u {UNIT_NAME})"
                ) from None

    def prune(self) -> None:
        root = _q(self.root)
        self._run(
            f"cd {root}/releases && ls -1 | grep -v '^\\.' | sort -r | tail -n +{KEEP_RELEASES + 1}"
            " | while read -r old; do "
            f'[ "releases/$old" = "$(readlink {root}/current)" ] || rm -rf -- "$old"; done'
        )

    # --- running -----------------------------------------------------------------------------

    def _undo(self) -> str:
        """Put the device back as it was; returns a description of where it is now."""
        rel = _q(self.release_dir)
        try:
            if self.swapped:
                self._point_current(self.previous)
                if self.previous is not None and self.options.start:
                    self._run(self._restart_script())
                elif self.options.start and not self.options.systemd:
                    self._run(f"{rel}/bin/agentctl stop")
                elif self.options.start:
                    sudo = "" if self.facts is None or self.facts.uid == 0 else "sudo -n "
                    self._run(f"{sudo}systemctl disable --now --quiet {UNIT_NAME}")
                self.swapped = False
            self._run(f"rm -rf {rel}")
        except RuntimeError as exc:
            return f"the undo failed too ({exc}); inspect {self.root} on the device"
        if self.previous:
            return f"the device is back on its previous release {self.previous}"
        return "nothing of this flash is left on the device"

    def run(self) -> None:
        for number, step in enumerate(self.steps(), start=1):
            self.log(f"[{number}] {step.name}: {step.description}")
            started = time.monotonic()
            try:
                step.action()
                self.log(f"    done in {time.monotonic() - started:.1f}s")
            except (RuntimeError, OSError, ValueError) as exc:
                restored = (
                    "nothing was changed on the device"
                    if step.name in ("probe", "wheelhouse")
                    else self._undo()
                )
                raise FlashError(step.name, str(exc), restored) from exc
            except Exception as exc:  # packaging and provisioning errors have their own types
                restored = (
                    "nothing was changed on the device" if self.facts is None else self._undo()
                )
                raise FlashError(step.name, f"{type(exc).__name__}: {exc}", restored) from exc

    def dry_run(self) -> None:
        for number, step in enumerate(self.steps(), start=1):
            self.log(f"[{number}] {step.name}: {step.description}")
            if step.script is not None:
                for line in step.script.splitlines():
                    self.log(f"      $ {line}")


# --- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("device_id", metavar="NAME", help="a provisioned device")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ssh", metavar="USER@HOST", help="flash this device over SSH")
    where.add_argument(
        "--target-dir",
        type=Path,
        metavar="DIR",
        help="install into DIR on this machine (an image being built, or Termux run locally)",
    )
    parser.add_argument("--port", type=int, help="SSH port (Termux's sshd listens on 8022)")
    parser.add_argument("--identity", type=Path, help="SSH private key file")
    parser.add_argument(
        "--ssh-option", action="append", default=[], metavar="OPT", help="ssh -o OPT (repeat)"
    )
    parser.add_argument("--python", default="python3", help="the device's Python 3.10+")
    parser.add_argument(
        "--root",
        help=f"install root on the device (default: ~/{DEFAULT_ROOT}; with --target-dir: DIR)",
    )
    parser.add_argument(
        "--runtime",
        choices=["onnx", "litert"],
        default="onnx",
        help="draft runtime: ONNX Runtime (default) or LiteRT",
    )
    parser.add_argument(
        "--no-systemd",
        action="store_true",
        help="start the agent with nohup (bin/agentctl) instead of a systemd unit",
    )
    parser.add_argument(
        "--start",
        action="store_true",
        help="with --target-dir: start the agent and wait for it (default: install only)",
    )
    parser.add_argument("--no-wait", action="store_true", help="do not wait for 'online'")
    parser.add_argument(
        "--online-timeout",
        type=float,
        default=DEFAULT_ONLINE_TIMEOUT_S,
        metavar="S",
        help="with --start, how long to wait for the device to come online "
        f"(default {DEFAULT_ONLINE_TIMEOUT_S:g}s)",
    )
    parser.add_argument("--bundle", type=Path, help="default: <home>/bundles/NAME")
    parser.add_argument(
        "--device-broker-url", metavar="URL", help="override the bundle's broker URL"
    )
    parser.add_argument(
        "--wheelhouse",
        type=Path,
        metavar="DIR",
        help="install from these wheels (specfleet's and its dependencies') instead of "
        "building them here",
    )
    parser.add_argument("--dry-run", action="store_true", help="print every step; change nothing")


def registered_kind(database_url: str, device_id: str) -> str | None:
    """The device's kind if the registry holds it; None if not, or if the registry cannot be
    read (the caller only words a hint with it)."""
    import sqlalchemy as sa
    import sqlalchemy.exc

    from coordinator.db.engine import NoSuchDatabase, make_engine
    from coordinator.db.models import Device

    try:
        engine = make_engine(database_url, create=False)
    except (NoSuchDatabase, ValueError, sqlalchemy.exc.ArgumentError) as exc:
        log.debug("no registry to look %s up in: %s", device_id, exc)
        return None
    try:
        with engine.connect() as connection:
            kind = connection.scalar(sa.select(Device.kind).where(Device.id == device_id))
    except sqlalchemy.exc.SQLAlchemyError as exc:
        log.debug("could not look %s up in the registry: %s", device_id, exc)
        return None
    finally:
        engine.dispose()
    return kind.value if kind is not None else None


def _missing_bundle_hint(database_url: str, device_id: str) -> str:
    kind = registered_kind(database_url, device_id)
    if kind is None:
        return f"run `specfleet devices provision {device_id} --kind KIND` first"
    # `devices add` registers a device and prints its credential, but writes no bundle.
    return (
        f"{device_id} is registered but has no bundle (`devices add` writes none); "
        f"`specfleet devices provision {device_id} --kind {kind} --rotate` writes one, "
        "with a new credential"
    )


def options_from_args(args: argparse.Namespace, settings: Settings) -> FlashOptions:
    from broker.topics import validate_device_id

    try:
        validate_device_id(args.device_id)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    bundle: Path = args.bundle or settings.home / "bundles" / args.device_id
    if not (bundle / "device.json").is_file():
        raise CommandError(
            f"no bundle for {args.device_id} at {bundle}: "
            + _missing_bundle_hint(settings.database_url, args.device_id)
        )
    device = json.loads((bundle / "device.json").read_text())
    if device.get("device_id") != args.device_id:
        raise CommandError(f"{bundle} is the bundle of {device.get('device_id')!r}")
    if args.wheelhouse is not None and not args.wheelhouse.is_dir():
        raise CommandError(f"--wheelhouse {args.wheelhouse} is not a directory")
    transport: Transport
    if args.ssh:
        transport = SshTransport(args.ssh, args.port, args.identity, tuple(args.ssh_option))
        root = args.root or DEFAULT_ROOT
        start = True
        systemd = not args.no_systemd
    else:
        transport = LocalTransport()
        root = str((args.root and Path(args.root)) or args.target_dir.resolve())
        start = args.start
        systemd = False  # a directory has no service manager of its own
    if args.online_timeout <= 0:
        raise CommandError("--online-timeout must be positive")
    return FlashOptions(
        device_id=args.device_id,
        bundle=bundle,
        transport=transport,
        python=args.python,
        root=root,
        runtime=args.runtime,
        systemd=systemd,
        start=start,
        wait_online=not args.no_wait,
        online_timeout_s=args.online_timeout,
        device_broker_url=args.device_broker_url,
        wheelhouse=args.wheelhouse,
    )


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from coordinator.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc.errors()[0]['msg']}") from exc
    options = options_from_args(args, settings)
    flash = Flash(options, settings, log=lambda line: print(line, flush=True))
    if args.dry_run:
        print(f"flash {options.device_id} via {options.transport.description} (dry run):")
        flash.dry_run()
        return 0
    if options.start and options.wait_online and not settings.broker_username:
        raise CommandError(
            "waiting for 'online' needs the bus: set SPECFLEET_BROKER_USERNAME and "
            "SPECFLEET_BROKER_PASSWORD (a coordinator or observer account), or pass --no-wait"
        )
    try:
        flash.run()
    except FlashError as exc:
        print(f"specfleet flash: {exc}", file=sys.stderr)
        return 1
    state = "online" if options.start and options.wait_online else "installed"
    print(f"{options.device_id}: {state}, release {flash.stamp} in {flash.root}")
    return 0
