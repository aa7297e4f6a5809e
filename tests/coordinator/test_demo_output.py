"""`specfleet demo` keeps its terminal for the answers and the table: its log goes to a file
unless -v, and the table ends with the target alone on the same prompts beside the fleet."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inference.artifacts import default_models_dir
from localfleet.demo import TargetAlone, TokenStream, results_table, throughput_line

RUN_S = 600.0
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) ", re.M)


def _session(prompt_id: str, tokens: int, tokens_per_s: float) -> dict[str, object]:
    return {
        "prompt_id": prompt_id,
        "device_id": "demo-pi",
        "draft": "hybrid",
        "tokens": tokens,
        "alpha": 0.5,
        "tokens_per_s": tokens_per_s,
        "rounds": 4,
        "verifiers": {"demo-verifier-1": 4},
    }


@pytest.mark.parametrize(("same", "shown"), [(True, "yes"), (False, "NO"), (None, "-")])
def test_the_table_sets_each_session_beside_the_target_alone(same: bool | None, shown: str) -> None:
    results = [_session("qa-01", 20, 50.0)]
    baseline = {"qa-01": TargetAlone(tokens=20, decode_s=0.8, total_s=1.0, same=same)}
    table = results_table(results, baseline)
    header, _, row = table.splitlines()[:3]
    assert header.split()[-4:] == ["target", "tok/s", "speedup", "same"]
    assert row.split()[-3:] == ["25.0", "2.00x", shown]


def test_the_throughput_line_compares_the_fleet_with_the_target_one_prompt_at_a_time() -> None:
    results = [_session("qa-01", 20, 50.0), _session("qa-02", 30, 40.0)]
    baseline = {
        "qa-01": TargetAlone(tokens=20, decode_s=0.8, total_s=1.0, same=True),
        "qa-02": TargetAlone(tokens=30, decode_s=1.2, total_s=1.5, same=False),
    }
    line = throughput_line(results, baseline, fleet_s=2.0)
    assert line == (
        "fleet (DSD): 50 tokens in 2.0 s of answering, 25.0 tokens/s | target alone, one "
        "prompt at a time: 50 tokens in 2.5 s, 20.0 tokens/s | speedup 1.25x; 1 of 2 answers "
        "token-identical"
    )


def _stream(writes: list[tuple[str, str] | str], *, live: bool) -> str:
    out = io.StringIO()
    stream = TokenStream(out, live=live)
    for step in writes:
        if isinstance(step, str):
            stream.end(step)
        else:
            stream.write(*step)
    return out.getvalue()


INTERLEAVED: list[tuple[str, str] | str] = [
    ("a", "The"), ("b", "Use"), ("a", " sky\nis"), ("b", " a"), "b", ("a", " blue"), "a",
]  # fmt: skip


def test_off_a_terminal_sessions_never_share_a_line() -> None:
    assert _stream(INTERLEAVED, live=False) == "[a] The sky\n[b] Use a\n[a] is blue\n"


def test_on_a_terminal_each_session_grows_its_own_line_token_by_token() -> None:
    up = "\x1b[{}F\x1b[J"  # back to the first live line, erase to the end of the screen
    assert _stream(INTERLEAVED, live=True) == "".join(
        [
            "[a] The\n",
            up.format(1), "[a] The\n[b] Use\n",
            up.format(2), "[a] The sky\n", "[a] is\n[b] Use\n",  # a's line done: it stays
            up.format(2), "[a] is\n[b] Use a\n",
            up.format(2), "[b] Use a\n", "[a] is\n",  # b ends
            up.format(1), "[a] is blue\n",
            up.format(1), "[a] is blue\n",  # a ends
        ]
    )  # fmt: skip


def test_without_a_baseline_the_table_has_no_comparison() -> None:
    table = results_table([_session("qa-01", 20, 50.0)], {})
    assert "speedup" not in table and "qa-01" in table


def test_a_small_demo_logs_to_a_file_and_ends_with_the_target_alone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(
        SPECFLEET_HOME=str(tmp_path / "home"),
        SPECFLEET_MODELS_DIR=str(default_models_dir()),
        PYTHONUNBUFFERED="1",
    )
    out_json = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", "demo", "--limit", "2", "--agents", "1",
         "--verifiers", "1", "--max-tokens", "16", "--json", str(out_json)],
        env=env, capture_output=True, text=True, timeout=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert LOG_LINE.search(done.stdout) is None, done.stdout
    assert LOG_LINE.search(done.stderr) is None, done.stderr[-3000:]
    workdir = Path(re.search(r"logs in (\S+)\)", done.stdout).group(1))  # type: ignore[union-attr]
    assert LOG_LINE.search((workdir / "demo.log").read_text())

    table = done.stdout.split("\n\n")[-1]
    assert "target tok/s" in table and "speedup" in table
    document = json.loads(out_json.read_text())
    sessions = document["sessions"]
    assert len(sessions) == 2
    alone = document["target_alone"]
    for session in sessions:
        # Greedy: the fleet's answer is the target's own, token for token (the losslessness
        # contract), checked here against the target decoding alone.
        assert alone[session["prompt_id"]]["same_tokens"] is True
        assert alone[session["prompt_id"]]["tokens"] == session["tokens"]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("fleet (DSD): ")]
    assert line.endswith("2 of 2 answers token-identical")
