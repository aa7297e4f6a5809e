"""specfleet bench round-floor: a short real run (a private Mosquitto, a spinning child, a scratch
SQLite) measures every leg and writes its table and JSON; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specfleet.cli import main

LEGS = ["pipe", "bus", "bus + pipe", "commit, back to back", "commit, one a round"]


def test_a_short_run_measures_every_leg_and_the_floor_is_their_sum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "floor.json"
    argv = ["bench", "round-floor", "--rounds", "6", "--compute-ms", "3", "--gap-ms", "1",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "a direct round's floor" in printed
    document = json.loads(out.read_text())
    assert document["benchmark"] == "round-floor" and document["compute_ms"] == 3
    rows = {row["leg"]: row for row in document["results"]}
    assert list(rows) == LEGS
    for row in rows.values():
        assert row["rounds"] == 6
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert document["floor_p50_ms"] == pytest.approx(
        rows["bus + pipe"]["p50_ms"] + rows["commit, one a round"]["p50_ms"]
    )
    assert document["commit_paced_over_back_to_back"] == pytest.approx(
        rows["commit, one a round"]["p50_ms"] / rows["commit, back to back"]["p50_ms"]
    )


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--compute-ms", "0"], "--compute-ms must be above 0"),
        (["--gap-ms", "-1"], "--gap-ms at least 0"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    args: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "round-floor", *args]) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1
