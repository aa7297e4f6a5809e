"""`up`'s own Mosquitto (coordinator.stack_broker): the production config on loopback, devices on
one listener and services on another, its password file following the registry while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from broker.client import BrokerAddress, BusAuthError, BusConnectionError, ConnectOptions, connect
from broker.mosquitto import free_port
from coordinator.db.engine import make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from coordinator.stack_broker import StackMosquitto, mosquitto_binary

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto is not installed")


@pytest.fixture
def registry(sqlite_engine: Engine) -> DeviceRegistry:
    return DeviceRegistry(make_sessionmaker(sqlite_engine), hash_iterations=10)


@pytest.fixture
def mosquitto(registry: DeviceRegistry, tmp_path: Path) -> Iterator[StackMosquitto]:
    binary = mosquitto_binary()
    assert binary is not None
    broker = StackMosquitto(binary, tmp_path / "mosquitto", free_port())
    broker.start(registry)
    yield broker
    broker.stop()


def _connects(url: str, username: str, password: str) -> str:
    """'ok', 'refused' (credentials) or 'dropped' (anything else), after one attempt."""

    async def attempt() -> str:
        options = ConnectOptions(client_id=username, username=username, password=password)
        try:
            async with connect(BrokerAddress.from_url(url), options) as client:
                return f"ok MQTT {client.protocol}"
        except BusAuthError:
            return "refused"
        except BusConnectionError:
            return "dropped"

    return asyncio.run(attempt())


def test_services_and_devices_have_their_own_listeners(
    mosquitto: StackMosquitto, registry: DeviceRegistry
) -> None:
    coordinator = mosquitto.credentials["coordinator"]
    assert _connects(mosquitto.service_url, "coordinator", coordinator) == "ok MQTT 5"
    assert _connects(mosquitto.service_url, "coordinator", "wrong") == "refused"
    _, credential = registry.provision("pi-1", "pi", [])
    assert mosquitto.refresh(registry) is True
    assert mosquitto.refresh(registry) is False  # nothing changed: no reload
    assert _connects(mosquitto.url, "pi-1", credential) == "ok MQTT 5"
    # Devices are not service accounts: the services' listener does not know them.
    assert _connects(mosquitto.service_url, "pi-1", credential) == "refused"
    config = (mosquitto.directory / "mosquitto.conf").read_text()
    assert "set_tcp_nodelay true" in config
    assert f"listener {mosquitto.port} 127.0.0.1" in config


def test_a_device_follows_the_registry_in_and_out(
    mosquitto: StackMosquitto, registry: DeviceRegistry
) -> None:
    _, credential = registry.provision("pi-2", "pi", [])
    assert _connects(mosquitto.url, "pi-2", credential) == "refused"  # not in the file yet
    assert mosquitto.refresh(registry)
    assert _connects(mosquitto.url, "pi-2", credential) == "ok MQTT 5"
    registry.retire("pi-2", reason="stolen", actor="test")
    assert mosquitto.refresh(registry)
    assert _connects(mosquitto.url, "pi-2", credential) == "refused"


def test_stop_ends_the_process(mosquitto: StackMosquitto) -> None:
    mosquitto.stop()
    assert _connects(mosquitto.service_url, "coordinator", "x") == "dropped"
    mosquitto.stop()  # twice is harmless
