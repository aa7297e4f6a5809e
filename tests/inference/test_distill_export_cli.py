"""`specfleet models distill --export-only` shows a progress bar over the drafts, reports each
model it built once, and lets no TensorFlow narration through (21 s of it, and every model twice,
before). Builds draft-l1 for ONNX Runtime and LiteRT from its committed weights, against the
real target."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from inference.artifacts import default_models_dir, load_manifest

TARGET = "smollm2-135m-instruct-fp32"


def test_export_only_prints_one_line_per_model_and_a_bar(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / TARGET).symlink_to(default_models_dir() / TARGET)  # built once per machine
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", "models", "distill", "--export-only", "--size", "tiny",
         "--models-dir", str(models)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"built {name} ({load_manifest(models / name).size_bytes / 1e6:.1f} MB) in {models / name}"
        for name in ("draft-l1", "draft-l1-tflite")
    ]
    # The bar redraws itself with carriage returns: every piece of stderr is one of its states.
    states = [part.strip() for part in re.split(r"[\r\n]", done.stderr) if part.strip()]
    assert states and all(state.startswith("export: ") for state in states), states
    assert "1/1" in states[-1] and "100%" in states[-1]
