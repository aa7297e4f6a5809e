"""The embedded broker keeps broadcasting while clients subscribe: amqtt walked its subscription
table with awaits inside the walk, so a subscription made meanwhile killed the broadcast under
way ('dictionary changed size during iteration', its message lost for every subscriber). A real
embedded broker, real clients."""

from __future__ import annotations

import asyncio
import logging
import secrets

import pytest

from broker.client import BrokerAddress, ConnectOptions, connect
from broker.embedded import EmbeddedBroker
from broker.mosquitto import free_port

SUBSCRIBERS = 30
FILTERS_EACH = 20


def _options(name: str) -> ConnectOptions:
    return ConnectOptions(client_id=f"{name}-{secrets.token_hex(3)}", protocol="3.1.1")


def test_subscriptions_during_a_broadcast_storm_lose_no_broadcast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> tuple[int, int]:
        broker = EmbeddedBroker(port=free_port(), allow_anonymous=True)
        await broker.start()
        address = BrokerAddress.from_url(broker.url)
        try:
            async with (
                connect(address, _options("listener")) as listener,
                connect(address, _options("talker")) as talker,
            ):
                await listener.subscribe("storm/x", qos=0)
                stop = asyncio.Event()
                sent = 0

                async def talk() -> None:
                    nonlocal sent
                    while not stop.is_set():
                        await talker.publish("storm/x", b"m", qos=0)
                        sent += 1

                async def subscribe(index: int) -> None:
                    async with connect(address, _options(f"sub{index}")) as client:
                        for j in range(FILTERS_EACH):
                            await client.subscribe(f"storm/{index}/{j}", qos=0)

                talking = asyncio.create_task(talk())
                await asyncio.gather(*(subscribe(i) for i in range(SUBSCRIBERS)))
                stop.set()
                await talking
                await talker.publish("storm/x", b"end", qos=1)
                heard = 0
                async with asyncio.timeout(10):
                    async for incoming in listener.messages():
                        if incoming.payload == b"end":
                            break
                        heard += 1
                return sent, heard
        finally:
            await broker.stop()

    with caplog.at_level(logging.ERROR):
        sent, heard = asyncio.run(scenario())
    lost = [r.getMessage() for r in caplog.records if "changed size" in r.getMessage()]
    assert not lost, lost[:2]
    assert sent > 0 and heard == sent  # QoS 0 on loopback: every broadcast reached the listener
