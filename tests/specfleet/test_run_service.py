"""The runner of the fleet's long-running processes: a short GIL switch interval while they
run, the interpreter's own after."""

from __future__ import annotations

import asyncio
import sys

import pytest

from core.aio import SERVICE_SWITCH_INTERVAL_S, run_service


async def _interval_inside() -> float:
    await asyncio.sleep(0)
    return sys.getswitchinterval()


async def _fails() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("the service stopped")


def test_a_service_runs_with_a_short_switch_interval_and_leaves_it_as_it_was() -> None:
    before = sys.getswitchinterval()
    assert before != SERVICE_SWITCH_INTERVAL_S
    assert run_service(_interval_inside()) == pytest.approx(SERVICE_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError, match="the service stopped"):
        run_service(_fails())
    assert sys.getswitchinterval() == before
