"""Bash completion for `specfleet` and `specfleet-agent`, written from their own parser trees:
sub-commands, flags, and the values of flags with choices (files for other flags' values).

`eval "$(specfleet completion bash)"` in ~/.bashrc, or save the output to
/etc/bash_completion.d/specfleet. zsh loads it after `autoload bashcompinit && bashcompinit`.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable

from core.cli_help import walk

SHELLS = ("bash",)


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """What may follow at this level: sub-command names, then every flag spelling."""
    words: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words += list(action.choices)
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:
            words += [s for s in action.option_strings]
    return words


def _valued_flags(parser: argparse.ArgumentParser) -> dict[str, list[str] | None]:
    """Flags that take a value: their choices, or None (any value: complete file names)."""
    flags: dict[str, list[str] | None] = {}
    for action in parser._actions:
        if action.nargs == 0 or not action.option_strings:
            continue
        choices = [str(c) for c in action.choices] if action.choices else None
        for spelling in action.option_strings:
            flags[spelling] = choices
    return flags


def _function_name(prog: str) -> str:
    return "_" + re.sub(r"\W", "_", prog) + "_complete"


def bash_script(root: argparse.ArgumentParser) -> str:
    """A bash completion function for `root`'s program."""
    prog = root.prog
    parsers = list(walk(root, prog))
    paths = [path for path, _ in parsers]
    path_cases = "|".join(shlex.quote(path) for path in paths[1:]) or "''"
    word_cases = []
    value_cases = []
    for path, parser in parsers:
        word_cases.append(
            f"        {shlex.quote(path)}) words={shlex.quote(' '.join(_words(parser)))} ;;"
        )
        for flag, choices in sorted(_valued_flags(parser).items()):
            key = shlex.quote(f"{path} {flag}")
            if choices is None:
                value_cases.append(f'        {key}) COMPREPLY=($(compgen -f -- "$cur")); return ;;')
            else:
                listed = shlex.quote(" ".join(choices))
                value_cases.append(
                    f'        {key}) COMPREPLY=($(compgen -W {listed} -- "$cur")); return ;;'
                )
    name = _function_name(prog)
    return "\n".join(
        [
            f"# bash completion for {prog}: written by `{prog} completion bash`",
            f"{name}() {{",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
            f"    local path={shlex.quote(prog)} i words",
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        case "$path ${COMP_WORDS[i]}" in',
            f'            {path_cases}) path="$path ${{COMP_WORDS[i]}}" ;;',
            "        esac",
            "    done",
            '    case "$path $prev" in',
            *value_cases,
            "    esac",
            '    case "$path" in',
            *word_cases,
            "    esac",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            "}",
            f"complete -F {name} {prog}",
            "",
        ]
    )


def add_completion_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    build_parser: Callable[[], argparse.ArgumentParser],
) -> None:
    """`PROG completion bash`: print the completion script. The handler builds the whole parser
    again with `build_parser` (the program's own), so the script covers every command, this one
    included."""
    help_text = "print a shell completion script for this program"
    parser = subparsers.add_parser("completion", help=help_text, description=help_text)
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete for")
    parser.set_defaults(func=_print_script, completion_parser=build_parser)


def _print_script(args: argparse.Namespace) -> int:
    print(bash_script(args.completion_parser()), end="")
    return 0
