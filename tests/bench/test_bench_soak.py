"""`specfleet bench soak`: its arguments, and the report it makes of RSS samples (no timed run)."""

from __future__ import annotations

import argparse

import pytest

from bench import soak
from specfleet.cli import main

MB = 2**20


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (["--minutes", "0"], "--minutes must be in (0, 1440]"),
        (["--minutes", "2000"], "--minutes must be in (0, 1440]"),
        (["--minutes", "5", "--warmup-minutes", "5"], "--warmup-minutes must be in [0, --minutes)"),
        (["--workers", "0"], "--workers must be in 1..64"),
        (["--max-tokens", "1"], "--max-tokens must be in 2..256"),
        (["--sample-s", "0"], "--sample-s must be in 0.1..600"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    arguments: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "soak", *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet bench: "), err
    assert reason in err
    assert "\n" not in err


def test_help_names_the_measure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "soak", "--help"])
    assert done.value.code == 0
    assert "--minutes" in capsys.readouterr().out


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_defaults_are_thirty_minutes_with_five_of_warm_up() -> None:
    args = _args()
    assert args.minutes == 30.0
    assert soak.warmup_minutes(args) == 5.0
    assert soak.warmup_minutes(_args(minutes=3.0)) == 1.0
    assert soak.warmup_minutes(_args(minutes=3.0, warmup_minutes=0.5)) == 0.5


@pytest.mark.parametrize(
    ("after_warmup_mb", "growth"),
    [
        ([100] * 10, 0.0),
        ([100, 100, 101, 102, 103, 104, 105, 106, 108, 110], 9.0),  # 100 -> median(108, 110)
        ([200, 200, 190, 190, 180, 180, 180, 180, 180, 180], -10.0),
    ],
)
def test_growth_compares_the_first_and_last_fifth_after_warm_up(
    after_warmup_mb: list[int], growth: float
) -> None:
    warm = [(t, 500 * MB) for t in range(0, 60, 10)]  # ignored: warm-up
    samples = warm + [(60.0 + 10 * i, mb * MB) for i, mb in enumerate(after_warmup_mb)]
    result = soak.growth(samples, warmup_s=60.0)
    assert result["samples_after_warmup"] == len(after_warmup_mb)
    assert result["growth_percent"] == pytest.approx(growth)
    assert result["rss_max_mb"] == max(after_warmup_mb)


def test_too_few_samples_give_no_growth() -> None:
    assert soak.growth([(0.0, MB), (70.0, MB)], warmup_s=60.0)["growth_percent"] is None


def test_the_report_counts_every_kind_of_error() -> None:
    tally = soak.Tally(opened=10, finished=7, cancelled=3, rounds=60, timeouts=1)
    tally.refusals += ["session_open: over quota", "session_open: over quota"]
    samples = [(float(t), 100 * MB) for t in range(0, 120, 5)]
    document = soak.report(samples, tally, tracebacks=2, args=_args(minutes=2.0))
    assert document["errors"] == 2 + 1 + 2
    assert document["refusal_reasons"] == ["session_open: over quota"]
    assert document["growth_percent"] == 0.0
    text = soak.table(document)
    assert "RSS growth %" in text and "+0.00" in text
    assert "coordinator tracebacks" in text
