"""`specfleet devices ...`: the device registry, and the broker files kept equal to it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import CommandError
from specfleet.commands.common import (
    _add_database_url,
    _choice,
    _command,
    _engine,
    _group,
    _print_json,
)

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from coordinator.db.registry import DeviceRegistry

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
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
