"""asyncio pieces that every process on the bus uses, on Python 3.10 (Jetson images) as on 3.11+."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup, timeout
else:  # pragma: no cover - exercised on Python 3.10 devices
    from exceptiongroup import BaseExceptionGroup
    from taskgroup import TaskGroup, timeout

__all__ = ["SERVICE_SWITCH_INTERVAL_S", "TaskGroup", "run_service", "task_group", "timeout"]

T = TypeVar("T")

# How long a thread may hold the GIL while another waits for it, in a long-running process of
# the fleet (CPython's default: 5 ms). A service's event loop runs Python for milliseconds at a
# time when busy, and its helper threads wait for the GIL at every step they take: the round
# writer's commit on PostgreSQL takes it again and again (its statements, the server's
# answers, the result handed back to the loop). With the loop busy 95% of the time, a commit
# that takes 1.1 ms alone took 7.7 ms at 5 ms and 5.2 ms at 0.5 ms; in `bench fleet` at a round
# a second a session (two coordinators, PostgreSQL), the verifier's answer p99 went from
# 22-33 ms to 17-20 ms over three runs in turns. It costs the closed loop at saturation (every
# session drafting again the moment its verdict comes, two coordinators) 368-405 rounds/s
# against 415-447 at 5 ms: two threads that both compute switch more often. A fleet is run
# below saturation, where a round's tail is what its devices wait on.
SERVICE_SWITCH_INTERVAL_S = 0.0005


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_leaf(exc)
        return exc
    return group


@contextlib.asynccontextmanager
async def task_group() -> AsyncIterator[TaskGroup]:
    """A TaskGroup that raises its first failure as itself, not wrapped in an ExceptionGroup.

    Callers then catch a connection loss with a plain `except`, which Python 3.10 can express.
    """
    try:
        async with TaskGroup() as tasks:
            yield tasks
    except BaseExceptionGroup as group:
        raise _first_leaf(group) from group


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` for a long-running process (a coordinator, a verifier, an agent): its
    threads hand the GIL over every SERVICE_SWITCH_INTERVAL_S, the interval as it was after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SERVICE_SWITCH_INTERVAL_S)
    try:
        return asyncio.run(main)
    finally:
        sys.setswitchinterval(before)
