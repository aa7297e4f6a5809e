"""Secrets on the command line: a flag that once took one is refused, with what to use instead.

Shared by the agent's and the verifier's CLIs, which import nothing of each other's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class RefuseSecretInArgv(argparse.Action):
    """A flag that once took a secret: it now exits with the reason and what to use instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, instead: str) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)
        self.instead = instead

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string} is refused: a secret in argv shows in `ps` to every user of this "
            f"machine; use {self.instead}"
        )
