"""How flash reaches a device: a shell over SSH, or one on this machine (a directory)."""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    pass


class FlashError(Exception):
    """A step failed; `step` names it and `restored` says what state the device was left in."""

    def __init__(self, step: str, reason: str, restored: str) -> None:
        super().__init__(f"step {step!r} failed: {reason}; {restored}")
        self.step = step
        self.reason = reason
        self.restored = restored


class Transport(Protocol):
    """Where the device's shell runs: over SSH, or here for --target-dir."""

    @property
    def description(self) -> str: ...

    def argv(self, script: str) -> list[str]:
        """The local command line that runs `script` with the device's POSIX shell."""
        ...


@dataclass(frozen=True)
class SshTransport:
    target: str  # user@host
    port: int | None = None
    identity: Path | None = None
    options: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        return f"ssh {self.target}" + (f" -p {self.port}" if self.port else "")

    def argv(self, script: str) -> list[str]:
        command = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15"]
        if self.port is not None:
            command += ["-p", str(self.port)]
        if self.identity is not None:
            command += ["-i", str(self.identity), "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            command += ["-o", option]
        # The remote login shell parses the command line once; sh -c gets the script intact.
        return [*command, self.target, f"sh -c {shlex.quote(script)}"]


@dataclass(frozen=True)
class LocalTransport:
    @property
    def description(self) -> str:
        return "this machine"

    def argv(self, script: str) -> list[str]:
        return ["sh", "-c", script]


def run_on_device(
    transport: Transport, script: str, *, stdin: bytes | None = None, timeout_s: float
) -> str:
    """Run `script`; its stdout, or RuntimeError with the end of its stderr."""
    try:
        done = subprocess.run(
            transport.argv(script),
            input=stdin,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            # pip on the device must not read the operator's pip configuration.
            env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout_s:g}s") from None
    except OSError as exc:
        raise RuntimeError(str(exc)) from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"exit {done.returncode}: " + " | ".join(tail or ["no output"]))
    return done.stdout.decode(errors="replace")
