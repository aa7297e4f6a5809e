"""A publish leaves in the step that makes it: the packet is on the broker while the publishing
event loop is still busy with something else, rather than loop turns later behind every
callback ready by then. A real Mosquitto, on the shared loopback port, and a reader that is
another connection on its own event loop and thread.

Also `_started`, the eager start it rests on (Python 3.10-3.11 lack eager tasks): the first
step runs in the caller's, the rest as a task, with results, errors and cancellation as a task
gives them."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import pytest

from broker.client import BrokerAddress, ConnectOptions, _started, connect

SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
BUSY_S = 1.0  # the publishing loop blocks this long right after the publish


def test_a_publish_reaches_the_broker_while_the_publishing_loop_is_busy() -> None:
    topic = f"specfleet-test/{secrets.token_hex(4)}/draft"
    address = BrokerAddress.from_url(SHARED_MOSQUITTO)
    subscribed = threading.Event()
    arrived: list[float] = []

    def read() -> None:
        async def reader() -> None:
            options = ConnectOptions(client_id=f"reader-{secrets.token_hex(4)}")
            async with connect(address, options) as bus:
                await bus.subscribe(topic)
                subscribed.set()
                messages = bus.messages()
                async with asyncio.timeout(10):
                    await anext(messages)
                arrived.append(time.monotonic())

        asyncio.run(reader())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert subscribed.wait(10)

    async def writer() -> tuple[float, float]:
        options = ConnectOptions(client_id=f"writer-{secrets.token_hex(4)}")
        async with connect(address, options) as bus:
            publishing = asyncio.ensure_future(bus.publish(topic, b"window"))
            await asyncio.sleep(0)  # the publish's first step runs, and nothing after it
            started = time.monotonic()
            time.sleep(BUSY_S)  # this loop does nothing else meanwhile: no writer, no task
            busy_until = time.monotonic()
            await publishing  # its PUBACK, read once the loop runs again
            return started, busy_until

    started, busy_until = asyncio.run(writer())
    thread.join(10)
    assert arrived, "the reader got nothing"
    assert started <= arrived[0] < busy_until, (
        f"arrived {arrived[0] - started:.3f} s after the publish; the loop was busy for {BUSY_S} s"
    )


def test_started_runs_the_first_step_now_and_the_rest_as_a_task() -> None:
    steps: list[str] = []

    async def work(release: asyncio.Future[str]) -> str:
        steps.append("first")
        value = await release
        steps.append("second")
        return value.upper()

    async def scenario() -> str:
        release: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        running = _started(work(release))
        assert steps == ["first"]  # before this step yields to the loop at all
        await asyncio.sleep(0)
        assert steps == ["first"] and not running.done()
        release.set_result("done")
        return await running

    assert asyncio.run(scenario()) == "DONE"
    assert steps == ["first", "second"]


def test_started_gives_a_first_step_error_and_a_result_without_waiting() -> None:
    async def fails() -> None:
        raise ValueError("refused at once")

    async def returns() -> int:
        return 7

    async def scenario() -> int:
        failing = _started(fails())
        with pytest.raises(ValueError, match="refused at once"):
            await failing
        return await _started(returns())

    assert asyncio.run(scenario()) == 7


def test_cancelling_a_started_coroutine_throws_the_cancellation_into_it() -> None:
    cleaned: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            cleaned.append("cleaned up")

    async def scenario() -> None:
        running = _started(waits_forever())
        await asyncio.sleep(0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(scenario())
    assert cleaned == ["cleaned up"]


def test_started_passes_a_bare_yield_on() -> None:
    async def yields() -> str:
        await asyncio.sleep(0)  # a bare yield: no future to wait on
        await asyncio.sleep(0.01)
        return "after two waits"

    async def scenario() -> str:
        return await _started(yields())

    assert asyncio.run(scenario()) == "after two waits"
