"""`specfleet up`: the control plane on one host (coordinator, HTTP API and dashboard)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import CommandError
from specfleet.commands.common import _add_database_url, _quiet_alembic

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
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
    from pydantic import ValidationError

    from broker.client import BrokerAddress
    from broker.embedded import DEFAULT_PORT
    from coordinator.stack import run_up
    from core.aio import run_service
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
        run_service(run_up(settings, embedded_port=embedded_port, local_broker=args.local_broker))
    except OSError as exc:
        raise CommandError(f"cannot start: {exc}") from exc
    return 0
