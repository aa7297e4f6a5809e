"""Mosquitto auth files: per-device ACL and password file, and the broker config that names them."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Protocol

from broker.passwords import check_credential_hash
from broker.topics import (
    DOWNLINK_CHANNELS,
    DRAFT_CHANNELS,
    ROOT,
    UPLINK_CHANNELS,
    VERIFIER_ROOT,
    DeviceChannel,
    device_subscription,
    device_topic,
    validate_device_id,
)

CONFIG_FILE = "mosquitto.conf"
ACL_FILE = "acl"
PASSWORD_FILE = "passwords"
# The service accounts alone, for the cloud's own listener (`render_mosquitto_conf`).
SERVICE_PASSWORD_FILE = "service-passwords"
DATA_DIR = "data"
# Options that each listener holds for itself once per_listener_settings is true.
LISTENER_AUTH_OPTIONS = ("allow_anonymous", "password_file", "acl_file", "use_username_as_clientid")


class Access(str, Enum):
    """Mosquitto ACL access levels (`read` covers subscribing and receiving)."""

    READ = "read"
    WRITE = "write"
    READWRITE = "readwrite"
    DENY = "deny"


@dataclass(frozen=True)
class AclRule:
    access: Access
    topic: str  # an MQTT topic filter

    def __post_init__(self) -> None:
        levels = self.topic.split("/")
        last = len(levels) - 1
        misplaced = any(
            ("#" in level and (level != "#" or i != last)) or ("+" in level and level != "+")
            for i, level in enumerate(levels)
        )
        if not self.topic or misplaced or any(c in self.topic for c in "\n\r\0"):
            raise ValueError(f"invalid ACL topic filter {self.topic!r}")

    def line(self) -> str:
        return f"topic {self.access.value} {self.topic}"


class BrokerAccount(Protocol):
    """Anything that becomes one user in the password file and one block in the ACL."""

    @property
    def username(self) -> str: ...

    @property
    def credential_hash(self) -> str: ...

    @property
    def rules(self) -> tuple[AclRule, ...]: ...


def device_rule_channels() -> tuple[tuple[Access, DeviceChannel], ...]:
    """A device's access to each of its own channels: the one source of every broker's rules."""
    writes = [(Access.WRITE, channel) for channel in UPLINK_CHANNELS]
    reads = [(Access.READ, channel) for channel in DOWNLINK_CHANNELS]
    return (*writes, *reads)


def device_rules(device_id: str) -> tuple[AclRule, ...]:
    """Write its own uplink channels, read its own verdicts and commands; nothing else."""
    return tuple(
        AclRule(access, device_topic(device_id, channel))
        for access, channel in device_rule_channels()
    )


@dataclass(frozen=True)
class DeviceAccount:
    """A device: its MQTT username is its device id."""

    device_id: str
    credential_hash: str

    def __post_init__(self) -> None:
        validate_device_id(self.device_id)
        check_credential_hash(self.credential_hash)

    @property
    def username(self) -> str:
        return self.device_id

    @property
    def rules(self) -> tuple[AclRule, ...]:
        return device_rules(self.device_id)


class ServiceRole(str, Enum):
    COORDINATOR = "coordinator"  # reads every uplink, writes every verdict and command
    # Its own subtree, and for direct rounds every device's drafts (it answers those of the
    # sessions it holds) and verdicts; devices still write only their own topics.
    VERIFIER = "verifier"
    OBSERVER = "observer"  # read-only view of the whole bus (dashboards, debugging)
    # A site broker's bridge into the core broker (broker/bridge.py): every device's uplinks
    # in, every device's downlinks out. The site's own ACL holds each device to its topics.
    BRIDGE = "bridge"


# The service accounts' names where none is given (`broker write-config`, the quickstart). A
# device provisioned under one would replace the service's hash in the password file.
SERVICE_ACCOUNT_NAMES = frozenset(role.value for role in ServiceRole)


def service_rules(role: ServiceRole) -> tuple[AclRule, ...]:
    if role is ServiceRole.COORDINATOR:
        return (AclRule(Access.READWRITE, f"{ROOT}/#"),)
    if role is ServiceRole.VERIFIER:
        return (
            AclRule(Access.READWRITE, f"{VERIFIER_ROOT}/#"),
            *(AclRule(Access.READ, device_subscription(c)) for c in DRAFT_CHANNELS),
            AclRule(Access.WRITE, device_subscription(DeviceChannel.VERDICT)),
        )
    if role is ServiceRole.BRIDGE:
        return tuple(
            AclRule(access, device_subscription(channel))
            for access, channel in device_rule_channels()
        )
    return (AclRule(Access.READ, f"{ROOT}/#"),)


@dataclass(frozen=True)
class ServiceUser:
    """A cloud process (coordinator, verifier, observer) with the access its role needs."""

    username: str
    credential_hash: str
    role: ServiceRole
    extra_rules: tuple[AclRule, ...] = field(default=())

    def __post_init__(self) -> None:
        # The same character rules as device ids keep usernames safe in both files.
        validate_device_id(self.username)
        check_credential_hash(self.credential_hash)

    @property
    def rules(self) -> tuple[AclRule, ...]:
        return (*service_rules(self.role), *self.extra_rules)


class DuplicateUsernameError(ValueError):
    def __init__(self, username: str) -> None:
        super().__init__(f"username {username!r} is both a device and a service user, or repeated")
        self.username = username


def _unique_accounts(
    devices: Iterable[BrokerAccount], service_users: Iterable[BrokerAccount]
) -> list[BrokerAccount]:
    accounts: list[BrokerAccount] = [*service_users, *devices]
    seen: set[str] = set()
    for account in accounts:
        if account.username in seen:
            raise DuplicateUsernameError(account.username)
        seen.add(account.username)
    return accounts


def generate_acl(
    devices: Iterable[BrokerAccount], service_users: Iterable[BrokerAccount] = ()
) -> str:
    """The Mosquitto acl_file text: one `user` block per account, services first."""
    lines = [
        "# Generated by `specfleet broker write-config`; edits are overwritten.",
        "# No rules outside a user block: anonymous clients get nothing.",
    ]
    for account in _unique_accounts(devices, service_users):
        lines += ["", f"user {account.username}", *(rule.line() for rule in account.rules)]
    return "\n".join(lines) + "\n"


def generate_passwords(
    devices: Iterable[BrokerAccount], service_users: Iterable[BrokerAccount] = ()
) -> str:
    """The Mosquitto password_file text (`username:$7$...` lines) from stored hashes."""
    accounts = _unique_accounts(devices, service_users)
    return "".join(f"{a.username}:{check_credential_hash(a.credential_hash)}\n" for a in accounts)


def parse_passwords(text: str) -> dict[str, str]:
    """username -> hash from a password file; blank and comment lines are skipped."""
    entries: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        username, sep, encoded = line.partition(":")
        if not sep:
            raise ValueError(f"password file line {number}: expected username:hash")
        entries[username] = check_credential_hash(encoded)
    return entries


@dataclass(frozen=True)
class TlsFiles:
    certfile: Path
    keyfile: Path
    cafile: Path | None = None


def _template(tls: bool) -> str:
    name = "mosquitto-tls.conf" if tls else "mosquitto.conf"
    return resources.files("broker").joinpath("config", name).read_text()


def _set_directive(lines: list[str], key: str, values: Sequence[str]) -> None:
    """Replace successive active (or commented-out) `key` lines; append what is left over."""
    pattern = re.compile(rf"^#?{re.escape(key)}(\s|$)")
    remaining = list(values)
    for index, line in enumerate(lines):
        if remaining and pattern.match(line):
            lines[index] = f"{key} {remaining.pop(0)}"
    lines.extend(f"{key} {value}" for value in remaining)


def render_mosquitto_conf(
    config_dir: Path,
    *,
    data_dir: Path | None = None,
    listeners: Sequence[str] | None = None,
    tls: TlsFiles | None = None,
    run_as_user: str | None = None,
    service_listener: str | None = None,
) -> str:
    """The shipped config with its file paths pointed at `config_dir` (and `data_dir`).

    `listeners` replaces the template's listener lines in order ("PORT [ADDRESS]"): the TLS
    template has the TLS listener first and the loopback one second. `run_as_user` is the user
    mosquitto switches to when started as root; it must be able to read the written files.
    `service_listener` ("PORT [ADDRESS]") adds the cloud's own listener for replicated services
    (see `_with_service_listener`); its accounts are in SERVICE_PASSWORD_FILE.
    """
    config_dir = config_dir.resolve()
    data_dir = (data_dir or config_dir / DATA_DIR).resolve()
    lines = _template(tls is not None).splitlines()
    _set_directive(lines, "password_file", [str(config_dir / PASSWORD_FILE)])
    _set_directive(lines, "acl_file", [str(config_dir / ACL_FILE)])
    # Mosquitto joins the location and file name as strings, so it needs the trailing slash.
    _set_directive(lines, "persistence_location", [f"{data_dir}{os.sep}"])
    if listeners is not None:
        _set_directive(lines, "listener", listeners)
    if tls is not None:
        _set_directive(lines, "certfile", [str(tls.certfile.resolve())])
        _set_directive(lines, "keyfile", [str(tls.keyfile.resolve())])
        if tls.cafile is not None:
            _set_directive(lines, "cafile", [str(tls.cafile.resolve())])
    if run_as_user is not None:
        _set_directive(lines, "user", [run_as_user])
    if service_listener is not None:
        lines = _with_service_listener(lines, config_dir, service_listener)
    return "\n".join(lines) + "\n"


def _with_service_listener(lines: list[str], config_dir: Path, service_listener: str) -> list[str]:
    """Every listener gets its own copy of the auth options, and one more listener takes the
    service accounts only, without use_username_as_clientid.

    Why: with a client id forced to the username, one account holds one connection, so N
    verifier replicas would need N accounts. On the service listener they share an account
    and pick their own client ids; devices cannot log in there at all (its password file
    holds no device), so none of them can take a service's client id.
    """
    auth = [line for line in lines if line.split(" ", 1)[0] in LISTENER_AUTH_OPTIONS]
    auth = list(dict.fromkeys(auth))  # the TLS template repeats use_username_as_clientid
    kept = [line for line in lines if line.split(" ", 1)[0] not in LISTENER_AUTH_OPTIONS]
    _set_directive(kept, "per_listener_settings", ["true"])
    result: list[str] = []
    for line in kept:
        result.append(line)
        if line.startswith("listener "):
            result.extend(auth)
    result += [
        "",
        "# The cloud's own listener: coordinators and verifiers only (service-passwords), each",
        "# replica with a client id of its own. Keep it off the devices' network.",
        f"listener {service_listener}",
        "allow_anonymous false",
        f"password_file {config_dir / SERVICE_PASSWORD_FILE}",
        f"acl_file {config_dir / ACL_FILE}",
        "use_username_as_clientid false",
    ]
    return result


@dataclass(frozen=True)
class BrokerFiles:
    config: Path
    acl: Path
    passwords: Path
    data_dir: Path


def write_broker_files(
    out_dir: Path,
    *,
    config_text: str,
    acl_text: str,
    passwords_text: str,
    service_passwords_text: str | None = None,
) -> BrokerFiles:
    """Write the files atomically (readers never see half a file); secrets stay 0600.

    `service_passwords_text` (the service accounts alone) is written only when given; a
    provisioning run leaves the one already there as it is.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files = BrokerFiles(
        config=out_dir / CONFIG_FILE,
        acl=out_dir / ACL_FILE,
        passwords=out_dir / PASSWORD_FILE,
        data_dir=out_dir / DATA_DIR,
    )
    files.data_dir.mkdir(exist_ok=True)
    writes = [
        (files.config, config_text, 0o644),
        (files.acl, acl_text, 0o644),
        (files.passwords, passwords_text, 0o600),
    ]
    if service_passwords_text is not None:
        writes.append((out_dir / SERVICE_PASSWORD_FILE, service_passwords_text, 0o600))
    for path, text, mode in writes:
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, mode)  # the umask may have narrowed or an old file kept its mode
        os.replace(tmp, path)
    return files
