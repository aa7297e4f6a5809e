"""asyncio pieces that every process on the bus uses, on Python 3.10 (Jetson images) as on 3.11+."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup, timeout
else:  # pragma: no cover - exercised on Python 3.10 devices
    from exceptiongroup import BaseExceptionGroup
    from taskgroup import TaskGroup, timeout

__all__ = ["TaskGroup", "task_group", "timeout"]


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
