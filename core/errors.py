"""Exceptions that cross layers: raised by library code, reported by the command line."""

from __future__ import annotations


class CommandError(Exception):
    """A bad argument or a failed precondition: printed as one line, exit status 2."""
