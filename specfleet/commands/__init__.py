"""Coordinator commands: `specfleet db ...`, `specfleet devices ...`, `specfleet broker ...`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from core.cli_help import add_module_command
from core.errors import CommandError

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from enum import Enum

    from sqlalchemy.engine import Engine

    from broker.acl import ServiceRole
    from coordinator.db.registry import DeviceRegistry
    from coordinator.replay import SessionRecord, TokenDecoder
    from coordinator.web.auth import AdminStore

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_SERVICE_USERS = ("coordinator:coordinator",)

Handler = Callable[[argparse.Namespace], int]
EnumT = TypeVar("EnumT", bound="Enum")


def register(subparsers: Subparsers) -> None:
    _register_db(subparsers)
    _register_devices(subparsers)
    _register_flash(subparsers)
    _register_broker(subparsers)
    _register_up(subparsers)
    _register_admin(subparsers)
    _register_replay(subparsers)
    _register_demo(subparsers)


def _group(subparsers: Subparsers, name: str, help_text: str) -> Subparsers:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    group: Subparsers = parser.add_subparsers(
        dest=f"{name}_command", metavar="ACTION", required=True
    )
    return group


def _command(
    group: Subparsers, name: str, help_text: str, handler: Handler
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = group.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(func=handler)
    return parser


def _add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="sqlite:///PATH or postgresql://... (default: the settings' database_url)",
    )


# --- shared plumbing ---------------------------------------------------------------------------


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return str(args.database_url)
    from pydantic import ValidationError

    from core.settings import Settings

    try:
        return Settings().database_url
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc.errors()[0]['msg']}") from exc


def _quiet_alembic(*, keep_migration_steps: bool) -> None:
    # Alembic logs its plugin setup and context at INFO; an operator wants only the steps run.
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if keep_migration_steps:
        logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)


@contextmanager
def _engine(
    args: argparse.Namespace, *, require_head: bool = True, create: bool = False
) -> Iterator[Engine]:
    """An engine for the command's database; refuses one whose schema is not at head. Only
    `db upgrade` creates a SQLite file: for any other command a missing one is a mistyped path."""
    import sqlalchemy.exc

    _quiet_alembic(keep_migration_steps=args.func in (_db_upgrade, _db_downgrade))
    from coordinator.db import migrate
    from coordinator.db.engine import NoSuchDatabase, make_engine

    url = _database_url(args)
    try:
        engine = make_engine(url, create=create)
    except NoSuchDatabase as exc:
        raise CommandError(
            f"{exc} (`specfleet db upgrade --database-url {url}` creates one)"
        ) from exc
    except (ValueError, sqlalchemy.exc.ArgumentError) as exc:
        raise CommandError(str(exc)) from exc
    try:
        if require_head:
            migrate.require_head(engine)
        yield engine
    except migrate.SchemaOutOfDateError as exc:
        raise CommandError(str(exc)) from exc
    except sqlalchemy.exc.OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise CommandError(f"database error: {reason}") from exc
    finally:
        engine.dispose()


def _choice(enum_type: type[EnumT], value: str, option: str) -> EnumT:
    """`value` as a member of `enum_type`; the enum, not argparse, says what is allowed."""
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in enum_type)
        raise CommandError(f"{option} {value!r}: choose one of {allowed}") from None


def _print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


# --- specfleet db ------------------------------------------------------------------------------


def _register_db(subparsers: Subparsers) -> None:
    group = _group(subparsers, "db", "migrate and check the coordinator database")
    upgrade = _command(group, "upgrade", "apply migrations up to a revision", _db_upgrade)
    _add_database_url(upgrade)
    upgrade.add_argument("--revision", default="head", help="target revision (default: head)")
    downgrade = _command(group, "downgrade", "revert migrations down to a revision", _db_downgrade)
    _add_database_url(downgrade)
    downgrade.add_argument("revision", help="target revision, e.g. 0001 or base")
    check = _command(group, "check", "fail unless the schema is at head and matches", _db_check)
    _add_database_url(check)
    current = _command(group, "current", "print the database's revision", _db_current)
    _add_database_url(current)


def _run_alembic(
    args: argparse.Namespace, action: Callable[[Engine], None], *, create: bool = False
) -> None:
    import alembic.util

    with _engine(args, require_head=False, create=create) as engine:
        try:
            action(engine)
        except alembic.util.CommandError as exc:
            raise CommandError(str(exc)) from exc


def _db_upgrade(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    _run_alembic(args, lambda engine: migrate.upgrade(engine, args.revision), create=True)
    return _db_current(args)


def _db_downgrade(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    _run_alembic(args, lambda engine: migrate.downgrade(engine, args.revision))
    return _db_current(args)


def _db_check(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    with _engine(args, require_head=False) as engine:
        try:
            migrate.check(engine)
        except (migrate.SchemaOutOfDateError, migrate.SchemaDriftError) as exc:
            raise CommandError(str(exc)) from exc
    print("schema is at head and matches the models")
    return 0


def _db_current(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    with _engine(args, require_head=False) as engine:
        current = migrate.current_revision(engine)
    print(f"database revision: {current or 'none (empty database)'}")
    return 0


# --- specfleet devices -------------------------------------------------------------------------


def _register_devices(subparsers: Subparsers) -> None:
    group = _group(subparsers, "devices", "provision, list and retire devices")
    add = _command(group, "add", "provision a device; prints its credential once", _devices_add)
    add.add_argument("device_id", metavar="NAME", help="device id, also its MQTT username")
    add.add_argument("--kind", required=True, help="pi, jetson, phone or other")
    add.add_argument("--tag", action="append", default=[], help="a tag (repeat for more)")
    add.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_database_url(add)

    listing = _command(group, "list", "list devices, ordered by id", _devices_list)
    listing.add_argument("--status", help="online, offline or retired")
    listing.add_argument("--kind", help="pi, jetson, phone or other")
    listing.add_argument("--tag", help="only devices with this tag")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_database_url(listing)

    retire = _command(
        group,
        "retire",
        "retire a device for good: off the broker (with --broker-dir) and, within seconds, its "
        "sessions closed by the running coordinator",
        _devices_retire,
    )
    retire.add_argument("device_id", metavar="NAME", help="the device's id")
    retire.add_argument("--reason", default="", help="recorded in the event log")
    _add_broker_files(retire)
    _add_database_url(retire)

    rotate = _command(
        group, "rotate-credential", "issue a new credential; prints it once", _devices_rotate
    )
    rotate.add_argument("device_id", metavar="NAME", help="the device's id")
    _add_broker_files(rotate)
    _add_database_url(rotate)

    provision = _command(
        group,
        "provision",
        "register a device, add it to the broker and write its bundle (config, credential, keys)",
        _devices_provision,
    )
    provision.add_argument("device_id", metavar="NAME", help="device id, also its MQTT username")
    provision.add_argument(
        "--kind", help="pi, jetson, phone or other (required, but with --rotate: it is known)"
    )
    provision.add_argument("--tag", action="append", default=[], help="a tag (repeat for more)")
    provision.add_argument(
        "--draft",
        action="append",
        default=[],
        metavar="MODEL",
        help="a draft chosen for this device; its manifest goes into the bundle (repeat for more)",
    )
    provision.add_argument(
        "--out", type=Path, metavar="DIR", help="bundle directory (default: <home>/bundles/NAME)"
    )
    provision.add_argument(
        "--device-broker-url",
        metavar="URL",
        help="the broker as the device reaches it (default: the settings' broker_url)",
    )
    provision.add_argument(
        "--ca-file", type=Path, help="the broker's CA certificate, bundled for mqtts:// brokers"
    )
    _add_broker_files(provision)
    provision.add_argument("--models-dir", type=Path, help="models directory (default: settings)")
    provision.add_argument(
        "--rotate",
        action="store_true",
        help="the device exists: give it a new credential and write a new bundle (a lost bundle)",
    )
    provision.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_database_url(provision)


def _add_broker_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker-dir",
        type=Path,
        metavar="DIR",
        help="the directory `broker write-config` wrote; its acl and passwords are updated",
    )
    parser.add_argument(
        "--broker-pid-file", type=Path, metavar="FILE", help="reload mosquitto: SIGHUP to this pid"
    )
    parser.add_argument(
        "--broker-reload-command",
        metavar="CMD",
        help="reload the broker with this command instead (e.g. 'systemctl reload mosquitto')",
    )


def _check_broker_files(args: argparse.Namespace) -> None:
    if args.broker_pid_file and args.broker_reload_command:
        raise CommandError("--broker-pid-file and --broker-reload-command exclude each other")
    if (args.broker_pid_file or args.broker_reload_command) and not args.broker_dir:
        raise CommandError("reloading the broker needs --broker-dir (the files to reload)")


def _sync_broker_files(args: argparse.Namespace, registry: DeviceRegistry) -> str:
    """The broker's acl and passwords rewritten from the registry and the broker reloaded, with
    --broker-dir; says what was done. Raises ProvisioningError or OSError."""
    from coordinator.ops import provisioning

    if args.broker_dir is None:
        return "broker files not updated (no --broker-dir)"
    sync = provisioning.BrokerSync(
        args.broker_dir,
        provisioning.BrokerReload(args.broker_pid_file, args.broker_reload_command),
    )
    return sync.run(registry.broker_accounts(), [d.id for d in registry.list()])


def _registry(engine: Engine) -> DeviceRegistry:
    from coordinator.db.engine import make_sessionmaker
    from coordinator.db.registry import DeviceRegistry

    return DeviceRegistry(make_sessionmaker(engine))


def _devices_add(args: argparse.Namespace) -> int:
    from coordinator.db.models import DeviceKind
    from coordinator.db.registry import RegistryError

    kind = _choice(DeviceKind, args.kind, "--kind")
    with _engine(args) as engine:
        try:
            device, credential = _registry(engine).provision(
                args.device_id, kind, args.tag, actor="cli"
            )
        except (RegistryError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
    if args.json:
        _print_json({"id": device.id, "kind": device.kind.value, "credential": credential})
    else:
        print(f"device      {device.id}")
        print(f"kind        {device.kind.value}")
        print(f"tags        {', '.join(device.tags) or '-'}")
        print(f"credential  {credential}")
        print(
            "The credential is shown only now: put it on the device (MQTT username = device id),"
            " then run `specfleet broker write-config` and reload the broker."
        )
        print(
            "No bundle was written, so `specfleet flash` has nothing to install: "
            f"`specfleet devices provision {device.id} --kind {device.kind.value} --rotate` "
            "writes one (with a new credential)."
        )
    return 0


def _devices_list(args: argparse.Namespace) -> int:
    from coordinator.db.models import DeviceKind, DeviceStatus
    from coordinator.web.api.schemas import DevicePublic
    from core.report import format_table

    status = _choice(DeviceStatus, args.status, "--status") if args.status else None
    kind = _choice(DeviceKind, args.kind, "--kind") if args.kind else None
    with _engine(args) as engine:
        devices = _registry(engine).list(status=status, kind=kind, tag=args.tag)
    if args.json:
        _print_json([DevicePublic.model_validate(d).model_dump(mode="json") for d in devices])
        return 0
    if not devices:
        print("no devices")
        return 0
    rows = [
        (
            d.id,
            d.kind.value,
            d.status.value,
            d.last_seen.isoformat(timespec="seconds") if d.last_seen else "never",
            ",".join(d.tags) or "-",
        )
        for d in devices
    ]
    print(format_table(("id", "kind", "status", "last_seen", "tags"), rows))
    return 0


def _devices_retire(args: argparse.Namespace) -> int:
    from coordinator.db.registry import RETIREMENT_POLL_S, RegistryError
    from coordinator.ops.provisioning import ProvisioningError

    _check_broker_files(args)
    with _engine(args) as engine:
        registry = _registry(engine)
        try:
            device = registry.retire(args.device_id, reason=args.reason, actor="cli")
        except RegistryError as exc:
            raise CommandError(str(exc)) from exc
        try:
            broker = _sync_broker_files(args, registry)
        except (ProvisioningError, OSError) as exc:
            raise CommandError(
                f"{device.id} is retired, but the broker was not updated: {exc}. Fix it, then "
                f"run `specfleet broker write-config` and reload the broker"
            ) from exc
    print(f"retired     {device.id}")
    print(f"broker      {broker}")
    print(
        "sessions    closed by the running coordinator within "
        f"{RETIREMENT_POLL_S:g} s, which also takes the device off its broker"
    )
    return 0


def _devices_provision(args: argparse.Namespace) -> int:
    from coordinator.db.models import DeviceKind
    from coordinator.db.registry import DeviceExistsError, RegistryError, validate_tags
    from coordinator.ops import provisioning
    from coordinator.ops.releases import release_public_key_pem
    from core.settings import Settings
    from inference.artifacts import ArtifactError, load_manifest

    if args.kind is None and not args.rotate:
        raise CommandError("--kind is required for a new device: pi, jetson, phone or other")
    kind = _choice(DeviceKind, args.kind, "--kind") if args.kind else DeviceKind.OTHER
    _check_broker_files(args)
    settings = Settings()
    broker_url = args.device_broker_url or settings.broker_url
    try:
        from broker.client import BrokerAddress
        from broker.topics import validate_device_id

        validate_device_id(args.device_id)
        validate_tags(args.tag)
        BrokerAddress.from_url(broker_url)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    if args.ca_file is not None and not args.ca_file.is_file():
        raise CommandError(f"--ca-file {args.ca_file} does not exist")
    models_dir: Path = args.models_dir or settings.resolved_models_dir
    drafts = []
    for name in args.draft:
        try:
            manifest = load_manifest(models_dir / name)
        except ArtifactError as exc:
            raise CommandError(f"--draft {name}: {exc}") from exc
        if manifest.role != "draft":
            raise CommandError(f"--draft {name}: a {manifest.role}, not a draft")
        drafts.append(manifest)
    out_dir: Path = args.out or settings.home / "bundles" / args.device_id
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CommandError(f"{out_dir} exists and is not empty; a bundle is never overwritten")
    release_key = release_public_key_pem(settings.home)

    with _engine(args) as engine:
        registry = _registry(engine)
        if args.broker_dir is not None:
            try:
                services = provisioning.service_accounts(
                    args.broker_dir, [d.id for d in registry.list()]
                )
            except provisioning.ProvisioningError as exc:
                raise CommandError(str(exc)) from exc
            if args.device_id in services:
                raise CommandError(
                    f"{args.device_id!r} is a service account in {args.broker_dir}; "
                    "choose another device id"
                )
        try:
            if args.rotate:
                credential = registry.rotate_credential(args.device_id, actor="cli")
                device = registry.get(args.device_id)
            else:
                device, credential = registry.provision(args.device_id, kind, args.tag, actor="cli")
        except DeviceExistsError as exc:
            raise CommandError(
                f"{exc}; `--rotate` gives it a new credential and writes its bundle"
            ) from exc
        except (RegistryError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        try:
            bundle = provisioning.write_bundle(
                out_dir,
                device_id=device.id,
                kind=device.kind.value,
                tags=device.tags,
                credential=credential,
                broker_url=broker_url,
                release_key_pem=release_key,
                ca_file=args.ca_file,
                drafts=drafts,
            )
            reloaded = _sync_broker_files(args, registry)
        except (provisioning.ProvisioningError, OSError) as exc:
            raise CommandError(
                f"{device.id} is registered, but: {exc}. Fix it, then run "
                f"`specfleet devices provision {device.id} --kind {device.kind.value} --rotate`"
            ) from exc
    if args.json:
        _print_json(
            {
                "id": device.id,
                "kind": device.kind.value,
                "tags": device.tags,
                "bundle": str(bundle.directory),
                "broker": reloaded,
            }
        )
    else:
        print(f"device      {device.id}")
        print(f"kind        {device.kind.value}")
        print(f"tags        {', '.join(device.tags) or '-'}")
        print(f"bundle      {bundle.directory}  (holds the credential: keep it private)")
        print(f"broker      {reloaded}")
        print(f"next        specfleet flash {device.id} --ssh USER@HOST")
    return 0


def _devices_rotate(args: argparse.Namespace) -> int:
    from coordinator.db.registry import RegistryError
    from coordinator.ops.provisioning import ProvisioningError

    _check_broker_files(args)
    with _engine(args) as engine:
        registry = _registry(engine)
        try:
            credential = registry.rotate_credential(args.device_id, actor="cli")
        except RegistryError as exc:
            raise CommandError(str(exc)) from exc
        try:
            broker = _sync_broker_files(args, registry)
        except (ProvisioningError, OSError) as exc:
            broker = f"not updated: {exc}"
    print(f"credential  {credential}")
    print(f"broker      {broker}")
    if args.broker_dir is None:
        print("Shown only now; run `specfleet broker write-config` and reload the broker.")
    else:
        print("Shown only now.")
    return 0


# --- specfleet flash ---------------------------------------------------------------------------


def _register_flash(subparsers: Subparsers) -> None:
    add_module_command(
        subparsers,
        "flash",
        "coordinator.ops.flash",
        "install or upgrade the agent on a device over SSH, or into a directory",
    )


# --- specfleet broker --------------------------------------------------------------------------


def _register_broker(subparsers: Subparsers) -> None:
    group = _group(subparsers, "broker", "Mosquitto configuration for the fleet")
    write = _command(
        group,
        "write-config",
        "write mosquitto.conf, acl and passwords from the device registry",
        _broker_write_config,
    )
    write.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    write.add_argument(
        "--service-user",
        action="append",
        metavar="NAME:ROLE",
        help="a cloud service account, ROLE coordinator, verifier or observer (repeat for more; "
        f"default: {', '.join(DEFAULT_SERVICE_USERS)}). A new one gets a credential printed "
        "once; an existing one keeps its hash from DIR/passwords",
    )
    write.add_argument(
        "--listener",
        action="append",
        metavar="'PORT [ADDRESS]'",
        help="replace the template's listener lines in order (TLS: the TLS one first)",
    )
    write.add_argument("--tls", action="store_true", help="use the TLS template")
    write.add_argument("--certfile", type=Path, help="server certificate (PEM), with --tls")
    write.add_argument("--keyfile", type=Path, help="server key (PEM), with --tls")
    write.add_argument("--cafile", type=Path, help="CA certificates (PEM), optional with --tls")
    write.add_argument(
        "--run-as-user",
        metavar="USER",
        help="the user mosquitto drops to when started as root (default: its own, mosquitto)",
    )
    write.add_argument(
        "--service-listener",
        metavar="'PORT [ADDRESS]'",
        help="add the cloud's own listener: service accounts only (DIR/service-passwords), "
        "client ids not forced to the username, so replicas (verifiers in a Deployment) share "
        "one account; keep it off the devices' network",
    )
    _add_service_credential(write)
    write.add_argument(
        "--bridge-to",
        metavar="URL",
        help="make this a site broker bridged into the core broker at URL (mqtt:// or "
        "mqtts://): device uplinks out, downlinks in (deploy/README.md)",
    )
    write.add_argument(
        "--bridge-username",
        metavar="NAME",
        help="the core's bridge account (a --service-user NAME:bridge there)",
    )
    write.add_argument(
        "--bridge-credential", type=Path, metavar="FILE", help="file holding its credential"
    )
    _add_database_url(write)
    emqx = _command(
        group,
        "write-emqx",
        "write an EMQX 5 cluster's emqx.conf, acl.conf and user bootstrap files from the "
        "device registry",
        _broker_write_emqx,
    )
    emqx.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    emqx.add_argument(
        "--etc-dir",
        metavar="PATH",
        help="where the EMQX nodes will read these files (default: DIR as given)",
    )
    emqx.add_argument(
        "--service-user",
        action="append",
        metavar="NAME:ROLE",
        help=f"as for write-config (default: {', '.join(DEFAULT_SERVICE_USERS)}); without "
        "--service-credential a new credential is printed once",
    )
    _add_service_credential(emqx)
    found = emqx.add_mutually_exclusive_group()
    found.add_argument(
        "--seed", action="append", metavar="NAME@HOST", help="a static cluster seed (repeat)"
    )
    found.add_argument("--dns", metavar="NAME", help="discover the cluster's nodes by DNS")
    _add_database_url(emqx)
    probe = _command(
        group,
        "probe-verifier",
        "exit 0 if a verifier's retained heartbeat is online and fresh (a container probe); "
        "credentials from SPECFLEET_BROKER_USERNAME and SPECFLEET_BROKER_PASSWORD",
        _broker_probe_verifier,
    )
    probe.add_argument("verifier_id", metavar="VERIFIER_ID", help="the verifier's --id")
    probe.add_argument("--broker-url", metavar="URL", help="default: the settings' broker_url")
    probe.add_argument(
        "--max-age",
        type=float,
        default=None,
        metavar="S",
        help="oldest heartbeat that counts as alive (default: 15)",
    )
    probe.add_argument(
        "--unreachable-ok",
        action="store_true",
        help="exit 0 when the broker cannot be asked (a liveness probe: restarting the "
        "verifier would not bring the broker back)",
    )


def _broker_probe_verifier(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from broker.client import BrokerAddress
    from broker.probe import DEFAULT_MAX_AGE_S, BrokerUnreachable, judge_heartbeat, read_heartbeat
    from broker.topics import validate_device_id
    from core.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"] if exc.errors() else str(exc)
        raise CommandError(f"settings: {reason}") from exc
    max_age = DEFAULT_MAX_AGE_S if args.max_age is None else args.max_age
    if max_age <= 0:
        raise CommandError("--max-age must be positive")
    try:
        verifier_id = validate_device_id(args.verifier_id)
        address = BrokerAddress.from_url(args.broker_url or settings.broker_url)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    try:
        status = asyncio.run(
            read_heartbeat(address, settings.broker_username, settings.broker_password, verifier_id)
        )
    except BrokerUnreachable as exc:
        if args.unreachable_ok:
            print(f"broker unreachable, not judged: {exc}")
            return 0
        raise CommandError(f"broker unreachable: {exc}") from exc
    verdict = judge_heartbeat(status, max_age)
    if not verdict.healthy:
        raise CommandError(f"verifier {verifier_id}: {verdict.reason}")
    print(f"verifier {verifier_id}: {verdict.reason}")
    return 0


def _parse_service_users(specs: list[str]) -> list[tuple[str, ServiceRole]]:
    from broker.acl import ServiceRole

    users = []
    for spec in specs:
        name, sep, role = spec.partition(":")
        if not sep or not name:
            raise CommandError(f"--service-user {spec!r}: expected NAME:ROLE")
        users.append((name, _choice(ServiceRole, role, f"--service-user {name}:")))
    return users


def _add_service_credential(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--service-credential",
        action="append",
        metavar="NAME=FILE",
        help="take service user NAME's credential from FILE (a mounted secret) instead of "
        "minting one; its hash is written afresh (repeat for more)",
    )


def _service_users(
    args: argparse.Namespace, existing: dict[str, str]
) -> tuple[list[Any], list[tuple[str, ServiceRole, str]]]:
    """The service users with hashes (given, kept from `existing`, or new), and the new ones'
    plaintext credentials to print once."""
    from broker import acl
    from broker.passwords import hash_credential, new_credential

    new_credentials: list[tuple[str, ServiceRole, str]] = []
    service_users = []
    users = _parse_service_users(args.service_user or list(DEFAULT_SERVICE_USERS))
    given = _read_service_credentials(args.service_credential or [], {name for name, _ in users})
    for name, role in users:
        credential_hash = existing.get(name)
        if name in given:
            credential_hash = hash_credential(given[name])
        elif credential_hash is None:
            credential = new_credential()
            credential_hash = hash_credential(credential)
            new_credentials.append((name, role, credential))
        try:
            service_users.append(acl.ServiceUser(name, credential_hash, role))
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
    return service_users, new_credentials


def _bridge_link(args: argparse.Namespace) -> Any:
    from broker.bridge import BridgeLink
    from broker.client import BrokerAddress

    if args.bridge_to is None:
        if args.bridge_username or args.bridge_credential:
            raise CommandError("--bridge-username and --bridge-credential go with --bridge-to")
        return None
    if not args.bridge_username or args.bridge_credential is None:
        raise CommandError("--bridge-to needs --bridge-username and --bridge-credential")
    try:
        address = BrokerAddress.from_url(args.bridge_to)
        credential = args.bridge_credential.read_text().strip()
        return BridgeLink(
            args.bridge_username,
            address.host,
            address.port,
            args.bridge_username,
            credential,
            cafile=args.cafile if address.tls else None,
        )
    except (OSError, ValueError) as exc:
        raise CommandError(f"--bridge-to: {exc}") from exc


def _broker_write_emqx(args: argparse.Namespace) -> int:
    from broker import emqx

    service_users, new_credentials = _service_users(args, {})
    try:
        cluster = emqx.EmqxCluster(static_seeds=tuple(args.seed or ()), dns_name=args.dns)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    with _engine(args) as engine:
        devices = _registry(engine).broker_accounts()
    try:
        users = emqx.generate_emqx_users(devices, service_users)
        acl_text = emqx.generate_emqx_acl(service_users)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    out_dir: Path = args.out
    etc_dir = args.etc_dir or str(out_dir)
    conf_text = emqx.render_emqx_conf(etc_dir, iterations=users.iterations, cluster=cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text, mode in (
        (emqx.CONFIG_FILE, conf_text, 0o644),
        (emqx.ACL_FILE, acl_text, 0o644),
        (emqx.USERS_FILE, users.users_csv, 0o600),
        (emqx.SERVICE_USERS_FILE, users.service_users_csv, 0o600),
    ):
        path = out_dir / name
        path.write_text(text)
        path.chmod(mode)
    print(f"wrote {', '.join(str(out_dir / n) for n in (emqx.CONFIG_FILE, emqx.ACL_FILE))}")
    print(f"wrote {out_dir / emqx.USERS_FILE}, {out_dir / emqx.SERVICE_USERS_FILE} (0600)")
    print(f"{len(devices)} device(s), {len(service_users)} service user(s)")
    for name, role, credential in new_credentials:
        print(f"new {role.value} user {name}: credential {credential}  (shown only now)")
    print("users load when the authenticator is created; later, POST users.csv to its import_users")
    return 0


def _read_service_credentials(specs: list[str], names: set[str]) -> dict[str, str]:
    """NAME=FILE pairs -> NAME: the credential in FILE (one line, surrounding space dropped)."""
    credentials = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CommandError(f"--service-credential {spec!r}: expected NAME=FILE")
        if name not in names:
            raise CommandError(f"--service-credential {name}: not one of the service users")
        try:
            credential = Path(path).read_text().strip()
        except OSError as exc:
            raise CommandError(f"--service-credential {name}: {exc}") from exc
        if not credential or "\n" in credential:
            raise CommandError(f"--service-credential {name}: {path} must hold one line")
        credentials[name] = credential
    return credentials


def _broker_write_config(args: argparse.Namespace) -> int:
    from broker import acl

    tls = None
    if args.tls:
        if args.certfile is None or args.keyfile is None:
            raise CommandError("--tls needs --certfile and --keyfile")
        tls = acl.TlsFiles(args.certfile, args.keyfile, args.cafile)
    elif args.certfile or args.keyfile or args.cafile:
        raise CommandError("--certfile, --keyfile and --cafile go with --tls")

    out_dir: Path = args.out
    existing: dict[str, str] = {}
    password_path = out_dir / acl.PASSWORD_FILE
    if password_path.exists():
        try:
            existing = acl.parse_passwords(password_path.read_text())
        except ValueError as exc:
            raise CommandError(f"{password_path}: {exc}") from exc

    service_users, new_credentials = _service_users(args, existing)
    link = _bridge_link(args)

    with _engine(args) as engine:
        devices = _registry(engine).broker_accounts()
    try:
        acl_text = acl.generate_acl(devices, service_users)
        passwords_text = acl.generate_passwords(devices, service_users)
        config_text = acl.render_mosquitto_conf(
            out_dir,
            listeners=args.listener,
            tls=tls,
            run_as_user=args.run_as_user,
            service_listener=args.service_listener,
        )
        service_passwords_text = (
            acl.generate_passwords([], service_users) if args.service_listener else None
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    if link is not None:
        from broker.bridge import with_bridge, write_bridge

        config_text = with_bridge(config_text, out_dir)
        print(f"wrote {write_bridge(out_dir, link)} (bridge to {args.bridge_to}; 0600)")
    files = acl.write_broker_files(
        out_dir,
        config_text=config_text,
        acl_text=acl_text,
        passwords_text=passwords_text,
        service_passwords_text=service_passwords_text,
    )
    print(f"wrote {files.config}, {files.acl}, {files.passwords}")
    if service_passwords_text is not None:
        print(f"wrote {out_dir / acl.SERVICE_PASSWORD_FILE} (the service listener's accounts)")
    print(f"{len(devices)} device(s), {len(service_users)} service user(s)")
    for name, role, credential in new_credentials:
        print(f"new {role.value} user {name}: credential {credential}  (shown only now)")
    print(f"start: mosquitto -c {files.config}; after changes, reload it with SIGHUP")
    return 0


# --- specfleet up ------------------------------------------------------------------------------


def _register_up(subparsers: Subparsers) -> None:
    help_text = "run the broker (one of its own unless --broker), the coordinator and the HTTP API"
    parser = subparsers.add_parser("up", help=help_text, description=help_text)
    _add_database_url(parser)
    parser.add_argument(
        "--broker",
        metavar="URL",
        help="use this MQTT broker instead of starting the embedded one (mqtt:// or mqtts://)",
    )
    parser.add_argument(
        "--mqtt-port",
        type=int,
        default=None,
        help="the devices' port on the broker up starts (default 1884)",
    )
    parser.add_argument(
        "--local-broker",
        choices=("auto", "mosquitto", "amqtt"),
        default="auto",
        help="without --broker: Mosquitto with the production config where it is installed "
        "(auto, the default), or the pure-Python amqtt",
    )
    parser.add_argument("--http-port", type=int, default=None, help="port of the HTTP API")
    parser.add_argument(
        "--ssl-certfile",
        type=Path,
        metavar="PEM",
        help="serve the HTTP API over TLS with this certificate (chain) and --ssl-keyfile "
        "(or behind a TLS proxy: deploy/README.md)",
    )
    parser.add_argument("--ssl-keyfile", type=Path, metavar="PEM", help="the certificate's key")
    parser.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from broker.client import BrokerAddress
    from broker.embedded import DEFAULT_PORT
    from coordinator.stack import run_up
    from core.settings import Settings

    overrides: dict[str, Any] = {}
    if args.database_url:
        overrides["database_url"] = args.database_url
    if args.http_port is not None:
        overrides["http_port"] = args.http_port
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise CommandError("--ssl-certfile and --ssl-keyfile go together")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path is not None and not path.is_file():
            raise CommandError(f"{flag}: {path} is not a file")
    if args.ssl_certfile is not None:
        overrides["http_ssl_certfile"] = args.ssl_certfile
        overrides["http_ssl_keyfile"] = args.ssl_keyfile
    if args.broker:
        try:
            BrokerAddress.from_url(args.broker)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        overrides["broker_url"] = args.broker
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CommandError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from exc
    if args.broker is None and settings.environment != "quickstart":
        raise CommandError("the embedded broker serves the quickstart only; pass --broker URL")
    _quiet_alembic(keep_migration_steps=False)
    embedded_port = None if args.broker else (args.mqtt_port or DEFAULT_PORT)
    try:
        asyncio.run(run_up(settings, embedded_port=embedded_port, local_broker=args.local_broker))
    except OSError as exc:
        raise CommandError(f"cannot start: {exc}") from exc
    return 0


def _register_demo(subparsers: Subparsers) -> None:
    add_module_command(
        subparsers,
        "demo",
        "localfleet.demo",
        "run a whole fleet on this machine and answer the benchmark prompts",
    )


# --- specfleet admin ---------------------------------------------------------------------------


def _register_admin(subparsers: Subparsers) -> None:
    group = _group(subparsers, "admin", "people and scripts allowed into the admin API")
    create = _command(
        group, "create", "create an admin; prints its bearer token once", _admin_create
    )
    create.add_argument("name", metavar="NAME", help="1-48 of a-z 0-9 . _ -")
    create.add_argument(
        "--role", default="admin", help="admin (reads and writes) or viewer (reads only)"
    )
    create.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_database_url(create)

    listing = _command(group, "list", "list admins and their live tokens", _admin_list)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_database_url(listing)

    token = _command(group, "token", "issue another token; prints it once", _admin_token)
    token.add_argument("name", metavar="NAME", help="the admin's name")
    token.add_argument("--label", default="", help="what the token is for (e.g. prometheus)")
    _add_database_url(token)

    revoke = _command(
        group, "revoke", "revoke every token of an admin (and its logins)", _admin_revoke
    )
    revoke.add_argument("name", metavar="NAME", help="the admin's name")
    _add_database_url(revoke)


def _admin_store(engine: Engine) -> AdminStore:
    from coordinator.db.engine import make_sessionmaker
    from coordinator.web.auth import AdminStore

    return AdminStore(make_sessionmaker(engine))


def _admin_create(args: argparse.Namespace) -> int:
    from coordinator.db.models import AdminRole
    from coordinator.web.auth import AdminError

    role = _choice(AdminRole, args.role, "--role")
    with _engine(args) as engine:
        try:
            admin, token = _admin_store(engine).create(args.name, role, actor="cli")
        except AdminError as exc:
            raise CommandError(str(exc)) from exc
    if args.json:
        _print_json({"name": admin.name, "role": admin.role.value, "token": token})
    else:
        print(f"admin   {admin.name}")
        print(f"role    {admin.role.value}")
        print(f"token   {token}")
        print(
            "The token is shown only now. Send it as 'Authorization: Bearer TOKEN', "
            "or paste it into the dashboard's login page."
        )
    return 0


def _admin_list(args: argparse.Namespace) -> int:
    from core.report import format_table

    with _engine(args) as engine:
        admins = _admin_store(engine).list()
    if args.json:
        _print_json(
            [
                {
                    "name": a.name,
                    "role": a.role.value,
                    "live_tokens": n,
                    "created_at": a.created_at.isoformat(),
                }
                for a, n in admins
            ]
        )
        return 0
    if not admins:
        print("no admins; create one with `specfleet admin create NAME`")
        return 0
    rows = [
        (a.name, a.role.value, str(n), a.created_at.isoformat(timespec="seconds"))
        for a, n in admins
    ]
    print(format_table(("name", "role", "tokens", "created"), rows))
    return 0


def _admin_token(args: argparse.Namespace) -> int:
    from coordinator.web.auth import AdminError

    with _engine(args) as engine:
        try:
            token = _admin_store(engine).issue_token(args.name, label=args.label, actor="cli")
        except AdminError as exc:
            raise CommandError(str(exc)) from exc
    print(f"token   {token}")
    print("Shown only now.")
    return 0


def _admin_revoke(args: argparse.Namespace) -> int:
    from coordinator.web.auth import AdminError

    with _engine(args) as engine:
        try:
            revoked = _admin_store(engine).revoke_tokens(args.name, actor="cli")
        except AdminError as exc:
            raise CommandError(str(exc)) from exc
    print(f"revoked {revoked} token(s) of {args.name}")
    return 0


# --- specfleet replay --------------------------------------------------------------------------


def _register_replay(subparsers: Subparsers) -> None:
    help_text = "rebuild a session round by round from the database and re-stream it"
    parser = subparsers.add_parser("replay", help=help_text, description=help_text)
    parser.set_defaults(func=_replay)
    parser.add_argument("session_id", metavar="SESSION_ID", help="a session id, or its prefix")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="replay speed: 2 is twice as fast as recorded, 0 does not wait (default: 1)",
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per round, without waiting"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-run the target on the recorded drafts and check every stored verdict",
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour tokens by provenance (default: when writing to a terminal)",
    )
    parser.add_argument(
        "--show-rejected", action="store_true", help="also show rejected drafts, struck through"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "q4"),
        default="fp32",
        help="the target build to verify with: the one the verifiers ran (default: fp32)",
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    _add_database_url(parser)


def _replay(args: argparse.Namespace) -> int:
    from coordinator import replay
    from coordinator.db.engine import make_sessionmaker

    if not args.speed >= 0:
        raise CommandError(f"--speed {args.speed}: must be 0 or more")
    with _engine(args) as engine:
        sessions = make_sessionmaker(engine)
        try:
            session_id = replay.find_session(sessions, args.session_id)
            record = replay.load_session(sessions, session_id)
        except replay.ReplayError as exc:
            raise CommandError(str(exc)) from exc
    models_dir = args.models_dir or _settings_models_dir()
    decoder = replay.target_tokenizer(models_dir)
    if args.verify:
        return _replay_verify(args, record, models_dir, decoder)
    result = replay.rebuild(record, decoder)
    if args.json:
        for line in replay.json_lines(result):
            print(line, flush=True)
        for problem in result.problems:
            print(f"specfleet replay: {problem}", file=sys.stderr)
        return 1 if result.problems else 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    replay.play_terminal(
        result, sys.stdout, speed=args.speed, color=color, show_rejected=args.show_rejected
    )
    return 1 if result.problems else 0


def _settings_models_dir() -> Path:
    from pydantic import ValidationError

    from core.settings import Settings

    try:
        return Settings().resolved_models_dir
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc.errors()[0]['msg']}") from exc


def _replay_verify(
    args: argparse.Namespace,
    record: SessionRecord,
    models_dir: Path,
    decoder: TokenDecoder | None,
) -> int:
    from tqdm import tqdm

    from coordinator import replay
    from inference.artifacts import ArtifactError
    from modelbuild.gguf_source import GgufError
    from modelbuild.target_build import load_target

    try:
        target, tokenizer = load_target(models_dir, precision=args.precision)
    except (ArtifactError, GgufError, OSError) as exc:
        raise CommandError(f"cannot load the target: {exc}") from exc
    with tqdm(
        total=len(record.rounds), desc="verifying", unit="round", file=sys.stderr, leave=False
    ) as bar:
        report = replay.verify_session(
            record, target, decoder=decoder or tokenizer, on_round=lambda _: bar.update()
        )
    if args.json:
        _print_json(
            {
                "session_id": str(report.session_id),
                "target": target.name,
                "rounds": report.rounds,
                "verified": report.verified,
                "ok": report.ok,
                "mismatches": [
                    {"round": m.round_index, "what": m.what, "detail": m.detail}
                    for m in report.mismatches
                ],
            }
        )
    else:
        for mismatch in report.mismatches:
            print(f"MISMATCH {mismatch.detail}")
        verdict = "every stored verdict reproduced" if report.ok else "NOT reproduced"
        print(
            f"session {record.id}: {report.verified}/{report.rounds} rounds verified against "
            f"{target.name}: {verdict}"
        )
    return 0 if report.ok else 1
