"""specfleet bench target-passes: a short real run writes its table and JSON; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.target_passes import LOGIT_TOLERANCE
from inference.artifacts import default_models_dir
from modelbuild.target_build import DEFAULT_PRECISION, ensure_target
from specfleet.cli import main


@pytest.fixture(scope="module")
def models_dir() -> Path:
    directory = default_models_dir()
    ensure_target(directory, DEFAULT_PRECISION)
    return directory


def test_a_short_run_times_both_ways_and_their_logits_agree(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "passes.json"
    argv = ["bench", "target-passes", "--rows", "2", "--k", "0,2", "--passes", "3",
            "--turns", "1", "--models-dir", str(models_dir), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "stacked every pass ms" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["passes"] == 3
    rows = document["results"]
    assert [(r["rows"], r["k"]) for r in rows] == [(2, 0), (2, 2)]
    for row in rows:
        assert row["in_place_ms"] > 0 and row["stacked_ms"] > 0
        assert row["ratio"] == pytest.approx(row["in_place_ms"] / row["stacked_ms"])
        assert 0 <= row["max_logit_diff"] <= LOGIT_TOLERANCE


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--rows", "1"], "--rows values must be >= 2"),
        (["--k", "one"], "--k must be comma-separated integers"),
        (["--k", "-1"], "--k values must be >= 0"),
        (["--passes", "1"], "--passes must be at least 2"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    models_dir: Path, args: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "target-passes", "--models-dir", str(models_dir), *args]) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1
