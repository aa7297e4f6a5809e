"""The shared prompt set (../shared/bench/prompts.jsonl: one {id, task, prompt} a line), read by
`specfleet demo` and by the benchmarks that replay it over a fleet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    task: str
    prompt: str


def read_prompts(path: Path) -> list[BenchPrompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            prompts.append(
                BenchPrompt(str(fields["id"]), str(fields["task"]), str(fields["prompt"]))
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a prompt record ({exc})") from exc
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
