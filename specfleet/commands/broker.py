"""`specfleet broker ...`: the broker's configuration, written from the registry, and
probes of it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import CommandError
from specfleet.commands.common import (
    DEFAULT_SERVICE_USERS,
    _add_database_url,
    _choice,
    _command,
    _engine,
    _group,
)
from specfleet.commands.devices import _registry

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from broker.acl import ServiceRole

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
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
