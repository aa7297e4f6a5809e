"""`specfleet netem` runs the emulator in front of a broker; `specfleet netem-ctl` steers it."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from netem.profiles import PROFILES


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run_parser = subparsers.add_parser(
        "netem",
        help="emulate a network (latency, jitter, rate, drops) in front of a broker",
        description="A TCP proxy in front of a broker with a named link profile; its loopback "
        "control port takes `profile NAME`, `cut SECONDS`, `stall SECONDS`, `restore`, `status`.",
    )
    run_parser.add_argument("--listen", type=int, required=True, help="port clients connect to")
    run_parser.add_argument("--listen-host", default="127.0.0.1", help="default 127.0.0.1")
    run_parser.add_argument(
        "--upstream", type=_host_port, required=True, help="the broker, HOST:PORT"
    )
    run_parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="lan", help="the link (default lan)"
    )
    run_parser.add_argument(
        "--control", type=int, default=0, help="loopback control port (default: a free one)"
    )
    run_parser.add_argument("--seed", type=int, default=None, help="seed of the jitter")
    run_parser.set_defaults(func=run)

    ctl_parser = subparsers.add_parser(
        "netem-ctl",
        help="send one command to a running `specfleet netem`",
        description="Commands: profile NAME | cut SECONDS | stall SECONDS | restore | status "
        "(SECONDS may be `forever`).",
    )
    ctl_parser.add_argument("--control", type=int, required=True, help="its control port")
    ctl_parser.add_argument("words", nargs="+", help="the command, e.g. `cut 2`")
    ctl_parser.set_defaults(func=run_ctl)


def run(args: argparse.Namespace) -> int:
    from netem.control import ControlServer
    from netem.emulator import NetworkEmulator

    async def serve() -> None:
        host, port = args.upstream
        emulator = NetworkEmulator(
            args.listen,
            host,
            port,
            listen_host=args.listen_host,
            profile=args.profile,
            seed=args.seed,
        )
        control = ControlServer(emulator, args.control)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with emulator:
            await control.start()
            print(
                f"netem: {args.listen_host}:{emulator.port} -> {host}:{port} "
                f"profile {emulator.profile.name}; control on 127.0.0.1:{control.port}",
                flush=True,
            )
            try:
                await stop.wait()
            finally:
                await control.close()

    try:
        asyncio.run(serve())
    except OSError as exc:
        from core.errors import CommandError

        raise CommandError(str(exc)) from None
    return 0


def run_ctl(args: argparse.Namespace) -> int:
    from core.errors import CommandError
    from netem.control import send_command

    try:
        reply = asyncio.run(send_command("127.0.0.1", args.control, " ".join(args.words)))
    except OSError as exc:
        raise CommandError(f"control port {args.control}: {exc}") from None
    print(json.dumps(reply))
    return 0 if reply["ok"] else 1
