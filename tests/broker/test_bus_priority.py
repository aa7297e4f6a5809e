"""A reader that falls behind reads the messages its `priority` ranks first before the backlog
that came earlier, and each topic's messages still in their order: 300 messages on device-like
topics, then three on a verifier-like one, all queued while the reader sleeps. A real Mosquitto,
on the shared loopback port."""

from __future__ import annotations

import asyncio
import secrets

from broker.client import BrokerAddress, ConnectOptions, connect

SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
BACKLOG = 300


def test_a_ranked_topic_jumps_the_backlog_and_each_topic_keeps_its_order() -> None:
    root = f"specfleet-test/{secrets.token_hex(4)}"
    urgent = f"{root}/verifier/v1/status"

    def rank(topic: str) -> int:
        return 0 if topic == urgent else 1

    async def scenario() -> list[str]:
        address = BrokerAddress.from_url(SHARED_MOSQUITTO)
        reader_options = ConnectOptions(client_id=f"ranked-{secrets.token_hex(4)}", priority=rank)
        writer_options = ConnectOptions(client_id=f"writer-{secrets.token_hex(4)}")
        async with connect(address, reader_options) as reader:
            await reader.subscribe(f"{root}/#")
            async with connect(address, writer_options) as writer:
                for i in range(BACKLOG):
                    await writer.publish(f"{root}/device/d{i % 3}/status", str(i).encode())
                for i in range(3):
                    await writer.publish(urgent, f"beat-{i}".encode())
            await asyncio.sleep(1.0)  # all of it arrives while this reader is busy elsewhere
            read: list[str] = []
            messages = reader.messages()
            async with asyncio.timeout(10):
                while len(read) < BACKLOG + 3:
                    read.append((await anext(messages)).payload.decode())
            return read

    read = asyncio.run(scenario())
    assert read[:3] == ["beat-0", "beat-1", "beat-2"]
    assert read[3:] == [str(i) for i in range(BACKLOG)]
