"""specfleet bench draft-boundary: a short real run writes its table and JSON; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.artifacts import default_models_dir
from modelbuild.distill import ensure_drafts
from modelbuild.target_build import DEFAULT_PRECISION, ensure_target
from specfleet.cli import main


@pytest.fixture(scope="module")
def models_dir() -> Path:
    directory = default_models_dir()
    ensure_drafts(directory, ensure_target(directory, DEFAULT_PRECISION))
    return directory


def test_a_short_run_measures_both_sides_and_finds_the_same_windows(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "boundary.json"
    argv = ["bench", "draft-boundary", "--drafts", "draft-l1,draft-l1-tflite", "--k", "2",
            "--rounds", "12", "--models-dir", str(models_dir), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "boundary p50 ms" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["rounds"] == 12
    rows = document["results"]
    assert [(r["draft"], r["k"]) for r in rows] == [("draft-l1", 2), ("draft-l1-tflite", 2)]
    for row in rows:
        assert row["same_windows"] is True
        assert row["in_process_p50_ms"] > 0 and row["isolated_p50_ms"] > 0
        assert row["boundary_per_step_ms"] == pytest.approx(row["boundary_p50_ms"] / 2)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--drafts", "no-such-draft"], "no drafts to measure"),
        (["--k", "two"], "--k takes comma-separated integers"),
        (["--k", "0"], "at least 1"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    models_dir: Path, args: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "draft-boundary", "--models-dir", str(models_dir), *args]) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1
