"""Recorded target answers, and a fake target that replays them: the model-free half of
`specfleet bench fleet`.

`bench/prompts/fleet-answers.jsonl` holds 64 of the target's greedy answers (SmolLM2-135M-
Instruct, chat-templated prompts from the `specfleet models distill` teacher pass, none of them a
benchmark prompt): `prompt_ids` and `answer_ids`, the answer ending in EOS unless it was cut at
200 tokens. Nothing here knows a model; it answers only the sequences it holds.

A LOAD TOOL ONLY: `ReplayTarget` says what the target said when it was recorded. It is never
a stand-in for the target where output or correctness is tested.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ANSWERS = Path(__file__).resolve().parent / "prompts" / "fleet-answers.jsonl"
EOS_ID = 2  # SmolLM2's <|im_end|>, the recorded answers' last token
VOCAB_SIZE = 49_152


class RecordingError(ValueError):
    """A recording that cannot be read, or a sequence that is not in it."""


@dataclass(frozen=True)
class RecordedAnswer:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # the target's greedy continuation

    @property
    def sequence(self) -> tuple[int, ...]:
        return self.prompt_ids + self.answer_ids


def load_answers(path: Path = DEFAULT_ANSWERS) -> list[RecordedAnswer]:
    answers = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise RecordingError(f"{path}: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = tuple(int(t) for t in record["prompt_ids"])
            answer = tuple(int(t) for t in record["answer_ids"])
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordingError(f"{path} line {number}: {exc}") from exc
        if not prompt or len(answer) < 2:
            raise RecordingError(f"{path} line {number}: needs a prompt and 2+ answer tokens")
        if max(prompt + answer) >= VOCAB_SIZE or min(prompt + answer) < 0:
            raise RecordingError(f"{path} line {number}: a token id outside the vocabulary")
        answers.append(RecordedAnswer(prompt, answer))
    if not answers:
        raise RecordingError(f"{path} holds no answers")
    return answers


@dataclass(frozen=True)
class ReplayedRound:
    n_accepted: int
    next_token: int


class ReplayTarget:
    """Greedy verification against the recording: the draft's longest prefix that matches the
    recorded answer, then the recorded token after it."""

    def __init__(self, answers: Sequence[RecordedAnswer]) -> None:
        self._by_prompt = {a.prompt_ids: a for a in answers}
        self._prompt_lengths = sorted({len(a.prompt_ids) for a in answers})

    def find(self, context_ids: Sequence[int]) -> RecordedAnswer:
        """The recording whose prompt begins `context_ids` and whose answer the rest follows."""
        context = tuple(context_ids)
        for length in self._prompt_lengths:
            answer = self._by_prompt.get(context[:length])
            if answer is not None and answer.sequence[: len(context)] == context:
                return answer
        raise RecordingError(f"no recorded answer continues this context ({len(context)} ids)")

    def verify(self, context_ids: Sequence[int], draft: Sequence[int]) -> ReplayedRound:
        answer = self.find(context_ids)
        position = len(context_ids) - len(answer.prompt_ids)  # answer tokens committed so far
        left = len(answer.answer_ids) - position
        if left <= 0:
            raise RecordingError("the recorded answer is already complete")
        n_accepted = 0
        # One token must remain for next_token: a draft never runs past the recording.
        while (
            n_accepted < len(draft)
            and n_accepted < left - 1
            and draft[n_accepted] == answer.answer_ids[position + n_accepted]
        ):
            n_accepted += 1
        return ReplayedRound(n_accepted, answer.answer_ids[position + n_accepted])


def draft_along(
    answer: RecordedAnswer, generated: int, k: int, alpha: float, rng: random.Random
) -> tuple[int, ...]:
    """k draft tokens after `generated` answer tokens: each the recorded one with probability
    `alpha`, the first miss a wrong token (what follows a miss cannot be accepted anyway)."""
    left = len(answer.answer_ids) - generated - 1
    tokens = []
    for i in range(max(0, min(k, left))):
        truth = answer.answer_ids[generated + i]
        if rng.random() >= alpha:
            tokens.append((truth + 1) % VOCAB_SIZE)
            break
        tokens.append(truth)
    return tuple(tokens)
