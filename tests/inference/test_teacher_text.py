"""Teacher text: the target's greedy answers to generated prompts, never to a benchmark prompt,
and the n-gram table built from it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from synthetic_lm import SyntheticLM

from inference.proposers import NGramTable
from inference.sampling import SamplingParams
from inference.speculative import decode_target
from inference.tokenizer import ChatTokenizer
from modelbuild.distill import (
    TeacherRecord,
    generate_teacher,
    read_teacher,
    unseen_prompts,
    without_benchmark,
)
from modelbuild.teacher_prompts import BENCHMARK_PROMPT_FILES, benchmark_prompts, teacher_prompt
from specfleet.cli import main


def test_benchmark_prompts_hold_the_shared_and_the_tuning_prompts() -> None:
    texts = benchmark_prompts()
    for path in BENCHMARK_PROMPT_FILES:
        assert path.exists(), path
        for line in path.read_text().splitlines():
            assert json.loads(line)["prompt"] in texts


def test_the_teacher_stream_never_answers_a_benchmark_prompt(
    target: tuple[object, ChatTokenizer],
) -> None:
    _, tokenizer = target
    banned = benchmark_prompts()
    # The raw templates do make some benchmark prompts word for word (the first at index 486).
    raw = {teacher_prompt(i).prompt for i in range(3000)}
    assert raw & banned
    stream = unseen_prompts(tokenizer, 0, set(), stop=3000)
    answered = {tokenizer.decode(ids) for _, _, ids in stream}
    chat_templated = {tokenizer.decode(tokenizer.apply_chat_template(text)) for text in banned}
    assert answered and not answered & chat_templated


def test_teacher_answers_are_the_greedy_decoding_and_a_deadline_stops_new_prompts(
    tmp_path: Path,
) -> None:
    model = SyntheticLM.random(vocab_size=16, dim=8, seed=3, sharpness=0.6)
    eos = 6
    prompts = [(i, "chat", [1 + i % 5, 2, 3 + i % 7]) for i in range(9)]
    out = tmp_path / "teacher.jsonl"
    written = generate_teacher(
        model, eos, iter(prompts), out, token_budget=10_000, batch_size=4, max_new_tokens=12
    )
    records = sorted(read_teacher(out), key=lambda r: r.index)
    assert [r.index for r in records] == list(range(9))
    assert written == sum(len(r.answer_ids) for r in records)
    for record, (_, _, ids) in zip(records, prompts, strict=True):
        greedy = decode_target(model, ids, 12, SamplingParams(), eos).tokens
        assert record.prompt_ids == ids and record.answer_ids == greedy
        assert [top[0] for top in record.top_ids] == greedy

    late = tmp_path / "late.jsonl"
    assert generate_teacher(
        model, eos, iter(prompts), late, token_budget=10_000, deadline=time.monotonic() - 1
    ) == 0  # fmt: skip
    assert read_teacher(late) == []


def test_a_small_budget_is_not_overrun_by_a_whole_batch(tmp_path: Path) -> None:
    model = SyntheticLM.random(vocab_size=16, dim=8, seed=3, sharpness=0.6)
    prompts = [(i, "chat", [1 + i % 5, 2, 3 + i % 7]) for i in range(64)]
    out = tmp_path / "teacher.jsonl"
    budget, longest = 30, 12
    written = generate_teacher(
        model, 6, iter(prompts), out, token_budget=budget, batch_size=32, max_new_tokens=longest
    )
    # Prompts are taken while the answers in flight are expected to stay under the budget: the
    # budget is reached, and overrun by less than a few answers, not by a batch of 32.
    assert budget <= written < budget + 3 * longest
    assert len(read_teacher(out)) < 32


def _record(index: int, prompt_ids: list[int], answer_ids: list[int]) -> TeacherRecord:
    top = [[token, 0, 0, 0] for token in answer_ids]
    return TeacherRecord(index, "chat", prompt_ids, answer_ids, top, [[1.0, 0, 0, 0]] * len(top))


def test_without_benchmark_drops_answers_to_benchmark_prompts(
    target: tuple[object, ChatTokenizer],
) -> None:
    _, tokenizer = target
    benchmark = tokenizer.apply_chat_template(sorted(benchmark_prompts())[0])
    other = tokenizer.apply_chat_template("Name a colour that is not in the rainbow.")
    records = [_record(0, benchmark, [5, 6, 2]), _record(1, other, [7, 8, 2])]
    assert without_benchmark(records, tokenizer) == [records[1]]


def test_build_ngram_from_teacher_text_alone(
    tmp_path: Path, target: tuple[object, ChatTokenizer], capsys: pytest.CaptureFixture[str]
) -> None:
    _, tokenizer = target
    banned = tokenizer.apply_chat_template(sorted(benchmark_prompts())[0])
    kept = tokenizer.apply_chat_template("Tell me about lighthouses.")
    teacher = tmp_path / "teacher.jsonl"
    teacher.write_text(
        _record(0, kept, [101, 102, 103, 2]).to_json()
        + "\n"
        + _record(1, banned, [201, 202, 203, 2]).to_json()
        + "\n"
    )
    out = tmp_path / "table.ngram"
    status = main(["models", "build-ngram", "--prompts", "0", "--teacher", str(teacher),
                   "--out", str(out)])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    table = NGramTable.load(out)
    assert table.lookup([kept[-1], 101, 102], min_context=3) is not None
    assert table.lookup([banned[-1], 201, 202], min_context=1) is None  # the benchmark answer
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["prompts"] == 0 and info["answer_tokens"] == 0
    assert info["teacher_answers"] == 1 and info["teacher_tokens"] == 4
    assert info["contexts"] == len(table.entries)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["build-ngram", "--prompts", "0"], "--prompts 0 needs --teacher"),
        (["build-ngram", "--prompts", "-1"], "--prompts must be >= 0"),
        (["build-ngram", "--prompts", "0", "--teacher", "/no/such/teacher.jsonl"], "no teacher"),
        (["distill", "--teacher-only", "--export-only"], "exclude each other"),
        (["distill", "--teacher-only", "--teacher-minutes", "0"], "--teacher-minutes must be"),
    ],
)
def test_bad_teacher_arguments_exit_with_one_line(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", *argv]) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1


def test_a_malformed_teacher_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = tmp_path / "teacher.jsonl"
    teacher.write_text('{"index": 0, "task": "chat"}\n')
    argv = ["models", "build-ngram", "--prompts", "0", "--teacher", str(teacher),
            "--out", str(tmp_path / "t.ngram")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not a teacher file" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.ngram").exists()
