"""Provisioning: a registry entry, the broker's files and reload, the bundle a device boots with.

A bundle is one directory per device:

    agent.toml            the agent's config; paths in it are relative to the bundle directory
    credential            the device's secret (0600); the registry keeps only its hash
    release-key.pub.pem   the coordinator's Ed25519 key that signs model releases
    ca.crt                the broker's CA, when the broker URL is mqtts:// and a CA was given
    drafts.json           manifests of the drafts chosen for this device
    device.json           what was provisioned (id, kind, tags, broker, when)
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from broker import acl
from broker.acl import Access, AclRule, BrokerFiles, DeviceAccount
from inference.artifacts import ModelManifest

CONFIG_FILE = "agent.toml"
CREDENTIAL_FILE = "credential"
RELEASE_KEY_FILE = "release-key.pub.pem"
CA_FILE = "ca.crt"
DRAFTS_FILE = "drafts.json"
DEVICE_FILE = "device.json"
RELOAD_TIMEOUT_S = 30.0

TomlValue = str | int | float | bool


class ProvisioningError(Exception):
    """Broker files that cannot be updated, a broker that cannot be reloaded, a bad bundle."""


# --- the broker's files --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExistingAccount:
    """An account already in the broker files that is not a registry device (a service user)."""

    username: str
    credential_hash: str
    rules: tuple[AclRule, ...]


def parse_acl(text: str) -> dict[str, tuple[AclRule, ...]]:
    """username -> rules, from an acl file of `user` blocks and `topic ACCESS FILTER` lines."""
    blocks: dict[str, list[AclRule]] = {}
    current: list[AclRule] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword == "user":
            current = blocks.setdefault(rest.strip(), [])
        elif keyword == "topic" and current is not None:
            access, _, topic = rest.strip().partition(" ")
            try:
                current.append(AclRule(Access(access), topic.strip()))
            except ValueError as exc:
                raise ProvisioningError(f"acl line {number}: {exc}") from None
        else:
            raise ProvisioningError(f"acl line {number}: cannot keep {line!r}")
    return {user: tuple(rules) for user, rules in blocks.items()}


def service_accounts(broker_dir: Path, registered_ids: Iterable[str]) -> set[str]:
    """The usernames in `broker_dir`'s password file that are no device's: the service users."""
    passwords_path = broker_dir / acl.PASSWORD_FILE
    try:
        hashes = acl.parse_passwords(passwords_path.read_text()) if passwords_path.exists() else {}
    except (OSError, ValueError) as exc:
        raise ProvisioningError(f"{passwords_path}: {exc}") from exc
    return set(hashes) - set(registered_ids)


def sync_broker_files(
    broker_dir: Path, devices: Sequence[DeviceAccount], registered_ids: Iterable[str]
) -> BrokerFiles:
    """Rewrite acl and passwords in `broker_dir` from the registry's devices.

    Accounts that are not devices (`registered_ids` are every device id ever registered, retired
    ones included) keep their hash and their rules; the config file is left as it is.
    """
    config = broker_dir / acl.CONFIG_FILE
    passwords_path = broker_dir / acl.PASSWORD_FILE
    acl_path = broker_dir / acl.ACL_FILE
    if not config.is_file():
        raise ProvisioningError(
            f"{config} does not exist: run `specfleet broker write-config --out {broker_dir}` first"
        )
    try:
        hashes = acl.parse_passwords(passwords_path.read_text()) if passwords_path.exists() else {}
        rules = parse_acl(acl_path.read_text()) if acl_path.exists() else {}
    except ValueError as exc:
        raise ProvisioningError(f"{broker_dir}: {exc}") from exc
    device_ids = set(registered_ids)
    services = [
        ExistingAccount(name, credential_hash, rules.get(name, ()))
        for name, credential_hash in hashes.items()
        if name not in device_ids
    ]
    try:
        acl_text = acl.generate_acl(devices, services)
        passwords_text = acl.generate_passwords(devices, services)
    except ValueError as exc:
        raise ProvisioningError(str(exc)) from exc
    return acl.write_broker_files(
        broker_dir,
        config_text=config.read_text(),
        acl_text=acl_text,
        passwords_text=passwords_text,
    )


@dataclass(frozen=True)
class BrokerReload:
    """How to make Mosquitto re-read its files: SIGHUP to the pid in a file, or a command."""

    pid_file: Path | None = None
    command: str | None = None  # e.g. "systemctl reload mosquitto"

    def run(self) -> str:
        """Reload; returns what was done, for the operator."""
        if self.pid_file is not None:
            try:
                pid = int(self.pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGHUP)
            except (OSError, ValueError, IndexError) as exc:
                raise ProvisioningError(
                    f"cannot signal the broker from {self.pid_file}: {exc}"
                ) from exc
            return f"sent SIGHUP to mosquitto (pid {pid})"
        if self.command is not None:
            try:
                done = subprocess.run(
                    shlex.split(self.command),
                    capture_output=True,
                    text=True,
                    timeout=RELOAD_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ProvisioningError(f"broker reload command failed: {exc}") from exc
            if done.returncode != 0:
                reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
                raise ProvisioningError(
                    f"broker reload command exited {done.returncode}: {reason[0]}"
                )
            return f"ran {self.command!r}"
        return "no reload configured: send SIGHUP to mosquitto to apply"


@dataclass(frozen=True)
class BrokerSync:
    """The broker's files kept equal to the registry, and the reload that applies them.

    Mosquitto re-reads both files on SIGHUP and disconnects a client whose account is gone, so
    a retired device is off the bus within a moment of `run`.
    """

    broker_dir: Path
    reload: BrokerReload

    def run(self, devices: Sequence[DeviceAccount], registered_ids: Iterable[str]) -> str:
        sync_broker_files(self.broker_dir, devices, registered_ids)
        return self.reload.run()


# --- the bundle ----------------------------------------------------------------------------------


def render_toml(values: Mapping[str, TomlValue]) -> str:
    """Flat `key = value` lines; JSON string escapes are valid TOML basic strings."""
    lines = []
    for key, value in values.items():
        if isinstance(value, bool):
            rendered = "true" if value else "false"
        elif isinstance(value, (int, float)):
            rendered = repr(value)
        else:
            rendered = json.dumps(value, ensure_ascii=False)
        lines.append(f"{key} = {rendered}")
    return "\n".join(lines) + "\n"


def agent_config(
    *,
    device_id: str,
    kind: str,
    broker_url: str,
    directory: Path | None = None,
    has_ca: bool = False,
) -> dict[str, TomlValue]:
    """The agent's settings; file paths under `directory` (absolute) or relative when None."""

    def path(name: str) -> str:
        return str(directory / name) if directory is not None else name

    values: dict[str, TomlValue] = {
        "device_id": device_id,
        "kind": kind,
        "broker_url": broker_url,
        "credential_file": path(CREDENTIAL_FILE),
        "release_key_file": path(RELEASE_KEY_FILE),
    }
    if has_ca:
        values["ca_file"] = path(CA_FILE)
    return values


def _write(path: Path, payload: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(payload)
    os.chmod(path, mode)


@dataclass(frozen=True)
class Bundle:
    directory: Path
    device_id: str
    has_ca: bool


def write_bundle(
    out_dir: Path,
    *,
    device_id: str,
    kind: str,
    tags: Sequence[str],
    credential: str,
    broker_url: str,
    release_key_pem: bytes,
    ca_file: Path | None = None,
    drafts: Sequence[ModelManifest] = (),
) -> Bundle:
    """Write the bundle into a fresh `out_dir`, all at once (staged beside it, then renamed)."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ProvisioningError(f"{out_dir} exists and is not empty; a bundle is never overwritten")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(mode=0o700)
    try:
        has_ca = ca_file is not None and broker_url.startswith(("mqtts://", "ssl://"))
        config = agent_config(device_id=device_id, kind=kind, broker_url=broker_url, has_ca=has_ca)
        # The config names the credential file only, yet the whole bundle stays private.
        _write(staging / CONFIG_FILE, render_toml(config).encode(), 0o600)
        _write(staging / CREDENTIAL_FILE, credential.encode() + b"\n", 0o600)
        _write(staging / RELEASE_KEY_FILE, release_key_pem, 0o644)
        if has_ca and ca_file is not None:
            _write(staging / CA_FILE, ca_file.read_bytes(), 0o644)
        _write(
            staging / DRAFTS_FILE,
            (json.dumps([d.to_json() for d in drafts], indent=2, sort_keys=True) + "\n").encode(),
            0o644,
        )
        device = {
            "device_id": device_id,
            "kind": kind,
            "tags": list(tags),
            "broker_url": broker_url,
            "tls": broker_url.startswith(("mqtts://", "ssl://")),
            "drafts": [d.name for d in drafts],
            "provisioned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        _write(staging / DEVICE_FILE, (json.dumps(device, indent=2) + "\n").encode(), 0o644)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Bundle(out_dir, device_id, has_ca)


def read_bundle_config(bundle_dir: Path) -> dict[str, TomlValue]:
    """The flat settings of a bundle's agent.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    try:
        document = tomllib.loads((bundle_dir / CONFIG_FILE).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ProvisioningError(f"{bundle_dir / CONFIG_FILE}: {exc}") from None
    values: dict[str, TomlValue] = {}
    for key, value in document.items():
        if not isinstance(value, (str, int, float, bool)):
            raise ProvisioningError(f"{bundle_dir / CONFIG_FILE}: {key} is not a flat value")
        values[key] = value
    return values


def read_bundle_device(bundle_dir: Path) -> dict[str, object]:
    try:
        document: dict[str, object] = json.loads((bundle_dir / DEVICE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProvisioningError(f"{bundle_dir} is not a device bundle: {exc}") from None
    return document
