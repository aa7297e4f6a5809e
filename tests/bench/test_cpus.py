"""CPU placement: a process tree is found from /proc and moved onto the CPUs asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.cpus import available, cpu_by_role, cpu_seconds, descendants, pin_tree, split


def test_a_process_tree_is_found_and_pinned() -> None:
    cpus = available()
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"]
    )  # fmt: skip
    try:
        tree: list[int] = []
        for _ in range(100):
            tree = descendants(parent.pid)
            if len(tree) == 2:
                break
            time.sleep(0.05)
        assert tree[0] == parent.pid and len(tree) == 2
        one = {min(cpus)}
        assert pin_tree(parent.pid, one) >= 2
        assert all(os.sched_getaffinity(pid) == one for pid in tree)
        other = {max(cpus)}
        pin_tree(parent.pid, other, below=True)  # the child only
        assert os.sched_getaffinity(tree[0]) == one and os.sched_getaffinity(tree[1]) == other
    finally:
        for pid in descendants(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()


@pytest.mark.parametrize(
    ("cpus", "expected"), [({0}, None), ({0, 1}, ({1}, {0})), ({0, 1, 2, 3}, ({3}, {0, 1, 2}))]
)
def test_the_target_gets_the_last_cpu(
    cpus: set[int], expected: tuple[set[int], set[int]] | None
) -> None:
    assert split(cpus) == expected


def test_cpu_seconds_counts_what_a_process_burned_and_nothing_for_one_gone() -> None:
    """A child that spins for a while shows that CPU time (user and system) from /proc; a
    process that has exited, or a pid that never was, counts 0."""
    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"])
    try:
        burned = 0.0
        for _ in range(200):
            burned = cpu_seconds([child.pid])
            if burned >= 0.4:
                break
            time.sleep(0.05)
        assert 0.4 <= burned < 5.0
        assert cpu_seconds([child.pid, child.pid]) == 2 * cpu_seconds([child.pid])
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds([child.pid]) == 0.0
    assert cpu_seconds([]) == 0.0


def test_a_waves_reading_is_each_roles_processes_cpu_time() -> None:
    """Around a wave, `bench e2e` reads only the stat files of the processes found before it (a
    walk of /proc between the two readings counted its own milliseconds as the coordinator's):
    each role gets the sum over its processes, a role with none gets 0."""
    mine = [os.getpid()]
    reading = cpu_by_role({"coordinator": mine, "twice": mine * 2, "agents": []})
    assert set(reading) == {"coordinator", "twice", "agents"}
    assert reading["agents"] == 0.0
    assert reading["coordinator"] > 0.0
    assert reading["twice"] >= 2 * reading["coordinator"]
