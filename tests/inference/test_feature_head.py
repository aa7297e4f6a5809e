"""Feature heads: weights round trip, ONNX and TFLite agree, heads for other targets refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference.artifacts import default_models_dir, load_manifest
from inference.drafts import list_drafts
from inference.feature_head import (
    HEAD_KIND,
    FeatureHead,
    FeatureHeadError,
    HeadWeights,
    find_head,
    list_heads,
    load_head_weights,
    random_head_weights,
    save_head_weights,
    step_reference,
)
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer
from modelbuild.head_build import SHIPPED_HEADS, build_head, ensure_heads

HIDDEN = 64
VOCAB = 700
VOCAB_IDS = np.arange(3, VOCAB, 3)  # V' = 233 of 700 ids
STARTS = 48  # (feature, token) pairs each chain starts from
CHAIN = 8


@pytest.fixture(scope="module")
def weights() -> HeadWeights:
    return random_head_weights(HIDDEN, VOCAB_IDS, seed=7, vocab_size=VOCAB, name="eagle-test")


@pytest.fixture(scope="module")
def built(weights: HeadWeights, target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    models_dir = tmp_path_factory.mktemp("heads")
    build_head(models_dir, weights, target_dir)
    return models_dir


def starts(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((count, HIDDEN)).astype(np.float32)
    return features, rng.integers(0, VOCAB, size=count)


def test_weights_round_trip_through_fp16(weights: HeadWeights, tmp_path: Path) -> None:
    save_head_weights(tmp_path / "weights.npz", weights)
    loaded = load_head_weights(tmp_path / "weights.npz")
    assert loaded.config == weights.config
    assert np.array_equal(loaded.vocab_ids, weights.vocab_ids)
    assert loaded.record == weights.record
    assert loaded.embed is not None and weights.embed is not None
    assert np.array_equal(loaded.embed, weights.embed)
    for name, tensor in weights.tensors.items():
        assert np.array_equal(loaded.tensors[name], tensor), name


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        ("drop_tensor", "tensors"),
        ("bad_shape", "gate.weight"),
        ("repeat_id", "distinct"),
        ("id_past_vocab", "outside the vocabulary"),
    ],
)
def test_inconsistent_weights_are_refused(
    weights: HeadWeights, tmp_path: Path, breakage: str, reason: str
) -> None:
    tensors = dict(weights.tensors)
    ids = weights.vocab_ids.copy()
    if breakage == "drop_tensor":
        del tensors["fc.weight"]
    elif breakage == "bad_shape":
        tensors["gate.weight"] = tensors["gate.weight"][:-1]
    elif breakage == "repeat_id":
        ids[1] = ids[0]
    else:
        ids[-1] = VOCAB
    broken = HeadWeights(weights.config, tensors, ids, weights.record, weights.embed)
    with pytest.raises(FeatureHeadError, match=reason):
        save_head_weights(tmp_path / "weights.npz", broken)


def test_built_heads_are_listed_as_heads_not_drafts(built: Path, target_dir: Path) -> None:
    heads = list_heads(built)
    assert [(h.name, h.format) for h in heads] == [("eagle-test", "onnx"), ("eagle-test", "tflite")]
    assert list_drafts(built) == []
    for head in heads:
        manifest = load_manifest(head.directory)
        assert manifest.kind == HEAD_KIND
        assert manifest.source_sha256 == load_manifest(target_dir).sha256
        assert manifest.extra["head_size"] == len(VOCAB_IDS)
    assert find_head(built, "eagle-test-tflite", "tflite").format == "tflite"
    with pytest.raises(FeatureHeadError, match="no onnx feature head 'eagle-x'"):
        find_head(built, "eagle-x")


def test_onnx_step_follows_the_reference(weights: HeadWeights, built: Path) -> None:
    head = FeatureHead.load(find_head(built, "eagle-test").directory, threads=1)
    features, tokens = starts(16)
    assert weights.embed is not None
    expected_features, expected_logits = step_reference(weights, weights.embed, features, tokens)
    next_features, logits = head.step(features, tokens)
    assert next_features.shape == (16, HIDDEN) and logits.shape == (16, len(VOCAB_IDS))
    np.testing.assert_allclose(next_features, expected_features, atol=1e-4)
    np.testing.assert_allclose(logits, expected_logits, atol=1e-3)
    assert np.array_equal(head.vocab_ids, VOCAB_IDS)


def test_onnx_and_tflite_draft_identical_greedy_chains(built: Path) -> None:
    onnx_head = FeatureHead.load(find_head(built, "eagle-test", "onnx").directory, threads=1)
    tflite_head = FeatureHead.load(find_head(built, "eagle-test", "tflite").directory, threads=1)
    features, tokens = starts(STARTS, seed=1)
    chains = [
        (
            onnx_head.draft(feature, int(token), CHAIN),
            tflite_head.draft(feature, int(token), CHAIN),
        )
        for feature, token in zip(features, tokens, strict=True)
    ]
    assert all(len(a) == CHAIN and set(a) <= set(VOCAB_IDS.tolist()) for a, _ in chains)
    assert [a for a, _ in chains] == [b for _, b in chains]
    # A batch step agrees with one row at a time.
    _, batch_logits = tflite_head.step(features, tokens)
    _, row_logits = tflite_head.step(features[:1], tokens[:1])
    assert batch_logits[0].argmax() == row_logits[0].argmax()


def test_a_head_for_another_target_is_refused(built: Path, target_dir: Path) -> None:
    directory = find_head(built, "eagle-test").directory
    own = load_manifest(target_dir).sha256
    assert FeatureHead.load(directory, target_sha256=own).target_sha256 == own
    other = "0" * 64
    with pytest.raises(FeatureHeadError, match="trained on the features of target"):
        FeatureHead.load(directory, target_sha256=other)


def test_a_decoder_is_not_loaded_as_a_head(target_dir: Path) -> None:
    with pytest.raises(FeatureHeadError, match="not a feature-head"):
        FeatureHead.load(target_dir)


@pytest.mark.parametrize(
    ("features", "tokens", "reason"),
    [
        (np.zeros((2, HIDDEN + 1), np.float32), [1, 2], "features must be"),
        (np.zeros((2, HIDDEN), np.float32), [1], "tokens must be"),
        (np.zeros((1, HIDDEN), np.float32), [VOCAB], "token ids must lie"),
        (np.zeros((1, HIDDEN), np.float32), [-1], "token ids must lie"),
    ],
)
def test_bad_step_input_is_refused(
    built: Path, features: np.ndarray, tokens: list[int], reason: str
) -> None:
    head = FeatureHead.load(find_head(built, "eagle-test").directory)
    with pytest.raises(ValueError, match=reason):
        head.step(features, tokens)


SHIPPED = sorted(path.parent.name for path in SHIPPED_HEADS.glob("*/weights.npz"))
# The TFLite build's fp16 matrices and the ONNX build's folded ones differ in the last bits
# (as the drafts' do): greedy drafts may part only where the two best logits are this close.
NEAR_TIE = 0.05


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_head_drafts_alike_on_onnx_and_tflite(
    name: str, target_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    models_dir = default_models_dir()
    assert name in ensure_heads(models_dir, target_dir)
    record = load_head_weights(SHIPPED_HEADS / name / "weights.npz").record
    assert record["valid"]["starts"] > 0 and record["curve"], "the record says how it trained"
    target_sha = load_manifest(target_dir).sha256
    onnx_head = FeatureHead.load(find_head(models_dir, name, "onnx").directory, threads=1)
    tflite_head = FeatureHead.load(
        find_head(models_dir, name, "tflite").directory, threads=1, target_sha256=target_sha
    )
    runtime, tokenizer = target
    prompt = tokenizer.apply_chat_template("Write two sentences about rivers.")
    ((logits, hidden),) = runtime.forward_batch_hidden([(prompt, runtime.new_cache())])
    # Start from every prompt position (h_{j-1}, x_j), as verdicts would hand them over.
    features, tokens = hidden[:-1], np.asarray(prompt[1:])
    parted = 0
    for feature, token in zip(features, tokens, strict=True):
        onnx_chain = onnx_head.draft(feature, int(token), CHAIN)
        tflite_chain = tflite_head.draft(feature, int(token), CHAIN)
        if onnx_chain != tflite_chain:
            parted += 1
            first = next(
                i for i, (a, b) in enumerate(zip(onnx_chain, tflite_chain, strict=True)) if a != b
            )
            chained = feature.reshape(1, -1)
            for drafted in [int(token), *onnx_chain[:first]]:
                chained, step_logits = onnx_head.step(chained, [drafted])
            best_two = np.sort(step_logits[0])[-2:]
            assert best_two[1] - best_two[0] < NEAR_TIE
    assert parted <= len(tokens) // 10
    assert logits.shape[0] == len(prompt)
