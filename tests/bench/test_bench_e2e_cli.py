"""`specfleet bench e2e`: bad arguments exit with status 2 and a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from specfleet.cli import main


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (["--limit", "0"], "--limit must be >= 1"),
        (["--max-tokens", "1"], "--max-tokens must be in 2..8192"),
        (["--k", "0"], "--k must be in 1..64"),
        (["--k", "65"], "--k must be in 1..64"),
        (["--agents", "0"], "--agents must be in 1..16"),
        (["--waves", "0"], "--waves must be in 1..20"),
        (["--agents", "2", "--sessions", "17"], "--sessions must be in 1..16"),
        (["--sessions", "0"], "--sessions must be in 1..32"),
        (["--sessions", "33"], "--sessions must be in 1..32 (8 per agent)"),
        (["--sessions", "4", "4"], "--sessions lists a level twice"),
        (["--sessions", "1", "4", "--proactive-sessions", "16"], "are not among --sessions"),
        (["--broker", "http://127.0.0.1:1883"], "--broker must be an mqtt://"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "no prompts file"),
        (["--drafter", "no-such-drafter"], "unknown drafter 'no-such-drafter'"),
        (["--proactive-drafters", "hybrid"], "--proactive-drafters needs --proactive-sessions"),
        (
            ["--sessions", "1", "--proactive-sessions", "1", "--proactive-drafters", "hybrid", "x"],
            "unknown drafter 'x'",
        ),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    arguments: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "e2e", *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet bench: "), err
    assert reason in err
    assert "\n" not in err


def test_a_prompts_file_that_is_not_jsonl_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "task": "chat"}\n')  # no prompt
    assert main(["bench", "e2e", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read prompts" in err and f"{prompts}:1" in err
    assert "\n" not in err


def test_a_pass_trace_directory_that_cannot_be_made_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", "e2e", "--pass-trace", str(blocker / "trace")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"specfleet bench: --pass-trace {blocker / 'trace'}: "), err
    assert "\n" not in err


@pytest.mark.parametrize("arguments", [["--limit", "many"], ["--sessions"], ["--no-such-flag"]])
def test_malformed_flags_are_refused_by_the_parser(arguments: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "e2e", *arguments])
    assert exited.value.code == 2


def test_help_names_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "e2e", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--prompts", "--limit", "--max-tokens", "--drafter", "--sessions", "--json"):
        assert flag in out
    for flag in ("--proactive-sessions", "--proactive-drafters", "--database-url", "--broker"):
        assert flag in out
    assert "--bus-target-only" in out
    assert "default: 1 4 16 32" in out
