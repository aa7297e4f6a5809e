"""A closed bus connection leaves no task of its own behind: the wait that every publish races
against a lost connection ends with it (left pending, asyncio destroyed it at the loop's end and
logged 'Task was destroyed but it is pending!', as `bench bus` printed between its bars). A real
Mosquitto, on the shared loopback port."""

from __future__ import annotations

import asyncio
import secrets

from broker.client import BrokerAddress, ConnectOptions, connect

SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"


def test_closing_a_connection_that_published_leaves_no_task() -> None:
    async def scenario() -> set[str]:
        options = ConnectOptions(client_id=f"close-test-{secrets.token_hex(4)}")
        async with connect(BrokerAddress.from_url(SHARED_MOSQUITTO), options) as client:
            await client.publish(f"specfleet-test/{secrets.token_hex(4)}", b"x")
            assert client._lost_waiter is not None and not client._lost_waiter.done()
        await asyncio.sleep(0)  # a cancelled task finishes on the loop's next turn
        current = asyncio.current_task()
        return {repr(task) for task in asyncio.all_tasks() if task is not current}

    assert asyncio.run(scenario()) == set()
