"""What every command's parser shares, applied once the parser tree is built: examples in each
`--help`, `-v` and `--log-format` after the sub-command too, and both spellings of the broker
flag.

Kept to the standard library, so that `specfleet-agent` (on a device) imports it as cheaply as
`specfleet` does.
"""

from __future__ import annotations

import argparse
import importlib
import textwrap
from collections.abc import Iterator, Mapping

from core.logs import LOG_FORMATS

# The broker's address was spelled `--broker` by some commands and `--broker-url` by others. Both
# are accepted everywhere; each command's help names the spelling it was written with.
BROKER_SPELLINGS = ("--broker", "--broker-url")
VERBOSE_HELP = "log at DEBUG level (also accepted before the command)"
# RawDescriptionHelpFormatter keeps the examples' lines as written, and so does it descriptions:
# a one-line description is wrapped here instead.
DESCRIPTION_WIDTH = 88


def add_module_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    module_name: str,
    help_text: str,
) -> None:
    """Add a command implemented by a module with `add_arguments(parser)` and `run(args)`.

    Such modules keep their top-level imports cheap (no torch, no onnxruntime), so `--help`
    stays fast.
    """
    module = importlib.import_module(module_name)
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


class MissingExamples(Exception):
    """A command whose `--help` would show no example."""


def walk(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under `parser` (itself first) with its command path: "specfleet db upgrade"."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, f"{path} {name}")


def _sub_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The one-line help of each sub-command of `parser`, by name."""
    found: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                found[choice.dest] = choice.help or ""
    return found


def _alias_broker(parser: argparse.ArgumentParser) -> None:
    options = parser._option_string_actions
    present = [spelling for spelling in BROKER_SPELLINGS if spelling in options]
    if len(present) != 1:
        return
    action = options[present[0]]
    (other,) = (spelling for spelling in BROKER_SPELLINGS if spelling not in options)
    # Same destination, no default of its own, no line in --help: an alias.
    parser.add_argument(
        other,
        dest=action.dest,
        metavar=action.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def _add_verbose(parser: argparse.ArgumentParser, dest: str) -> None:
    options = parser._option_string_actions
    if "-v" in options or "--verbose" in options:
        return
    # SUPPRESS: left out, the value given before the command (or its default) stands.
    parser.add_argument(
        "-v",
        "--verbose",
        dest=dest,
        action="store_true",
        default=argparse.SUPPRESS,
        help=VERBOSE_HELP,
    )


def _add_log_format(parser: argparse.ArgumentParser, *, root: bool) -> None:
    if "--log-format" in parser._option_string_actions:
        return
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text" if root else argparse.SUPPRESS,
        help="text (default) or json: one JSON object a line, for a log collector",
    )


def finish_parsers(
    root: argparse.ArgumentParser,
    examples: Mapping[str, str],
    *,
    verbose_dest: str = "verbose",
) -> None:
    """Give every parser under `root` its examples (an epilog, formatted as written), a
    description (its one-line help where it had none), `-v` and both broker spellings.

    `examples` maps a command path ("specfleet db upgrade") to command lines, one a line, each
    optionally followed by `  # what it does`. A path missing from it raises MissingExamples.
    """
    prog = root.prog
    helps: dict[str, str] = {}
    for path, parser in walk(root, prog):
        for name, text in _sub_help(parser).items():
            helps[f"{path} {name}"] = text
        if path not in examples:
            raise MissingExamples(f"no examples for `{path}`")
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        if not parser.description and helps.get(path):
            parser.description = helps[path]
        if parser.description and "\n" not in parser.description:
            parser.description = textwrap.fill(parser.description, DESCRIPTION_WIDTH)
        lines = textwrap.dedent(examples[path]).strip("\n")
        epilog = "examples:\n" + textwrap.indent(lines, "  ")
        parser.epilog = f"{parser.epilog.rstrip()}\n\n{epilog}" if parser.epilog else epilog
        if parser is not root:
            _add_verbose(parser, verbose_dest)
        _add_log_format(parser, root=parser is root)
        _alias_broker(parser)
