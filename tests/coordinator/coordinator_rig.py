"""A coordinator running in the test's event loop on a real broker and database, and a device
speaking the protocol by hand to it, so a test can send what no agent would."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from broker import messages as m
from broker.client import BrokerAddress, BusClient, ConnectOptions, Incoming, connect
from broker.topics import DeviceChannel, device_topic
from coordinator.runtime.service import Coordinator
from core.settings import Settings

REPLY_TIMEOUT_S = 10.0


def rig_settings(home: Path, engine: Engine, broker_url: str, **quotas: Any) -> Settings:
    return Settings(
        home=home,
        database_url=engine.url.render_as_string(hide_password=False),
        broker_url=broker_url,
        coordinator_id=f"coordinator-test-{secrets.token_hex(4)}",
        **quotas,
    )


@contextlib.asynccontextmanager
async def running_coordinator(
    settings: Settings, engine: Engine, **kwargs: Any
) -> AsyncIterator[Coordinator]:
    """A coordinator that accepts unknown devices (the quickstart's rule), connected."""
    coordinator = Coordinator(settings, engine, accept_unknown_devices=True, **kwargs)
    task = asyncio.create_task(coordinator.run(), name="coordinator")
    try:
        await asyncio.wait_for(coordinator.connected.wait(), 30)
        yield coordinator
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class RawDevice:
    """One device's connection: publishes on its uplink topics, reads its verdicts and commands."""

    def __init__(self, device_id: str, client: BusClient) -> None:
        self.device_id = device_id
        self.client = client
        self._messages: AsyncIterator[Incoming] = client.messages()

    async def send(self, channel: DeviceChannel, payload: bytes | m.Message) -> None:
        if not isinstance(payload, bytes):
            payload = m.encode(payload)
        await self.client.publish(device_topic(self.device_id, channel), payload)

    async def reply(
        self,
        timeout_s: float = REPLY_TIMEOUT_S,
        accept: Callable[[m.Message], bool] = lambda _: True,
    ) -> m.Message:
        """The next message on the device's verdict topic that `accept` takes."""
        verdicts = device_topic(self.device_id, DeviceChannel.VERDICT)
        async with asyncio.timeout(timeout_s):
            while True:
                incoming = await anext(self._messages)
                if incoming.topic == verdicts:
                    message = m.decode(incoming.payload)
                    if accept(message):
                        return message

    async def drain(self, quiet_s: float) -> list[m.Message]:
        """Every verdict-topic message until none comes for `quiet_s`."""
        verdicts = device_topic(self.device_id, DeviceChannel.VERDICT)
        found: list[m.Message] = []
        while True:
            try:
                incoming = await asyncio.wait_for(anext(self._messages), quiet_s)
            except (asyncio.TimeoutError, TimeoutError):
                return found
            if incoming.topic == verdicts:
                found.append(m.decode(incoming.payload))


@contextlib.asynccontextmanager
async def raw_device(broker_url: str, device_id: str) -> AsyncIterator[RawDevice]:
    options = ConnectOptions(client_id=f"raw-{device_id}-{secrets.token_hex(3)}")
    async with connect(BrokerAddress.from_url(broker_url), options) as client:
        await client.subscribe(device_topic(device_id, DeviceChannel.VERDICT))
        await client.subscribe(device_topic(device_id, DeviceChannel.COMMAND))
        yield RawDevice(device_id, client)


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """Log records that carry a traceback, or that asyncio wrote about a failed task."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in records
        if r.exc_info is not None or (r.name == "asyncio" and r.levelno >= logging.ERROR)
    ]
