"""The `specfleet-agent` command: the device side's entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from device_agent.settings import AgentSettings, load_agent_settings

log = logging.getLogger("device_agent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfleet-agent", description="The specfleet device agent."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="connect to the bus and serve until stopped")
    run.add_argument("--config", type=Path, help="TOML config file (flat keys, e.g. device_id)")
    run.add_argument("--device-id", help="this device's id (env SPECFLEET_DEVICE_ID)")
    run.add_argument("--credential", help="this device's secret (env SPECFLEET_CREDENTIAL)")
    run.add_argument("--broker-url", help="mqtt://host:port or mqtts://host:port")
    run.add_argument("--ca-file", type=Path, help="CA bundle for an mqtts:// broker")
    run.add_argument("--kind", choices=["pi", "jetson", "phone", "other"])
    run.add_argument("--keepalive", type=int, dest="keepalive_s", help="MQTT keepalive, seconds")
    run.add_argument("--telemetry-interval", type=float, dest="telemetry_interval_s")
    return parser


def _settings(args: argparse.Namespace) -> AgentSettings:
    return load_agent_settings(
        args.config,
        device_id=args.device_id,
        credential=args.credential,
        broker_url=args.broker_url,
        ca_file=args.ca_file,
        kind=args.kind,
        keepalive_s=args.keepalive_s,
        telemetry_interval_s=args.telemetry_interval_s,
    )


async def _run(settings: AgentSettings) -> None:
    from device_agent.agent import Agent

    agent = Agent(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on every platform (Termux is fine)
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(agent.stop()))
    await agent.run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = _settings(args)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"specfleet-agent: {where}: {first['msg']}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"specfleet-agent: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(settings))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
