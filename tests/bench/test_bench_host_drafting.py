"""specfleet bench host-drafting: a short real run with the shipped feature head drafts the same
windows both ways, in fewer head calls together; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.artifacts import default_models_dir
from modelbuild.head_build import ensure_heads
from modelbuild.target_build import ensure_target
from specfleet.cli import main


@pytest.fixture(scope="module")
def models_dir() -> Path:
    directory = default_models_dir()
    assert "eagle-h1" in ensure_heads(directory, ensure_target(directory))
    return directory


def test_a_short_run_drafts_the_same_windows_in_fewer_head_calls_together(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "drafting.json"
    argv = ["bench", "host-drafting", "--sessions", "1,6", "--rounds", "2",
            "--models-dir", str(models_dir), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "together / one by one" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["sessions"] for r in rows] == [1, 6]
    for row in rows:
        assert row["same_windows"] and row["together_ms"] > 0 and row["alone_ms"] > 0
        assert row["ratio"] == pytest.approx(row["together_ms"] / row["alone_ms"])
    alone, six = rows
    assert alone["head_calls_together"] == alone["head_calls_alone"]
    assert six["head_calls_together"] < six["head_calls_alone"] and six["rows_per_call"] > 1


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--sessions", "0"], "--sessions values must be >= 1"),
        (["--rounds", "1"], "--rounds must be at least 2"),
        (["--drafter", "no-such"], "no drafter no-such here"),
        (["--prompts", "/nonexistent.jsonl"], "no prompts file /nonexistent.jsonl"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    models_dir: Path, args: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "host-drafting", "--models-dir", str(models_dir), "--sessions", "1", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1
