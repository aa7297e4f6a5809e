"""specfleet bench co-runner: a short real run writes its table and JSON; a load never outlives
the benchmark; bad input is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import cpus
from bench.co_runner import LOADS
from inference.artifacts import default_models_dir
from modelbuild.target_build import DEFAULT_PRECISION, ensure_target
from specfleet.cli import main
from tests.processes import alive

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models_dir() -> Path:
    directory = default_models_dir()
    ensure_target(directory, DEFAULT_PRECISION)
    return directory


@pytest.mark.skipif(len(cpus.available()) < 2, reason="needs two CPUs")
def test_a_short_run_times_the_passes_alone_and_beside_each_load(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "co-runner.json"
    argv = ["bench", "co-runner", "--rows", "2", "--passes", "2", "--turns", "1", "--loads",
            "alu,memory", "--models-dir", str(models_dir), "--json", str(out)]  # fmt: skip
    cpus_before = cpus.available()
    assert main(argv) == 0
    assert cpus.available() == cpus_before  # the caller's CPUs given back
    assert "/ alone, median" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert (document["rows"], document["passes"], document["turns"]) == (2, 2, 1)
    assert document["target_cpu"] != document["load_cpu"]
    results = {r["load"]: r for r in document["results"]}
    assert list(results) == ["none", "alu", "memory"]
    assert results["none"]["ratio"] == [1.0]
    for result in results.values():
        (ms,) = result["pass_ms"]
        assert ms > 0
        assert result["ratio"] == [pytest.approx(ms / results["none"]["pass_ms"][0])]


@pytest.mark.parametrize("name", sorted(LOADS))
def test_a_load_spins_while_its_parent_lives_and_ends_with_it(name: str) -> None:
    """A parent that starts the load and then dies (as a benchmark killed outright would):
    the load ends with it."""
    program = (
        "import sys, time\n"
        "from bench.co_runner import start_load\n"
        "load = start_load(sys.argv[1], 0)\n"
        "print(load.pid, flush=True)\n"
        "time.sleep(1.0)\n"
        "print(load.poll(), flush=True)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", program, name], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "None"  # still spinning after a second
    parent.wait(10)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"the {name} load outlived its parent"


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--loads", "disk"], "--loads must name some of alu, objects, memory"),
        (["--loads", ","], "--loads must name some of"),
        (["--passes", "1"], "--passes at least 2"),
        (["--rows", "0"], "--rows must be at least 1"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    models_dir: Path, args: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "co-runner", "--models-dir", str(models_dir), *args]) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1
