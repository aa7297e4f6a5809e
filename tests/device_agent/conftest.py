"""Fixtures of the agent tests: the real target and tokenizer, the drafters on disk, a Mosquitto."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.mosquitto import PrivateMosquitto
from device_agent.catalog import DrafterCatalog
from inference.artifacts import default_models_dir
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer
from modelbuild.target_build import DEFAULT_PRECISION, ensure_target, load_target


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The default models directory, with the target built in it (once, on the first run)."""
    directory = default_models_dir()
    ensure_target(directory, DEFAULT_PRECISION)
    return directory


@pytest.fixture(scope="session")
def target(models_dir: Path) -> tuple[OnnxRuntime, ChatTokenizer]:
    return load_target(models_dir, precision=DEFAULT_PRECISION)


@pytest.fixture(scope="session")
def tokenizer(target: tuple[OnnxRuntime, ChatTokenizer]) -> ChatTokenizer:
    return target[1]


@pytest.fixture
def catalog(models_dir: Path) -> DrafterCatalog:
    return DrafterCatalog(models_dir)


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    """A broker of our own with TCP_NODELAY (the system one may lack it)."""
    with PrivateMosquitto() as broker:
        yield broker
