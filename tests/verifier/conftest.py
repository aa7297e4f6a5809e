"""Fixtures of the verifier tests: the real target and a private Mosquitto with TCP_NODELAY."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from verifier_helpers import target_pair

from broker.mosquitto import PrivateMosquitto
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer


@pytest.fixture(scope="session")
def target() -> tuple[OnnxRuntime, ChatTokenizer]:
    return target_pair()


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    """A broker of our own: the shared one lacks set_tcp_nodelay, which costs ~40 ms a trip."""
    with PrivateMosquitto() as broker:
        yield broker
