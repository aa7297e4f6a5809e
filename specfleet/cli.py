"""The `specfleet` command: each role package registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from core.cli_help import finish_parsers, walk
from core.completion import add_completion_command
from core.errors import CommandError
from core.logs import configure_logging
from specfleet.examples import EXAMPLES

# Modules that expose `register(subparsers)`; each adds its subcommands with a `func` default.
COMMAND_MODULES = (
    "specfleet.commands",
    "specfleet.commands.models",
    "bench.commands",
    "verifier.commands",
    "netem.commands",
    "sim.commands",
)


class Terminated(KeyboardInterrupt):
    """SIGTERM where no Ctrl-C handler runs (SIGINT ignored or reset)."""


class _Termination:
    """SIGTERM is handled as Ctrl-C is: a command cleans up after either alike (its child
    processes, private brokers and temporary files), then exits 143.

    The signal is passed on as SIGINT, so that an event loop run by asyncio.run cancels its
    main task (its handler for SIGINT) rather than having an exception raised inside whichever
    task happens to run; synchronous code gets KeyboardInterrupt, as from Ctrl-C."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            raise Terminated
        signal.raise_signal(signal.SIGINT)


def _version() -> str:
    """The installed distribution's version; the agent's own when run from a checkout."""
    try:
        return importlib.metadata.version("specfleet")
    except importlib.metadata.PackageNotFoundError:
        from device_agent import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfleet",
        description="Distributed speculative decoding on a fleet of edge devices over MQTT.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"specfleet {_version()}")
    _add_settings_file(parser, root=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    add_completion_command(subparsers, build_parser)
    finish_parsers(parser, EXAMPLES)
    for _, command in walk(parser, "specfleet"):
        if command is not parser:
            _add_settings_file(command, root=False)
    return parser


def _add_settings_file(parser: argparse.ArgumentParser, *, root: bool) -> None:
    """`--config FILE`, before or after the command (SUPPRESS: after it, given or not, it does
    not undo the one given before)."""
    if "--config" in parser._option_string_actions:
        return
    parser.add_argument(
        "--config",
        dest="settings_file",
        type=Path,
        default=None if root else argparse.SUPPRESS,
        metavar="FILE",
        help="a TOML file of settings (database_url = ..., the environment's names without "
        "SPECFLEET_); SPECFLEET_* variables override it (or set SPECFLEET_CONFIG)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    if args.command != "completion":
        from core.settings import ConfigFileError, use_config_file

        try:
            use_config_file(args.settings_file)
        except ConfigFileError as exc:
            print(f"specfleet: settings: {exc}", file=sys.stderr)
            return 2
    main_thread = threading.current_thread() is threading.main_thread()
    termination = _Termination()
    previous = signal.signal(signal.SIGTERM, termination) if main_thread else None
    try:
        result: int | None = args.func(args)
    except CommandError as exc:
        print(f"specfleet {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGTERM if termination.received else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return result or 0
