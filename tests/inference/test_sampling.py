"""The rejection sampler and the target distribution, on a small synthetic vocabulary."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from goodness_of_fit import chi_square, chi_square_critical, total_variation

from inference.sampling import (
    RngStream,
    SamplingParams,
    SparseDraftProbs,
    VerifyResult,
    draft_sparse_probs,
    one_hot_draft,
    rejection_sample,
    round_rng,
    target_probs,
)

V = 8
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)


def peaked_logits(argmaxes: list[int], vocab_size: int = V) -> np.ndarray:
    """Logits # [len(argmaxes), V] whose rows are near one-hot on the given tokens."""
    logits = np.full((len(argmaxes), vocab_size), -50.0, dtype=np.float32)
    logits[np.arange(len(argmaxes)), argmaxes] = 50.0
    return logits


@pytest.mark.parametrize(
    ("draft", "target_argmax", "expected"),
    [
        pytest.param([3, 1, 4], [3, 1, 4, 1], VerifyResult(3, 1), id="perfect match"),
        pytest.param([3, 2, 4], [3, 1, 4, 1], VerifyResult(1, 1), id="early mismatch"),
        pytest.param([5, 1, 4], [3, 1, 4, 1], VerifyResult(0, 3), id="first mismatch"),
        pytest.param([3, 1, 5], [3, 1, 4, 1], VerifyResult(2, 4), id="last mismatch"),
        pytest.param([], [6], VerifyResult(0, 6), id="empty draft"),
        pytest.param([2], [2, 7], VerifyResult(1, 7), id="single accepted"),
    ],
)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_verdict_table(
    draft: list[int],
    target_argmax: list[int],
    expected: VerifyResult,
    params: SamplingParams,
) -> None:
    # With near one-hot target rows the sampled verdict is as certain as the greedy one.
    q = None if params.greedy else one_hot_draft(draft)
    rng = round_rng(7, 0)
    assert rejection_sample(draft, q, peaked_logits(target_argmax), params, rng) == expected


def test_greedy_ignores_q() -> None:
    q = SparseDraftProbs(ids=np.array([[3, 0], [1, 0]]), probs=np.array([[0.5, 0.5], [0.9, 0.1]]))
    verdict = rejection_sample([3, 1], q, peaked_logits([3, 1, 2]), GREEDY, round_rng(0, 0))
    assert verdict == VerifyResult(2, 2)


def random_case(seed: int, k: int, top_k: int) -> tuple[np.ndarray, SparseDraftProbs, np.ndarray]:
    rng = np.random.default_rng(seed)
    draft_logits = rng.normal(size=(k, V))
    rows = [draft_sparse_probs(row, 1.0, top_k) for row in draft_logits]
    q = SparseDraftProbs(ids=np.stack([r[0] for r in rows]), probs=np.stack([r[1] for r in rows]))
    tokens = np.array([int(ids[0]) for ids, _ in rows])
    return tokens, q, rng.normal(size=(k + 1, V)).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deterministic_when_seeded(seed: int) -> None:
    tokens, q, logits = random_case(seed, k=4, top_k=3)
    verdicts = [rejection_sample(tokens, q, logits, SAMPLED, round_rng(seed, 5)) for _ in range(3)]
    assert verdicts[0] == verdicts[1] == verdicts[2]


def test_verdicts_vary_across_rounds() -> None:
    tokens, q, logits = random_case(3, k=4, top_k=3)
    verdicts = {rejection_sample(tokens, q, logits, SAMPLED, round_rng(3, r)) for r in range(50)}
    assert len(verdicts) > 3


@pytest.mark.parametrize(
    ("seed_a", "round_a", "stream_a", "seed_b", "round_b", "stream_b", "same"),
    [
        (1, 2, RngStream.VERIFY, 1, 2, RngStream.VERIFY, True),
        (1, 2, RngStream.VERIFY, 1, 2, RngStream.DRAFT, False),
        (1, 2, RngStream.VERIFY, 1, 3, RngStream.VERIFY, False),
        (1, 2, RngStream.VERIFY, 2, 2, RngStream.VERIFY, False),
        (2, 1, RngStream.VERIFY, 1, 2, RngStream.VERIFY, False),
    ],
)
def test_round_rng_depends_on_seed_round_and_stream(
    seed_a: int,
    round_a: int,
    stream_a: RngStream,
    seed_b: int,
    round_b: int,
    stream_b: RngStream,
    same: bool,
) -> None:
    a = round_rng(seed_a, round_a, stream_a).random(4)
    b = round_rng(seed_b, round_b, stream_b).random(4)
    assert np.array_equal(a, b) == same


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=0.0), [0.0, 0.0, 1.0, 0.0]),
        (SamplingParams(temperature=1.0), [0.1, 0.2, 0.4, 0.3]),
        (SamplingParams(temperature=1.0, top_k=2), [0.0, 0.0, 4 / 7, 3 / 7]),
        # Mass before 0.3 is 0.4 < 0.6, before 0.2 is 0.7: keep {0.4, 0.3}.
        (SamplingParams(temperature=1.0, top_p=0.6), [0.0, 0.0, 4 / 7, 3 / 7]),
        (SamplingParams(temperature=1.0, top_p=0.75), [0.0, 2 / 9, 4 / 9, 3 / 9]),
        (SamplingParams(temperature=1.0, top_p=0.01), [0.0, 0.0, 1.0, 0.0]),
    ],
)
def test_target_probs_table(params: SamplingParams, expected: list[float]) -> None:
    logits = np.log(np.array([[0.1, 0.2, 0.4, 0.3]], dtype=np.float32))
    assert np.allclose(target_probs(logits, params)[0], expected, atol=1e-6)


def test_temperature_sharpens() -> None:
    logits = np.log(np.array([[0.1, 0.2, 0.4, 0.3]]))
    cold = target_probs(logits, SamplingParams(temperature=0.5))[0]
    expected = np.array([0.01, 0.04, 0.16, 0.09]) / 0.30
    assert np.allclose(cold, expected)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"seed": -1}]
)
def test_bad_params_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_shape_mismatch_refused() -> None:
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        rejection_sample([1, 2], None, np.zeros((2, V), np.float32), SAMPLED, round_rng(0, 0))


def test_draft_sparse_probs_is_top_k_renormalised() -> None:
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.2]))
    ids, probs = draft_sparse_probs(logits, 1.0, 3)
    assert ids.tolist() == [1, 3, 4]
    assert np.allclose(probs, np.array([0.4, 0.25, 0.2]) / 0.85)
    greedy_ids, greedy_probs = draft_sparse_probs(logits, 0.0, 3)
    assert greedy_ids.tolist() == [1, 3, 4] and greedy_probs.tolist() == [1.0, 0.0, 0.0]


# p and the draft's full distribution over V = 8: deliberately unlike each other, and q' (top 4
# of q) gives no mass to tokens 0, 2, 4, 6, where p has some, so the residual path is exercised.
P = np.array([0.20, 0.05, 0.15, 0.10, 0.05, 0.25, 0.12, 0.08])
Q = np.array([0.02, 0.30, 0.03, 0.25, 0.05, 0.05, 0.10, 0.20])
TRIALS = 20_000


@pytest.mark.parametrize("draft_temperature", [1.0, 0.0], ids=["sampled-q", "one-hot-q"])
def test_first_token_follows_p(draft_temperature: float) -> None:
    """The first emitted token is distributed as p, whatever q' the draft sampled from.

    Threshold: Pearson's chi-square at p = 0.001 (24.3 for 7 degrees of freedom), and a total
    variation distance under 0.02 (its standard error here is about 0.005); fixed seeds make
    the check itself deterministic.
    """
    ids, probs = draft_sparse_probs(np.log(Q), draft_temperature, 4)
    q = SparseDraftProbs(ids=ids[None, :], probs=probs[None, :])
    target_logits = np.log(np.stack([P, P])).astype(np.float32)
    first = Counter[int]()
    for trial in range(TRIALS):
        x = int(ids[round_rng(11, trial, RngStream.DRAFT).choice(4, p=probs)])
        verdict = rejection_sample([x], q, target_logits, SAMPLED, round_rng(11, trial))
        first[x if verdict.n_accepted == 1 else verdict.next_token] += 1
    expected = {token: float(P[token]) for token in range(V)}
    stat, df = chi_square(first, expected)
    assert df == V - 1
    assert stat < chi_square_critical(df)
    assert total_variation(first, expected) < 0.02
