"""Memory admission and stand-in drafters: a neural draft is loaded only when it fits.

The memory a new load may take is Linux's MemAvailable (/proc/meminfo), or less where the agent
runs in a cgroup v2 whose memory.max leaves less room (memory.max - memory.current, the
tightest of the agent's cgroup and its ancestors). `proc_root` and `sys_root` are /proc and
/sys on a device; a test passes a tree of its own.

What a draft costs resident is estimated from its manifest: the model file times
RESIDENT_FACTOR (ONNX Runtime widens fp16 weights and keeps an arena; LiteRT maps the file and
grows its buffers on the first passes), plus the KV cache of KV_CONTEXT_TOKENS positions in
fp32, plus an interpreter when the draft runs in a child process of its own
(inference.resident, which the coordinator's policy uses too). A draft is admitted when that
plus the margin fits.

`StandInProposer` is what a session drafts with while the drafter it asked for cannot run: not
on this device yet (being fetched), or too big for the memory free now. The copying fallback
drafts, and the rounds say so (the drafter behind them, and why); the asked-for drafter is
loaded at the first window after it becomes available.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_agent.draft_supervisor import SupervisedProposer
from inference.proposers import Candidates, HybridProposer, Proposer
from inference.resident import MB as MB  # the agent's and its tests' unit
from inference.resident import resident_bytes as resident_bytes  # the catalog's estimate

log = logging.getLogger(__name__)

PROC = Path("/proc")
SYS = Path("/sys")
# A stand-in looks at most this often whether its drafter can run now (a look reads /proc).
STAND_IN_LOOK_EVERY_S = 0.5


class MemoryRefused(Exception):
    """A draft that does not fit the memory available now; the message is the reason."""


@dataclass(frozen=True)
class MemoryReading:
    """What a new load may take, in bytes (None where nothing says), and where that came from."""

    available_bytes: int | None
    source: str  # "meminfo", "cgroup", or "" when unknown

    @property
    def available_mb(self) -> float | None:
        return None if self.available_bytes is None else self.available_bytes / MB


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max": no limit here


def mem_available(proc_root: Path = PROC) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where it is missing."""
    try:
        lines = (proc_root / "meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                return int(parts[1]) * 1024  # kB
            except (IndexError, ValueError):
                return None
    return None


def cgroup_room(proc_root: Path = PROC, sys_root: Path = SYS) -> int | None:
    """The room left under this process's cgroup v2 memory.max (the tightest of it and its
    ancestors), in bytes; None outside a limited cgroup v2."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    relative = next((line[3:] for line in lines if line.startswith("0::")), None)
    if relative is None:
        return None
    base = sys_root / "fs" / "cgroup"
    directory = base / relative.strip().lstrip("/")
    room: int | None = None
    while True:
        limit = _read_int(directory / "memory.max")
        current = _read_int(directory / "memory.current")
        if limit is not None and current is not None:
            here = max(0, limit - current)
            room = here if room is None else min(room, here)
        if directory == base or base not in directory.parents:
            return room
        directory = directory.parent


def read_memory(proc_root: Path = PROC, sys_root: Path = SYS) -> MemoryReading:
    available = mem_available(proc_root)
    room = cgroup_room(proc_root, sys_root)
    if room is not None and (available is None or room < available):
        return MemoryReading(room, "cgroup")
    return MemoryReading(available, "meminfo" if available is not None else "")


@dataclass(frozen=True)
class MemoryAdmission:
    """Decides whether a load of `needs` bytes fits what `read()` says is available."""

    margin_bytes: int
    read: Callable[[], MemoryReading]

    def refusal(self, name: str, needs: int) -> str | None:
        """Why a load of `name` does not fit now, or None when it does (or nothing says)."""
        reading = self.read()
        available = reading.available_bytes
        if available is None or needs + self.margin_bytes <= available:
            return None
        where = " in this cgroup" if reading.source == "cgroup" else ""
        return (
            f"memory: {name} needs {needs / MB:.0f} MB, {available / MB:.0f} MB available"
            f"{where} (margin {self.margin_bytes / MB:.0f} MB)"
        )


class StandInProposer(SupervisedProposer):
    """A session's drafter that cannot run yet: the fallback drafts until `available()` says
    it can, then `make_neural()` loads it (a `MemoryRefused` or other load failure keeps the
    fallback, with its reason). `why()` says why the fallback drafts, for the round's record."""

    def __init__(
        self,
        name: str,
        make_neural: Callable[[], Proposer],
        fallback: Proposer,
        available: Callable[[], bool],
        why: Callable[[], str],
        errors: tuple[type[Exception], ...] = (),
    ) -> None:
        super().__init__(name, make_neural, fallback, available)
        self.why = why
        self.errors: tuple[type[Exception], ...] = (MemoryRefused, *errors)
        self.refusal = ""  # the last load's failure, "" before any
        self._looked = -float("inf")

    @property
    def drafting_with(self) -> str:
        neural = self.neural
        if neural is not None and self.proposers[0] is neural:
            return neural.drafting_with if isinstance(neural, SupervisedProposer) else self.name
        return self.fallback.name

    @property
    def note(self) -> str | None:
        """Why the last window came from the fallback; None once the drafter itself drafts."""
        if self.proposers[0] is not self.fallback:
            return None
        return self.refusal or self.why()

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        now = time.monotonic()
        if self.neural is None and now - self._looked >= STAND_IN_LOOK_EVERY_S:
            self._looked = now
            if self.available():
                try:
                    self.neural = self.make_neural()
                    log.info("%s: loaded; it drafts from this window on", self.name)
                except self.errors as exc:
                    self.refusal = str(exc)
                    fallback = self.fallback.name
                    log.warning("%s: still drafting with %s: %s", self.name, fallback, exc)
        self.proposers = [self.neural or self.fallback]
        if self.neural is None:
            self.fallback_rounds += 1
        return HybridProposer.get_candidates(self, context_ids, k, rng)

    def parts(self) -> list[Proposer]:
        """The drafters it holds, each to go back to the catalog under its own name."""
        return [p for p in (self.neural, self.fallback) if p is not None]
