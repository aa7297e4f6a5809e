"""Head training pieces: acceptance counting, vocabulary ranking, target features, torch export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference.feature_head import HeadWeights, step_reference
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer
from modelbuild.distill import TeacherRecord
from modelbuild.gguf_source import EMBED, GgufModel
from modelbuild.head_train import (
    MAX_K,
    FeatureSet,
    acceptance,
    answer_features,
    chain_starts,
    collect_features,
    coverage,
    rank_vocabulary,
    read_features,
)

VOCAB_IDS = np.arange(100, 120, dtype=np.int64)
NEAR_TIE = 0.1  # fp16 features move logits of magnitude ~40 by up to ~0.03 (measured)


def scripted_step(right_for: np.ndarray, windows: np.ndarray):  # type: ignore[no-untyped-def]
    """A step whose i-th draft from start s is right while i < right_for[s]; features carry
    (start, i) so the step knows where it is."""

    def step(features: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start, i = features[:, 0].astype(int), features[:, 1].astype(int)
        truth = windows[start, i + 1]
        wrong = VOCAB_IDS[(np.searchsorted(VOCAB_IDS, truth) + 1) % len(VOCAB_IDS)]
        drafted = np.where(i < right_for[start], truth, wrong)
        logits = (VOCAB_IDS[None, :] == drafted[:, None]).astype(np.float32)
        return np.stack([start, i + 1], axis=1).astype(np.float32), logits

    return step


@pytest.mark.parametrize(
    ("right_for", "per_position", "tokens_per_pass"),
    [
        ([0, 0], [0.0] * MAX_K, [1.0] * MAX_K),
        ([MAX_K, MAX_K], [1.0] * MAX_K, [1.0 + k for k in range(1, MAX_K + 1)]),
        ([2, 0], [0.5, 1.0, 0.0] + [0.0] * (MAX_K - 3), [1.5] + [2.0] * (MAX_K - 1)),
        ([3, 1], [1.0, 0.5, 1.0, 0.0] + [0.0] * (MAX_K - 4), [2.0, 2.5, 3.0] + [3.0] * 5),
    ],
)
def test_acceptance_counts_chained_drafts(
    right_for: list[int], per_position: list[float], tokens_per_pass: list[float]
) -> None:
    rng = np.random.default_rng(0)
    windows = rng.choice(VOCAB_IDS, size=(len(right_for), MAX_K + 1))
    starts = np.stack([np.arange(len(right_for)), np.zeros(len(right_for))], 1).astype(np.float32)
    step = scripted_step(np.asarray(right_for), windows)
    result = acceptance(step, VOCAB_IDS, starts, windows)
    assert result.starts == len(right_for)
    assert result.per_position == pytest.approx(per_position)
    assert result.tokens_per_pass == pytest.approx(tokens_per_pass)


def test_chain_starts_need_a_whole_window() -> None:
    features = [np.full((n + 1, 4), n, np.float16) for n in (MAX_K - 1, MAX_K, MAX_K + 3)]
    tokens = [np.arange(n + 1) for n in (MAX_K - 1, MAX_K, MAX_K + 3)]
    labels = [t[1:] for t in tokens]
    starts_f, windows = chain_starts(FeatureSet([0, 1, 2], features, tokens, labels), None)
    assert len(windows) == 0 + 1 + 4
    assert windows.shape == (5, MAX_K + 1)
    assert np.array_equal(windows[0], np.arange(MAX_K + 1))
    assert starts_f.shape == (5, 4) and starts_f.dtype == np.float32


def record(index: int, answer: list[int], prompt: list[int] | None = None) -> TeacherRecord:
    return TeacherRecord(index, "qa", prompt or [1, 5, 9], answer, [], [])


def test_vocabulary_is_ranked_by_frequency_with_eos_first() -> None:
    records = [record(0, [7, 7, 7, 3, 3, 2]), record(1, [3, 9, 7, 2])]
    ranked = rank_vocabulary(records, vocab_size=12, eos_id=2)
    assert ranked[:4] == [2, 7, 3, 9]
    assert sorted(ranked) == list(range(12))
    assert coverage(records, ranked[:2]) == pytest.approx(6 / 10)
    assert coverage(records, ranked[:4]) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def greedy_records(
    target: tuple[OnnxRuntime, ChatTokenizer],
) -> list[TeacherRecord]:
    """Three short greedy answers of the real target, each token from a whole prefill (the pass
    the features come from, so that near-ties fall the same way)."""
    runtime, tokenizer = target
    records = []
    for index, text in enumerate(["Name a colour.", "What is 2 + 2?", "Say hello."]):
        prompt = tokenizer.apply_chat_template(text)
        answer: list[int] = []
        while len(answer) < 12 and tokenizer.eos_id not in answer:
            logits = runtime.forward(prompt + answer, runtime.new_cache())
            answer.append(int(logits[-1].argmax()))
        records.append(record(index, answer, prompt))
    return records


def test_features_predict_the_targets_own_tokens(
    target: tuple[OnnxRuntime, ChatTokenizer], greedy_records: list[TeacherRecord]
) -> None:
    runtime, _ = target
    embed = GgufModel().weights(0)[EMBED]
    for teacher in greedy_records:
        features, tokens, labels = answer_features(runtime, teacher)
        n = len(teacher.answer_ids)
        assert features.shape == (n + 1, runtime.config.d_model) and features.dtype == np.float16
        assert tokens.tolist() == [teacher.prompt_ids[-1], *teacher.answer_ids]
        # Row r is h_{n-1} beside x_n: its logits chose x_n, the token beside it.
        logits = features[1:].astype(np.float32) @ embed.T
        missed = logits.argmax(-1) != np.asarray(teacher.answer_ids)
        # fp16 features and another pass shape may only tip near-ties (gap of the two best).
        best_two = np.sort(logits[missed], axis=-1)[:, -2:]
        assert missed.mean() <= 0.25
        assert np.all(best_two[:, 1] - best_two[:, 0] < NEAR_TIE)
        # The labels are the target's choices in the same pass, here its own answer.
        assert labels.shape == (n,)
        assert (labels != np.asarray(teacher.answer_ids)).sum() <= missed.sum()


def test_features_are_cached_and_resumed(
    target: tuple[OnnxRuntime, ChatTokenizer],
    greedy_records: list[TeacherRecord],
    tmp_path: Path,
) -> None:
    runtime, _ = target
    first = collect_features(runtime, greedy_records[:2], tmp_path)
    assert first.indices == [0, 1] and len(list(tmp_path.glob("shard-*.npz"))) == 1
    both = collect_features(runtime, greedy_records, tmp_path)
    assert both.indices == [0, 1, 2] and len(list(tmp_path.glob("shard-*.npz"))) == 2
    again = read_features(tmp_path)
    for a, b in zip(both.features, again.features, strict=True):
        assert np.array_equal(a, b)
    assert collect_features(runtime, greedy_records[1:2], tmp_path).indices == [1]


def small_torch_head(rng: np.random.Generator, seed: int, moved: bool):  # type: ignore[no-untyped-def]
    """(model, config, embed, ids) of a small torch head; `moved`: away from its start."""
    torch = pytest.importorskip("torch")
    from inference.feature_head import HeadConfig
    from modelbuild.head_torch import HeadModel

    config = HeadConfig("eagle-test", hidden_size=32, intermediate_size=48, vocab_size=90)
    embed = (0.1 * rng.standard_normal((90, 32))).astype(np.float32)
    ids = np.arange(10, 50, dtype=np.int64)
    model = HeadModel(config, embed, embed[ids], np.ones(32, np.float32), seed=seed)
    if moved:  # move away from the identity start
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
    return model, config, embed, ids


def test_torch_head_exports_the_step_it_trained() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    model, config, embed, ids = small_torch_head(rng, seed=1, moved=True)
    features = rng.standard_normal((2, 5, 32)).astype(np.float32)
    tokens = rng.integers(0, 90, size=(2, 5))
    with torch.no_grad():
        unrolled = model.unroll(torch.from_numpy(features), torch.from_numpy(tokens), 3)
    weights = HeadWeights(config, model.trained_tensors(), ids)
    weights.validate()
    expected, _ = step_reference(weights, embed, features[:, 0], tokens[:, 0])
    np.testing.assert_allclose(unrolled[0][:, 0].numpy(), expected, atol=1e-5)
    # Step 2 at position 2 reads step 1's prediction at position 1.
    chained, logits = step_reference(weights, embed, unrolled[0][:, 1].numpy(), tokens[:, 2])
    np.testing.assert_allclose(unrolled[1][:, 2].numpy(), chained, atol=1e-5)
    np.testing.assert_allclose(model.logits(unrolled[1][:, 2]).detach().numpy(), logits, atol=1e-4)


def test_a_head_starts_from_trained_tensors_and_refuses_a_misfit() -> None:
    """`train-head --init-from`: a new torch head takes a trained head's tensors as they are
    (the step it computes is theirs), and tensors of another shape are refused by name."""
    torch = pytest.importorskip("torch")
    from modelbuild.head_torch import HeadModel

    rng = np.random.default_rng(5)
    trained, config, embed, ids = small_torch_head(rng, seed=1, moved=True)
    tensors = trained.trained_tensors()
    fresh = HeadModel(config, embed, embed[ids], np.ones(32, np.float32), seed=2)
    assert not np.allclose(fresh.trained_tensors()["gate.weight"], tensors["gate.weight"])
    fresh.load_tensors(tensors)
    for name, tensor in fresh.trained_tensors().items():
        np.testing.assert_array_equal(tensor, tensors[name])
    features = torch.from_numpy(rng.standard_normal((3, 32)).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, 90, size=3))
    with torch.no_grad():
        np.testing.assert_array_equal(
            fresh.step(features, tokens).numpy(), trained.step(features, tokens).numpy()
        )
    wider = dict(tensors, **{"gate.weight": np.zeros((64, 32), np.float32)})
    with pytest.raises(ValueError, match=r"gate\.weight is \(64, 32\)"):
        fresh.load_tensors(wider)
    with pytest.raises(ValueError, match="not a head's"):
        fresh.load_tensors({k: v for k, v in tensors.items() if k != "fc.weight"})


@pytest.mark.parametrize(
    ("size", "weights", "reason"),
    [
        ("small", "missing", "not a head's weights"),
        ("tiny", "shipped", "is a head of width 1536 over 8192 tokens; eagle-t1 is 768 over 4096"),
    ],
)
def test_train_head_refuses_a_head_it_cannot_go_on_from(
    size: str, weights: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from modelbuild.head_build import SHIPPED_HEADS
    from specfleet.cli import main

    path = SHIPPED_HEADS / "eagle-h1" / "weights.npz" if weights == "shipped" else tmp_path / "x"
    argv = ["models", "train-head", "--size", size, "--init-from", str(path),
            "--weights-dir", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reason in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
