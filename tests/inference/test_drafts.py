"""Distilled drafts: ONNX and TFLite builds agree, LiteRT caches roll back, manifests are honest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inference.artifacts import default_models_dir, sha256_file
from inference.drafts import DraftInfo, list_drafts, load_draft
from inference.litert_runtime import LiteRtKVCache
from inference.proposers import head_token_ids
from inference.runtime import Runtime
from inference.tokenizer import ChatTokenizer
from modelbuild.distill import SHARED_PROMPTS, SHIPPED_DRAFTS, ensure_drafts

DRAFT_STEPS = 16
# The TFLite build stores matrices through the converter's float16 mode and the ONNX build folds
# the same fp16 values to fp32; the two still differ by up to ~0.02 in logits of magnitude ~50
# (measured), so greedy tokens may part only where the two best logits are about that close.
NEAR_TIE = 0.05

SHIPPED = sorted(path.parent.name for path in SHIPPED_DRAFTS.glob("*/weights.npz"))


@pytest.fixture(scope="module")
def models_dir(target_dir: Path) -> Path:
    """The default models directory with the shipped drafts built into it (once)."""
    directory = default_models_dir()
    ensure_drafts(directory, target_dir)
    return directory


@pytest.fixture(scope="module")
def shared_prompts(chat_tokenizer: ChatTokenizer) -> list[list[int]]:
    lines = SHARED_PROMPTS.read_text().splitlines()
    return [
        chat_tokenizer.apply_chat_template(json.loads(line)["prompt"]) for line in lines if line
    ]


def greedy_draft(
    runtime: Runtime, prompt_ids: list[int], steps: int
) -> tuple[list[int], list[float]]:
    """Draft `steps` tokens greedily; also the gap between the two best logits at each step."""
    ids = head_token_ids(runtime)
    cache = runtime.new_cache()
    logits = runtime.forward(prompt_ids, cache)[-1]
    tokens, gaps = [], []
    for _ in range(steps):
        best_two = np.sort(logits)[-2:]
        gaps.append(float(best_two[1] - best_two[0]))
        column = int(logits.argmax())
        token = int(ids[column]) if ids is not None else column
        tokens.append(token)
        logits = runtime.forward([token], cache)[-1]
    return tokens, gaps


def test_shipped_drafts_exist() -> None:
    assert len(SHIPPED) >= 2, "models/drafts should hold at least two trained drafts"


@pytest.mark.parametrize("name", SHIPPED)
def test_onnx_and_tflite_draft_the_same_tokens(
    models_dir: Path, shared_prompts: list[list[int]], name: str
) -> None:
    onnx_draft = load_draft(models_dir, name, "onnx", threads=1)
    tflite_draft = load_draft(models_dir, name, "tflite", threads=1)
    onnx_ids, tflite_ids = head_token_ids(onnx_draft), head_token_ids(tflite_draft)
    assert onnx_ids is not None and tflite_ids is not None
    assert np.array_equal(onnx_ids, tflite_ids)
    identical = 0
    for prompt_ids in shared_prompts:
        onnx_tokens, gaps = greedy_draft(onnx_draft, prompt_ids, DRAFT_STEPS)
        tflite_tokens, _ = greedy_draft(tflite_draft, prompt_ids, DRAFT_STEPS)
        if onnx_tokens == tflite_tokens:
            identical += 1
            continue
        first = next(
            i for i, (a, b) in enumerate(zip(onnx_tokens, tflite_tokens, strict=True)) if a != b
        )
        assert gaps[first] < NEAR_TIE, f"parted at step {first} with a logit gap {gaps[first]}"
    assert identical >= 0.9 * len(shared_prompts)


@pytest.mark.parametrize("name", SHIPPED)
def test_litert_cache_trims_to_any_length(
    models_dir: Path, shared_prompts: list[list[int]], name: str
) -> None:
    draft = load_draft(models_dir, name, "tflite", threads=1)
    prompt = shared_prompts[0]
    cache = draft.new_cache()
    assert isinstance(cache, LiteRtKVCache)
    full = draft.forward(prompt, cache)
    assert cache.length == len(prompt)
    for length in (len(prompt) - 1, len(prompt) // 2, 1):
        cache.trim(length)
        assert cache.length == length
        # Re-feeding the cut tail from the trimmed cache gives the logits of the full pass.
        again = draft.forward(prompt[length:], cache)
        assert cache.length == len(prompt)
        np.testing.assert_allclose(again, full[length:], atol=2e-3, rtol=0)
    cache.trim(0)
    np.testing.assert_allclose(draft.forward(prompt, cache), full, atol=2e-3, rtol=0)
    with pytest.raises(ValueError):
        cache.trim(cache.length + 1)


def test_trim_then_draft_matches_a_fresh_draft(
    models_dir: Path, shared_prompts: list[list[int]]
) -> None:
    """A rejected speculation rolled back leaves the cache as if it had never been drafted."""
    draft = load_draft(models_dir, SHIPPED[0], "tflite", threads=1)
    prompt = shared_prompts[1]
    cache = draft.new_cache()
    draft.forward(prompt, cache)
    draft.forward([11, 12, 13, 14], cache)  # a speculation the target refuses
    cache.trim(len(prompt))
    after_rollback = draft.forward([42], cache)
    fresh = draft.new_cache()
    draft.forward(prompt, fresh)
    np.testing.assert_allclose(after_rollback, draft.forward([42], fresh), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", SHIPPED)
def test_manifests_match_their_files(models_dir: Path, name: str) -> None:
    drafts: list[DraftInfo] = [d for d in list_drafts(models_dir) if d.name == name]
    assert sorted(d.format for d in drafts) == ["onnx", "tflite"]
    for draft in drafts:
        m = draft.manifest
        assert m.role == "draft"
        assert sha256_file(draft.model_path) == m.sha256
        assert draft.model_path.stat().st_size == m.size_bytes
        assert sha256_file(draft.directory / m.tokenizer_file) == m.tokenizer_sha256
        output_ids = json.loads((draft.directory / m.extra["output_ids_file"]).read_text())
        assert len(output_ids) == m.extra["head_size"] == len(set(output_ids))
        assert m.extra["weights_sha256"] == sha256_file(SHIPPED_DRAFTS / name / "weights.npz")
