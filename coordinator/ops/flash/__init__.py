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

This package: transport (SSH or local), release (options, steps and the archive, with the
service files under templates/), installer (the steps run in order) and, here, the command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.ops.flash.installer import Flash
from coordinator.ops.flash.release import DEFAULT_ONLINE_TIMEOUT_S, DEFAULT_ROOT, FlashOptions
from coordinator.ops.flash.transport import FlashError, LocalTransport, SshTransport, Transport
from core.errors import CommandError

if TYPE_CHECKING:
    from core.settings import Settings


log = logging.getLogger(__name__)


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
        help="install from these wheels (the agent's, specfleet-agent or specfleet, and its "
        "dependencies') instead of building them here",
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

    from core.settings import Settings

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
