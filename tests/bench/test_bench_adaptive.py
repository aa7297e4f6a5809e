"""`specfleet bench adaptive`: bad arguments are refused in one line; --quick runs the trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.adaptive import ADAPTIVE, PHASES, Config, parse_grid, phase_prompts
from localfleet.prompts import BenchPrompt
from specfleet.cli import main


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (["--prompts-per-phase", "0"], "--prompts-per-phase must be in 1..8"),
        (["--max-tokens", "1"], "--max-tokens must be in 2..512"),
        (["--phases", "lan", "moon"], "unknown phase 'moon'"),
        (["--phases", "offline"], "unknown phase 'offline'"),  # the blip is the way offline
        (["--blip-s", "0"], "--blip-s must be in (0, 30]"),
        (["--blip-after-s", "-1"], "--blip-after-s must be in [0, 30]"),
        (["--grid", "distributed:hybrid"], "a grid entry is MODE:DRAFT:K"),
        (["--grid", "local:hybrid:4"], "a grid mode is distributed or cloud"),
        (["--grid", "cloud:hybrid:0"], "a grid k is in 1..64"),
        (["--grid", "cloud:hybrid:4", "cloud:hybrid:4"], "lists a configuration twice"),
        (["--grid", "cloud:no-such-draft:4"], "no drafter of the grid is built"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "no prompts file"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    arguments: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "adaptive", *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet bench: "), err
    assert reason in err
    assert "\n" not in err


def test_the_grid_reads_as_configurations() -> None:
    grid = parse_grid(["distributed:hybrid:8", "cloud:hybrid+draft-l1:4"])
    assert grid == [
        Config("distributed:hybrid:8", "distributed", "hybrid", 8),
        Config("cloud:hybrid+draft-l1:4", "cloud", "hybrid+draft-l1", 4),
    ]
    prompt = BenchPrompt("p", "chat", "hi")
    assert grid[1].request(prompt, 16)["mode"] == "cloud"
    adaptive = Config(ADAPTIVE).request(prompt, 16)
    assert adaptive["k"] == 0 and "mode" not in adaptive  # the coordinator chooses


def test_every_phase_gets_prompts_of_its_own() -> None:
    prompts = [BenchPrompt(f"{task}-{i}", task, "x") for task in ("a", "b") for i in range(8)]
    phases = phase_prompts(prompts, len(PHASES), 3)
    ids = [p.id for phase in phases for p in phase]
    assert len(ids) == len(set(ids)) == 3 * len(PHASES)
    assert {p.task for p in phases[0]} == {"a", "b"}  # the task types taken in turn


@pytest.mark.slow
def test_quick_trace_measures_every_configuration_in_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "adaptive.json"
    assert main(["bench", "adaptive", "--quick", "--max-tokens", "12", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    configs = [ADAPTIVE, *document["settings"]["grid"]]
    assert [p["phase"] for p in document["phases"]] == list(PHASES)
    for phase in document["phases"]:
        assert set(phase["tokens_per_s"]) == set(configs)
        assert all(rate > 0 for rate in phase["tokens_per_s"].values())
        assert phase["best_fixed"] in document["settings"]["grid"]
        assert sum(phase["adaptive_round_modes"].values()) > 0
    assert set(document["totals"]) == set(configs)
    assert document["identity"]["differing"] == []  # greedy: every configuration says the same
    assert document["identity"]["checked"] == len(PHASES) * len(configs)
    assert {g["goal"].split(" ")[2] for g in document["goals"]} == {"best", "oracle"}
    # Each blip run says when its agent got through again (what `sim validate` replays): not
    # before the cut ended; the other phases' runs were never cut.
    blip_s = document["settings"]["blip_s"]
    for run in document["runs"]:
        back = run["link_back_s"]
        assert back is None if run["phase"] != "blip" else back >= blip_s
