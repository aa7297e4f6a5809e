"""`specfleet sim profile`: the cost table of any built target, on the provider asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelbuild.target_build import build_target
from specfleet.cli import main
from tests.inference.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("profile")
    build_target(root / "models", gguf=write_tiny_gguf(root / "t.gguf"), name="t", progress=False)
    return root / "models"


def test_profile_of_a_named_target_prints_its_table_and_writes_json(
    tiny_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    argv = ["sim", "profile", "--target", "t", "--models-dir", str(tiny_models), "--out", str(out)]
    assert main([*argv, "--context", "8"]) == 0
    printed = capsys.readouterr().out
    assert "T=9" in printed.splitlines()[0] and "B" in printed.splitlines()[0]
    profile = json.loads(out.read_text())
    assert "t on cpu" in profile["source"]
    shapes = {(rows, positions) for rows, positions, _ in profile["passes"]}
    assert {(b, t) for b in (1, 4, 16, 32) for t in (1, 3, 5, 9)} <= shapes
    assert all(ms > 0 for _, _, ms in profile["passes"])


def test_profile_on_a_provider_this_onnxruntime_lacks_is_refused(
    tiny_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: nothing to refuse")
    argv = ["sim", "profile", "--target", "t", "--models-dir", str(tiny_models)]
    assert main([*argv, "--out", str(tmp_path / "p.json"), "--provider", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "CUDAExecutionProvider" in err and "\n" not in err
