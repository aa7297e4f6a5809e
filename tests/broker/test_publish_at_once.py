"""A publish leaves in the step that makes it: the packet of an event-loop turn's first publish
is on the broker while the publishing loop is still busy with something else, rather than loop
turns later behind every callback ready by then; the turn's later ones go out together once the
loop selects again. A real Mosquitto, on the shared loopback port, and a reader that is another
connection on its own event loop and thread.

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


def _read_in_a_thread(
    address: BrokerAddress, topic: str, count: int
) -> tuple[threading.Thread, threading.Event, list[tuple[float, bytes]]]:
    """A reader on its own connection, event loop and thread: (arrival, payload) of `count`
    messages on `topic`; the event is set once it has subscribed."""
    subscribed = threading.Event()
    arrived: list[tuple[float, bytes]] = []

    async def reader() -> None:
        options = ConnectOptions(client_id=f"reader-{secrets.token_hex(4)}")
        async with connect(address, options) as bus:
            await bus.subscribe(topic)
            subscribed.set()
            messages = bus.messages()
            async with asyncio.timeout(10):
                for _ in range(count):
                    incoming = await anext(messages)
                    arrived.append((time.monotonic(), incoming.payload))

    thread = threading.Thread(target=lambda: asyncio.run(reader()), daemon=True)
    thread.start()
    return thread, subscribed, arrived


def test_a_turns_first_publish_reaches_the_broker_while_the_loop_is_busy_the_rest_after() -> None:
    topic = f"specfleet-test/{secrets.token_hex(4)}/draft"
    address = BrokerAddress.from_url(SHARED_MOSQUITTO)
    thread, subscribed, arrived = _read_in_a_thread(address, topic, 2)
    assert subscribed.wait(10)

    async def writer() -> tuple[float, float]:
        options = ConnectOptions(client_id=f"writer-{secrets.token_hex(4)}")
        async with connect(address, options) as bus:
            first = asyncio.ensure_future(bus.publish(topic, b"first"))
            second = asyncio.ensure_future(bus.publish(topic, b"second"))
            await asyncio.sleep(0)  # both publishes' first steps run in this one turn
            started = time.monotonic()
            time.sleep(BUSY_S)  # this loop does nothing else meanwhile: no writer, no task
            busy_until = time.monotonic()
            await asyncio.gather(first, second)  # their PUBACKs, once the loop runs again
            return started, busy_until

    started, busy_until = asyncio.run(writer())
    thread.join(10)
    assert [payload for _, payload in arrived] == [b"first", b"second"]
    (first_at, _), (second_at, _) = arrived
    # The turn's first packet left at once; the second waited for the writer, after the block.
    assert started <= first_at < busy_until, (
        f"the first arrived {first_at - started:.3f} s after the publish; busy for {BUSY_S} s"
    )
    assert second_at >= busy_until


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
