"""The embedded broker: client ids bound to usernames, and retired accounts disconnected."""

from __future__ import annotations

import asyncio
import secrets
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from broker.client import (
    BrokerAddress,
    BusAuthError,
    BusClient,
    BusConnectionError,
    ConnectOptions,
    connect,
)
from broker.embedded import EmbeddedBroker
from broker.mosquitto import free_port
from broker.passwords import hash_credential, new_credential
from broker.topics import DeviceChannel, device_topic

WAIT_S = 5.0
# Low stretching keeps connects fast here; the broker reads the count from each hash.
TEST_ITERATIONS = 100


async def _next_payload(client: BusClient) -> bytes:
    async for incoming in client.messages():
        return incoming.payload
    raise AssertionError("the message stream ended")


async def _still_hears(coordinator: BusClient, device: BusClient, device_id: str) -> bool:
    """Whether `coordinator` is connected and subscribed: it gets a status `device` sends."""
    marker = secrets.token_hex(4).encode()
    await device.publish(device_topic(device_id, DeviceChannel.STATUS), marker)
    try:
        return await asyncio.wait_for(_next_payload(coordinator), WAIT_S) == marker
    except (asyncio.TimeoutError, BusConnectionError):
        return False


class Embedded:
    """An embedded broker on a free port whose password file holds a coordinator and two
    devices; `async with Embedded(tmp_path) as embedded:`."""

    def __init__(self, tmp_path: Path) -> None:
        suffix = secrets.token_hex(3)
        self.device_a, self.device_b = f"dev-a-{suffix}", f"dev-b-{suffix}"
        self.credentials = {
            name: new_credential() for name in ("coordinator", self.device_a, self.device_b)
        }
        self.password_file = tmp_path / "passwords"
        self.password_file.write_text(
            "".join(
                f"{name}:{hash_credential(secret, iterations=TEST_ITERATIONS)}\n"
                for name, secret in self.credentials.items()
            )
        )
        self.broker = EmbeddedBroker(
            port=free_port(),
            password_file=self.password_file,
            allow_anonymous=True,
            service_users=("coordinator",),
        )
        self.address = BrokerAddress.from_url(self.broker.url)

    def options(
        self,
        client_id: str,
        username: str | None,
        password: str | None = None,
        *,
        persistent: bool = False,
    ) -> ConnectOptions:
        if username is not None and password is None:
            password = self.credentials[username]
        return ConnectOptions(
            client_id, username, password, persistent=persistent, protocol="3.1.1"
        )

    async def __aenter__(self) -> Embedded:
        await self.broker.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.broker.stop()


@pytest.mark.parametrize(
    "intruder", ["another device's credential", "a wrong password", "anonymous"]
)
@pytest.mark.parametrize("persistent", [False, True])
def test_no_one_else_can_take_the_coordinators_client_id(
    tmp_path: Path, intruder: str, persistent: bool
) -> None:
    """amqtt alone let any CONNECT with the id `coordinator`, even a refused one, drop the
    coordinator's session; bound ids leave it connected and subscribed."""

    async def scenario() -> None:
        async with Embedded(tmp_path) as embedded, AsyncExitStack() as stack:
            a = embedded.device_a
            username, password = {
                "another device's credential": (embedded.device_b, None),
                "a wrong password": ("coordinator", "not-the-credential"),
                "anonymous": (None, None),
            }[intruder]
            coordinator = await stack.enter_async_context(
                connect(embedded.address, embedded.options("coordinator", "coordinator"))
            )
            await coordinator.subscribe(device_topic(a, DeviceChannel.STATUS))
            device = await stack.enter_async_context(
                connect(embedded.address, embedded.options(f"dev-{a}", a))
            )
            assert await _still_hears(coordinator, device, a)

            options = embedded.options("coordinator", username, password, persistent=persistent)
            try:
                await stack.enter_async_context(connect(embedded.address, options))
            except BusAuthError:
                assert intruder == "a wrong password"
            else:
                assert intruder != "a wrong password"
            assert await _still_hears(coordinator, device, a)

    asyncio.run(scenario())


def test_an_account_may_take_over_its_own_id(tmp_path: Path) -> None:
    """The same account reconnecting under the same id replaces its stale connection."""

    async def scenario() -> None:
        async with Embedded(tmp_path) as embedded:
            options = embedded.options("agent", embedded.device_a, persistent=True)
            async with connect(embedded.address, options) as first:
                await first.subscribe(device_topic(embedded.device_a, DeviceChannel.VERDICT))
                async with connect(embedded.address, options):
                    with pytest.raises(BusConnectionError):
                        await asyncio.wait_for(_next_payload(first), WAIT_S)

    asyncio.run(scenario())


def test_disconnect_user_closes_that_accounts_connections_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Embedded(tmp_path) as embedded:
            a, b = embedded.device_a, embedded.device_b
            async with (
                connect(embedded.address, embedded.options("c", "coordinator")) as coordinator,
                connect(embedded.address, embedded.options(f"dev-{b}", b)) as device,
                connect(embedded.address, embedded.options(f"dev-{a}", a)) as retired,
            ):
                await coordinator.subscribe(device_topic(b, DeviceChannel.STATUS))
                await retired.subscribe(device_topic(a, DeviceChannel.VERDICT))
                assert await embedded.broker.disconnect_user(a) == 1
                with pytest.raises(BusConnectionError):
                    await asyncio.wait_for(_next_payload(retired), WAIT_S)
                assert await _still_hears(coordinator, device, b)

    asyncio.run(scenario())


def test_processes_sharing_an_account_keep_their_own_ids(tmp_path: Path) -> None:
    """The quickstart's verifiers share one account; each keeps its connection."""

    async def scenario() -> None:
        async with Embedded(tmp_path) as embedded:
            a = embedded.device_a
            async with (
                connect(embedded.address, embedded.options("v1", "coordinator")) as first,
                connect(embedded.address, embedded.options("v2", "coordinator")) as second,
                connect(embedded.address, embedded.options(f"dev-{a}", a)) as device,
            ):
                await first.subscribe(device_topic(a, DeviceChannel.STATUS))
                await second.subscribe(device_topic(a, DeviceChannel.STATUS))
                assert await _still_hears(first, device, a)
                assert await asyncio.wait_for(_next_payload(second), WAIT_S)

    asyncio.run(scenario())
