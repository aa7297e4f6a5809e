"""The real target, loaded once per test process, and its greedy answers to the shared prompts."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from inference.onnx_runtime import OnnxRuntime
from inference.sampling import SamplingParams
from inference.speculative import decode_target
from inference.tokenizer import ChatTokenizer
from modelbuild.target_build import load_target

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    task: str
    prompt: str


@functools.cache
def shared_prompts() -> tuple[BenchPrompt, ...]:
    lines = SHARED_PROMPTS.read_text().splitlines()
    return tuple(BenchPrompt(**json.loads(line)) for line in lines if line.strip())


def one_prompt_per_task() -> list[BenchPrompt]:
    firsts: dict[str, BenchPrompt] = {}
    for prompt in shared_prompts():
        firsts.setdefault(prompt.task, prompt)
    return list(firsts.values())


@functools.cache
def target_pair() -> tuple[OnnxRuntime, ChatTokenizer]:
    """The target built in the default models directory (built on first use)."""
    return load_target()


@functools.cache
def prompt_ids(prompt_id: str) -> tuple[int, ...]:
    _, tokenizer = target_pair()
    text = next(p.prompt for p in shared_prompts() if p.id == prompt_id)
    return tuple(tokenizer.apply_chat_template(text))


@functools.cache
def greedy_reference(prompt_id: str, max_new_tokens: int) -> tuple[int, ...]:
    """The target's own greedy answer, computed once per prompt and length."""
    target, tokenizer = target_pair()
    result = decode_target(
        target, prompt_ids(prompt_id), max_new_tokens, GREEDY, eos=tokenizer.eos_id
    )
    return tuple(result.tokens)
