"""CPU placement of a benchmark's processes: the target's own core, and the rest elsewhere.

On one host the devices, the broker and the coordinator share the CPUs with the verifier, which
they never do in the field: there the devices are other machines. A benchmark that compares the
verifier with plain serving gives both targets (the verifier's inference process, plain
serving's process) the same core to themselves and puts everything else on the other cores
(DESIGN.md, "Emulating a heterogeneous fleet on one host").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

PROC = Path("/proc")


def available() -> set[int]:
    return set(os.sched_getaffinity(0))


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc (parents read from each process's stat)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue += children.get(current, [])
    return found


def pin_tree(pid: int, cpus: set[int], *, below: bool = False) -> int:
    """Every thread of `pid` and of its descendants (only of these, with `below`) onto `cpus`;
    how many threads were moved."""
    moved = 0
    for process in descendants(pid)[1 if below else 0 :]:
        try:
            threads = [int(t.name) for t in (PROC / str(process) / "task").iterdir()]
        except OSError:
            continue
        for thread in threads:
            try:
                os.sched_setaffinity(thread, cpus)
                moved += 1
            except OSError:  # the thread ended, or is not ours to move
                continue
    return moved


def cpu_seconds(pids: Iterable[int]) -> float:
    """The user and system CPU time of processes `pids` (all their threads), in seconds, from
    /proc; a process gone meanwhile counts nothing."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(str(pid))
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime and stime, fields 14 and 15
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_by_role(processes: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """The CPU seconds each role's processes have used so far (a stat file read each)."""
    return {role: cpu_seconds(pids) for role, pids in processes.items()}


def _stat_fields(pid: str) -> list[str] | None:
    """/proc/PID/stat from its third field (the state) on; None for a process gone meanwhile.
    The command may hold spaces and parentheses: the fields start after the last ')'."""
    try:
        stat = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def split(cpus: set[int]) -> tuple[set[int], set[int]] | None:
    """(the target's core, the others), or None when there is only one CPU to share."""
    if len(cpus) < 2:
        return None
    target = max(cpus)
    return {target}, cpus - {target}
