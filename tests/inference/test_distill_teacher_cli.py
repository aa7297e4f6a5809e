"""`specfleet models distill --teacher-only` shows its progress in tokens as they are decoded,
says what it wrote once, and stops taking prompts at its budget (an answer under way finishes: it
is never cut). The real target answers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from inference.artifacts import default_models_dir
from modelbuild.distill import read_teacher, teacher_tokens

TARGET = "smollm2-135m-instruct-fp32"
BUDGET = 40


def test_teacher_only_shows_a_bar_in_tokens_and_reports_once(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / TARGET).symlink_to(default_models_dir() / TARGET)  # built once per machine
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", "models", "distill", "--teacher-only",
         "--teacher-tokens", str(BUDGET), "--models-dir", str(models), "--threads", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_teacher(models / "distill" / "teacher.jsonl")
    written = teacher_tokens(records)
    assert done.stdout.splitlines() == [
        f"teacher text in {models / 'distill' / 'teacher.jsonl'}: {len(records)} answers, "
        f"{written} tokens"
    ]
    # The first prompt is taken (nothing is under way); no second one once the first answer's
    # expected length alone reaches the budget.
    assert written >= BUDGET and len(records) <= 2, (written, len(records))
    # Every piece of stderr is a state of the bar, and the last one counts every token written.
    states = [part.strip() for part in re.split(r"[\r\n]", done.stderr) if part.strip()]
    assert states and all(state.startswith("teacher: ") for state in states), states
    assert f"{written}/{written} " in states[-1] and "100%" in states[-1], states[-1]
