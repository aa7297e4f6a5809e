"""`specfleet completion bash` and `specfleet-agent completion bash`: the scripts, run by a real
bash as the shell would, complete sub-commands, flags and the choices of a flag's value."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = {"specfleet": "specfleet", "specfleet-agent": "device_agent.cli"}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    found = {}
    for program, module in MODULES.items():
        done = subprocess.run(
            [sys.executable, "-m", module, "completion", "bash"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        path = tmp_path_factory.mktemp("completion") / program
        path.write_text(done.stdout)
        found[program] = path
    return found


def complete(script: Path, line: str) -> list[str]:
    """What bash offers for `line` (a trailing space means: a new, empty word)."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    program = words[0]
    function = "_" + program.replace("-", "_") + "_complete"
    shell = (
        f"source {shlex.quote(str(script))}\n"
        f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
        f"COMP_CWORD={len(words) - 1}\n"
        f"{function}\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile"], input=shell, capture_output=True, text=True,
        timeout=30, check=True,
    )  # fmt: skip
    return [w for w in done.stdout.splitlines() if w]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("specfleet de", ["demo", "devices"]),
        ("specfleet devices ", ["add", "list", "retire", "rotate-credential", "provision"]),
        ("specfleet devices provision pi-1 --ro", ["--rotate"]),
        ("specfleet --log-format ", ["text", "json"]),
        ("specfleet up --local-broker ", ["auto", "mosquitto", "amqtt"]),
        ("specfleet models deploy --wa", ["--wave"]),
        ("specfleet bench ", ["bus", "models", "replay", "e2e", "adaptive", "soak", "fleet"]),
        ("specfleet-agent ", ["run", "ask", "completion"]),
        ("specfleet-agent run --draft-runtime ", ["onnx", "tflite"]),
    ],
)
def test_bash_completes(scripts: dict[str, Path], line: str, expected: list[str]) -> None:
    offered = complete(scripts[line.split()[0]], line)
    assert set(expected) <= set(offered), offered
    if line.endswith(" --log-format ") or line.endswith("-runtime "):
        assert offered == expected  # a flag's choices, nothing else


def test_a_value_that_is_a_path_completes_file_names(
    scripts: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "prompts.jsonl").write_text("")
    line = f"specfleet demo --prompts {tmp_path}/pro"
    assert complete(scripts["specfleet"], line) == [f"{tmp_path}/prompts.jsonl"]
