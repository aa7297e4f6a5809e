"""`specfleet generate` on the real target: arguments, JSON output, and modes that agree."""

from __future__ import annotations

import json

import pytest
from real_target import target_pair

from specfleet.cli import main

PROMPT = "Name three colours of the rainbow."


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--k", "0"], "--k must be >= 1"),
        (["--draft", "no-such-draft"], "unknown drafter 'no-such-draft'"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_bad_arguments_exit_with_one_line(
    extra: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["generate", "--prompt", PROMPT, *extra])
    err = capsys.readouterr().err
    assert status == 2
    assert reason in err
    assert len(err.strip().splitlines()) == 1


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    capsys.readouterr()
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "24", "--json", *args]) == 0
    document: dict[str, object] = json.loads(capsys.readouterr().out)
    return document


def test_speculative_json_matches_target_mode(capsys: pytest.CaptureFixture[str]) -> None:
    target_pair()  # build and load once, outside the timed part
    alone = run_json(capsys, "--mode", "target")
    speculative = run_json(capsys, "--mode", "speculative", "--draft", "hybrid", "--k", "5")
    assert speculative["token_ids"] == alone["token_ids"]
    assert speculative["text"] == alone["text"]
    assert isinstance(alone["text"], str) and alone["text"]
    rounds = speculative["rounds"]
    assert isinstance(rounds, list) and rounds
    assert all(set(r) == {"k", "n_accepted", "draft_ms", "verify_ms"} for r in rounds)
    assert all(r["k"] <= 5 and 0 <= r["n_accepted"] <= r["k"] for r in rounds)
    totals = speculative["totals"]
    assert isinstance(totals, dict)
    assert totals["n_tokens"] == len(speculative["token_ids"])  # type: ignore[arg-type]
    assert totals["target_passes"] == len(rounds)
    assert totals["n_accepted"] == sum(r["n_accepted"] for r in rounds)


def test_sampled_generation_is_reproducible(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--temperature", "0.8", "--top-p", "0.9", "--draft", "lookup", "--k", "3")
    first = run_json(capsys, *args, "--seed", "7")
    again = run_json(capsys, *args, "--seed", "7")
    assert first["token_ids"] == again["token_ids"]


def test_plain_output_streams_the_same_text(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "--draft", "lookup")
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "24", "--draft", "lookup"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{document['text']}\n"
    assert "tokens/pass" in captured.err
