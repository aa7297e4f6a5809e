"""`specfleet bench replay` and the arguments it shares with `bench models`, on the real target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.artifacts import default_models_dir
from inference.drafters import make_proposer
from inference.sampling import SamplingParams
from inference.speculative import decode_speculative
from modelbuild.target_build import load_target
from specfleet.cli import main

TUNE_PROMPTS = Path(__file__).resolve().parents[2] / "bench" / "prompts" / "tune.jsonl"


@pytest.mark.parametrize("benchmark", ["replay", "models"])
@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--drafters", "no-such-drafter"], "unknown drafters ['no-such-drafter']"),
        (["--k", "2,x"], "--k must be comma-separated integers"),
        (["--k", "0"], "--k values must be >= 1"),
        (["--prompts", "/no/such/prompts.jsonl"], "No such file"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    benchmark: str, arguments: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", benchmark, *arguments]) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1


def test_replay_reports_the_tokens_per_pass_of_real_speculative_decoding(tmp_path: Path) -> None:
    """Copying drafters, and a feature head handed the target's features as verdicts would."""
    out = tmp_path / "replay.json"
    argv = ["bench", "replay", "--prompts", str(TUNE_PROMPTS), "--limit", "3",
            "--max-tokens", "24", "--drafters", "lookup,hybrid,eagle-h1", "--k", "2,5",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(out.read_text())
    rows = {(row["drafter"], row["k"]): row for row in document["rows"]}
    assert set(rows) == {(name, k) for name in ("lookup", "hybrid", "eagle-h1") for k in (2, 5)}

    target, tokenizer = load_target()
    prompts = [json.loads(line)["prompt"] for line in TUNE_PROMPTS.read_text().splitlines()][:3]
    for name, k in rows:
        drafter = make_proposer(name, default_models_dir())
        tokens = passes = drafted = 0
        for prompt in prompts:
            result = decode_speculative(
                target, drafter, tokenizer.apply_chat_template(prompt), k, 24,
                SamplingParams(temperature=0.0), tokenizer.eos_id,
            )  # fmt: skip
            tokens += len(result.tokens)
            passes += result.target_passes
            drafted += result.n_drafted
        assert rows[(name, k)]["tokens_per_pass"] == pytest.approx(tokens / passes)
        assert rows[(name, k)]["drafted_per_pass"] == pytest.approx(drafted / passes)
    assert document["target_tokens"] == tokens
