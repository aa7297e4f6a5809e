"""Fixtures for the real target model: built once into the default models directory, then cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.artifacts import default_models_dir
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer
from modelbuild.target_build import DEFAULT_PRECISION, TargetPrecision, ensure_target, load_target


@pytest.fixture(scope="session")
def target_dir() -> Path:
    """The default-precision target's model directory (built on the first run only)."""
    return ensure_target(default_models_dir(), DEFAULT_PRECISION)


@pytest.fixture(scope="session")
def target(target_dir: Path) -> tuple[OnnxRuntime, ChatTokenizer]:
    return load_target(target_dir.parent, precision=DEFAULT_PRECISION)


@pytest.fixture(scope="session", params=["fp32", "q4"])
def any_target(request: pytest.FixtureRequest) -> tuple[OnnxRuntime, ChatTokenizer]:
    """The target at each precision the builder offers."""
    precision: TargetPrecision = request.param
    return load_target(default_models_dir(), precision=precision)


@pytest.fixture(scope="session")
def chat_tokenizer(target_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(target_dir)
