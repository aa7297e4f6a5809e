"""Every command and sub-command of `specfleet` and `specfleet-agent` explains itself: a
description, help on every flag and argument, and at least one example in `--help`; `-v` works
after the sub-command; `--broker` and `--broker-url` are one flag wherever either is taken."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from core.cli_help import BROKER_SPELLINGS, walk
from device_agent.cli import build_parser as agent_parser
from specfleet.cli import build_parser as specfleet_parser

ROOTS = {"specfleet": specfleet_parser, "specfleet-agent": agent_parser}
MODULES = {"specfleet": "specfleet", "specfleet-agent": "device_agent.cli"}


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []
    for name, build in ROOTS.items():
        found += walk(build(), name)
    return found


PARSERS = _parsers()
IDS = [path for path, _ in PARSERS]
BROKER_PARSERS = [
    (path, parser)
    for path, parser in PARSERS
    if any(s in parser._option_string_actions for s in BROKER_SPELLINGS)
]


def test_every_command_is_walked() -> None:
    assert len(BROKER_PARSERS) >= 8  # up, demo, verifier, models deploy, bench ..., the agent
    # 50 under specfleet and 3 under specfleet-agent today; a command that goes missing from the
    # walk (say, registered outside COMMAND_MODULES) would escape every check below.
    assert len(PARSERS) >= 53
    assert {"specfleet models deploy", "specfleet sim plan", "specfleet-agent ask"} <= set(IDS)


@pytest.mark.parametrize(("path", "parser"), PARSERS, ids=IDS)
def test_help_has_a_description_flag_help_and_an_example(
    path: str, parser: argparse.ArgumentParser
) -> None:
    assert parser.description, f"{path}: no description"
    assert parser.formatter_class is argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help, f"{path} {choice.dest}: no help line"
        elif action.help != argparse.SUPPRESS:
            assert action.help, f"{path}: {action.option_strings or action.dest} has no help"
    text = parser.format_help()
    assert "\nexamples:\n" in text
    examples = text.split("\nexamples:\n", 1)[1].splitlines()
    program = path.split()[0]
    # An example is a command line of this program that runs this command (or one below it).
    runs_it = [line for line in examples if line.strip().startswith(path)]
    assert runs_it, f"{path}: no example runs it"
    assert all(line.startswith("  ") for line in examples if line.strip()), "examples are indented"
    assert program in runs_it[0]


@pytest.mark.parametrize(("path", "parser"), BROKER_PARSERS, ids=[p for p, _ in BROKER_PARSERS])
def test_broker_spellings_are_one_flag(path: str, parser: argparse.ArgumentParser) -> None:
    options = parser._option_string_actions
    assert all(s in options for s in BROKER_SPELLINGS), path
    broker, broker_url = (options[s] for s in BROKER_SPELLINGS)
    assert broker.dest == broker_url.dest
    # The help names one spelling.
    shown = [s for s in BROKER_SPELLINGS if options[s].help != argparse.SUPPRESS]
    assert len(shown) == 1
    assert f"{shown[0]} " in parser.format_help()
    hidden = next(s for s in BROKER_SPELLINGS if s not in shown)
    assert re.search(rf"{hidden}(?![-\w])", parser.format_help()) is None


@pytest.mark.parametrize(
    ("argv", "dest"),
    [
        (["up", "--broker-url", "mqtt://10.0.0.1:1883"], "broker"),
        (["up", "--broker", "mqtt://10.0.0.1:1883"], "broker"),
        (["verifier", "--broker", "mqtt://10.0.0.1:1883"], "broker_url"),
        (
            ["models", "deploy", "d", "--to", "lab", "--broker", "mqtt://10.0.0.1:1883"],
            "broker_url",
        ),
        (["bench", "bus", "--broker-url", "mqtt://10.0.0.1:1883"], "broker"),
    ],
)
def test_either_spelling_sets_the_broker(argv: list[str], dest: str) -> None:
    args = specfleet_parser().parse_args(argv)
    assert getattr(args, dest) == "mqtt://10.0.0.1:1883"


def test_agent_takes_either_spelling() -> None:
    args = agent_parser().parse_args(["run", "--broker", "mqtt://10.0.0.1:1883"])
    assert args.broker_url == "mqtt://10.0.0.1:1883"


@pytest.mark.parametrize(
    ("build", "argv", "verbose"),
    [
        (specfleet_parser, ["devices", "list"], False),
        (specfleet_parser, ["-v", "devices", "list"], True),
        (specfleet_parser, ["devices", "list", "-v"], True),
        (specfleet_parser, ["bench", "bus", "--verbose"], True),
        (agent_parser, ["ask", "hi", "-v"], True),
        (agent_parser, ["-v", "ask", "hi"], True),
        (agent_parser, ["ask", "hi"], False),
    ],
)
def test_verbose_before_or_after_the_command(build: object, argv: list[str], verbose: bool) -> None:
    assert callable(build)
    args = build().parse_args(argv)
    assert args.verbose is verbose


@pytest.mark.parametrize("program", sorted(MODULES))
def test_help_and_version_from_the_command_line(program: str) -> None:
    module = MODULES[program]
    helped = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0, helped.stderr
    assert "examples:" in helped.stdout
    version = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0
    assert version.stdout.startswith(f"{program} ")
