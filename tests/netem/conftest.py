"""A private Mosquitto for the emulator's tests: the proxy sits in front of a real broker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker.mosquitto import PrivateMosquitto


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    with PrivateMosquitto() as broker:
        yield broker
