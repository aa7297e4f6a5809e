"""The feature drafter: a head chained from the target's features, its fallback, its exactness."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
from goodness_of_fit import chi_square, chi_square_critical, total_variation
from synthetic_lm import SyntheticLM

from inference.feature_head import HeadWeights, random_head_weights, step_reference
from inference.proposers import (
    FEATURE_CATCH_UP_MAX,
    Candidates,
    FeatureProposer,
    HybridProposer,
    PromptLookupProposer,
    Proposer,
    draft_together,
    drafting,
    give_features,
    wants_features,
)
from inference.sampling import SamplingParams, target_probs
from inference.speculative import decode_speculative, decode_target

F32 = npt.NDArray[np.float32]
GREEDY = SamplingParams(temperature=0.0)


class ReferenceHead:
    """A head's step as `inference.feature_head.step_reference` computes it (numpy), counted."""

    def __init__(self, weights: HeadWeights) -> None:
        assert weights.embed is not None
        self.weights = weights
        self.embed = weights.embed
        self.name = weights.config.name
        self.hidden_size = weights.config.hidden_size
        self.vocab_ids = weights.vocab_ids
        self.steps = 0

    def step(self, features: F32, tokens: npt.ArrayLike) -> tuple[F32, F32]:
        self.steps += 1
        return step_reference(self.weights, self.embed, features, np.asarray(tokens))


def small_head(hidden: int = 6, vocab: int = 16, seed: int = 3) -> ReferenceHead:
    ids = np.arange(1, vocab, 2)  # V' = 8 of 16 ids
    return ReferenceHead(random_head_weights(hidden, ids, seed, vocab_size=vocab, name="eagle-t"))


def chained(head: ReferenceHead, feature: F32, token: int, k: int) -> list[int]:
    """The greedy chain the interface defines, step by step."""
    tokens, features = [], feature.reshape(1, -1)
    for _ in range(k):
        features, logits = head.step(features, [token])
        token = int(head.vocab_ids[int(logits[0].argmax())])
        tokens.append(token)
    return tokens


def test_a_feature_chains_the_head_from_the_last_committed_token() -> None:
    head = small_head()
    drafter = FeatureProposer(head)
    feature = np.random.default_rng(0).standard_normal(6).astype(np.float32)
    context = [3, 5, 7, 9]
    drafter.give_features(feature, len(context))
    drafted = drafter.get_candidates(context, 4)
    assert drafted.tokens.tolist() == chained(head, feature, 9, 4)
    assert drafted.q is None and set(drafted.tokens.tolist()) <= set(head.vocab_ids.tolist())


def test_without_a_feature_it_falls_back_or_proposes_nothing() -> None:
    context = [1, 2, 3, 1, 2]
    alone = FeatureProposer(small_head())
    assert alone.get_candidates(context, 3).n == 0
    backed = FeatureProposer(small_head(), fallback=PromptLookupProposer())
    assert backed.get_candidates(context, 3).tokens.tolist() == [3, 1, 2]
    assert (backed.head_rounds, backed.fallback_rounds) == (0, 1)


def test_a_rewind_before_the_features_context_drops_them() -> None:
    drafter = FeatureProposer(small_head())
    drafter.give_features(np.ones(6, dtype=np.float32), 4)
    drafter.rollback(4)  # the verdict's own length: still good
    assert drafter.has_features
    drafter.rollback(3)
    assert not drafter.has_features
    assert drafter.get_candidates([1, 3, 5], 2).n == 0


def test_a_longer_context_is_caught_up_on_predicted_features_reusing_steps() -> None:
    """A pre-drafted window: the context grew past the feature by the drafted tokens (all
    accepted) and a guessed bonus; the head steps on over them, reusing the steps it took."""
    head = small_head()
    drafter = FeatureProposer(head)
    feature = np.random.default_rng(1).standard_normal(6).astype(np.float32)
    context = [3, 5, 7, 9]
    drafter.give_features(feature, len(context))
    window = drafter.get_candidates(context, 3).tokens.tolist()
    steps = head.steps
    ahead = [*context, *window, 11]
    next_window = drafter.get_candidates(ahead, 2).tokens.tolist()
    # Steps on d_3 and the guess, then one on the first new token for the second.
    assert head.steps - steps == 3
    features = feature.reshape(1, -1)
    for token in [9, *window, 11]:
        features, logits = head.step(features, [token])
    first = int(head.vocab_ids[int(logits[0].argmax())])
    assert next_window == [first, chained(head, features[0], first, 1)[0]]


def test_features_of_the_wrong_size_are_refused() -> None:
    drafter = FeatureProposer(small_head())
    with pytest.raises(ValueError, match="drafts from 6 features, got 5"):
        drafter.give_features(np.zeros(5, dtype=np.float32), 4)
    assert not drafter.has_features


def test_sampled_drafts_send_q_over_the_reduced_vocabulary_reproducibly() -> None:
    head = small_head()
    feature = np.random.default_rng(2).standard_normal(6).astype(np.float32)

    def draft(seed: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        drafter = FeatureProposer(head, temperature=1.0, top_k=4)
        drafter.give_features(feature, 3)
        candidates = drafter.get_candidates([1, 3, 5], 5, np.random.default_rng(seed))
        assert candidates.q is not None
        return candidates.tokens.tolist(), candidates.q.ids, candidates.q.probs

    tokens, ids, probs = draft(5)
    assert len(tokens) == 5 and ids.shape == probs.shape == (5, 4)
    assert set(ids.ravel().tolist()) <= set(head.vocab_ids.tolist())
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-9)
    assert all(t in row for t, row in zip(tokens, ids.tolist(), strict=True))
    assert draft(5)[0] == tokens
    with pytest.raises(ValueError, match="rng"):
        FeatureProposer(head, temperature=1.0).get_candidates([1, 3, 5], 2)


def test_features_reach_the_head_inside_a_hybrid() -> None:
    head_drafter = FeatureProposer(small_head())
    hybrid = HybridProposer([PromptLookupProposer(4, 3), head_drafter])
    assert wants_features(hybrid) and not wants_features(PromptLookupProposer())
    give_features(hybrid, np.ones(6, dtype=np.float32), 4)
    assert head_drafter.has_features


# ---- In-process speculative decoding: the target hands its own features to the head. ----

TARGET = SyntheticLM.random(vocab_size=16, dim=6, seed=0, sharpness=0.6)
PROMPTS = [[1, 4, 9, 2], [7, 3], [3, 3, 3, 12, 5, 0]]


@pytest.mark.parametrize(("prompt", "k"), list(itertools.product(range(3), [1, 3, 5])))
def test_greedy_with_a_head_is_token_identical(prompt: int, k: int) -> None:
    drafter = FeatureProposer(small_head(), fallback=PromptLookupProposer())
    expected = decode_target(TARGET, PROMPTS[prompt], 30, GREEDY).tokens
    result = decode_speculative(TARGET, drafter, PROMPTS[prompt], k, 30, GREEDY)
    assert result.tokens == expected
    # Only the first round lacks a feature (the last may have no room to draft at all).
    assert drafter.fallback_rounds == 1
    assert drafter.head_rounds >= result.target_passes - 2


SMALL_TARGET = SyntheticLM.random(vocab_size=5, dim=4, seed=4, sharpness=0.2)
SMALL_PROMPT = [2, 0, 3]
TRIALS = 6000


def test_sampled_output_with_a_head_follows_the_target() -> None:
    """Leviathan et al., Thm 1, with the head proposing from the second round on: the law of
    the first three tokens (125 outcomes) is the target's. Thresholds as in test_speculative:
    chi-square at p = 0.001 with sparse outcomes pooled, and total variation under 0.06. The
    first round commits one token (no feature yet), the second drafts one with the head."""
    head = ReferenceHead(random_head_weights(4, [0, 1, 2, 3, 4], 9, vocab_size=5))
    counts = Counter[tuple[int, ...]]()
    drafted = 0
    for trial in range(TRIALS):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=trial)
        drafter = FeatureProposer(head, temperature=1.0, top_k=3)
        result = decode_speculative(SMALL_TARGET, drafter, SMALL_PROMPT, 2, 3, params)
        counts[tuple(result.tokens)] += 1
        drafted += result.n_drafted
    assert drafted == TRIALS  # the head drafted once in every run
    law = exact_law(3, SamplingParams(temperature=0.9, top_p=0.95))
    stat, df = chi_square(counts, law)
    assert stat < chi_square_critical(df), (stat, df)
    assert total_variation(counts, law) < 0.06


def exact_law(n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(5), repeat=n):
        logits = SMALL_TARGET.forward([*SMALL_PROMPT, *seq[:-1]], SMALL_TARGET.new_cache())
        p = target_probs(logits[len(SMALL_PROMPT) - 1 :], params)
        law[seq] = float(np.prod([p[i, t] for i, t in enumerate(seq)]))
    return law


# ---- The real target: its features are the ones at the right position. ----


class OracleHead:
    """A head that knows the target's greedy path and its hidden states along it: given the
    feature of position p (found as the nearest recorded one) and the token at p + 1, it
    returns the feature of p + 1 and the token at p + 2. It drafts the target's own tokens only
    if the features it is handed are the target's, at the position the interface names."""

    name = "oracle"

    def __init__(self, sequence: Sequence[int], hidden: F32, vocab_size: int) -> None:
        self.sequence = list(sequence)
        self.hidden = hidden  # [len(sequence), H]
        self.hidden_size = int(hidden.shape[1])
        self.vocab_ids = np.arange(vocab_size, dtype=np.int64)

    def step(self, features: F32, tokens: npt.ArrayLike) -> tuple[F32, F32]:
        feature, token = features[0], int(np.asarray(tokens)[0])
        distances = np.linalg.norm(self.hidden - feature, axis=1)
        p = int(distances.argmin())
        logits = np.zeros((1, self.vocab_ids.shape[0]), dtype=np.float32)
        on_path = distances[p] < 1e-2 * np.linalg.norm(feature) and p + 2 < len(self.sequence)
        if on_path and self.sequence[p + 1] == token:
            logits[0, self.sequence[p + 2]] = 10.0
            return self.hidden[p + 1 : p + 2], logits
        return features, logits  # off the path: token 0, which the target rejects


def test_real_target_features_let_an_oracle_head_draft_every_token() -> None:
    from real_target import one_prompt_per_task, prompt_ids, target_pair

    target, tokenizer = target_pair()
    ids = prompt_ids(one_prompt_per_task()[0].id)
    k, max_new = 4, 32
    answer = decode_target(target, ids, max_new, GREEDY, tokenizer.eos_id).tokens
    sequence = [*ids, *answer]
    ((_, hidden),) = target.forward_batch_hidden([(sequence, target.new_cache())])
    drafter = FeatureProposer(OracleHead(sequence, hidden, target.vocab_size))
    result = decode_speculative(target, drafter, ids, k, max_new, GREEDY, tokenizer.eos_id)
    assert result.tokens == answer
    # The first round has no feature; every later one drafts the target's own k tokens.
    assert result.rounds[0].k == 0
    full = [r for r in result.rounds[1:] if r.k == k]
    assert len(full) >= len(result.rounds) - 3
    assert all(r.n_accepted == k for r in full)


def test_real_target_greedy_with_a_random_head_is_token_identical() -> None:
    from real_target import one_prompt_per_task, prompt_ids, target_pair

    target, tokenizer = target_pair()
    vocab_ids = np.arange(0, target.vocab_size, 5)
    head = ReferenceHead(
        random_head_weights(
            target.hidden_size, vocab_ids, 11, vocab_size=target.vocab_size, intermediate_size=64
        )
    )
    drafter = FeatureProposer(head, fallback=PromptLookupProposer())
    for prompt in one_prompt_per_task()[:2]:
        ids = prompt_ids(prompt.id)
        expected = decode_target(target, ids, 24, GREEDY, tokenizer.eos_id).tokens
        result = decode_speculative(target, drafter, ids, 3, 24, GREEDY, tokenizer.eos_id)
        assert result.tokens == expected
    assert drafter.head_rounds > 0 and head.steps > 0


def test_a_context_too_far_past_its_feature_falls_back() -> None:
    """Tokens committed without features (a cloud stretch, a resync) leave the feature behind:
    past FEATURE_CATCH_UP_MAX of them the fallback drafts, as with no feature at all."""
    head = small_head()
    drafter = FeatureProposer(head, fallback=PromptLookupProposer())
    drafter.give_features(np.ones(6, dtype=np.float32), 3)
    near = [1, 3, 5, *([7] * FEATURE_CATCH_UP_MAX)]
    assert drafter.get_candidates(near, 2).n == 2 and drafter.head_rounds == 1
    drafter.get_candidates([*near, 9], 2)
    assert (drafter.head_rounds, drafter.fallback_rounds) == (1, 1)


# ---- Drafts run together: one head call per step for every draft that needs one. ----


class BatchingHead(ReferenceHead):
    """A reference head that takes many rows a call, each computed as a call of its own would
    (so a draft's result cannot depend on its neighbours), counting calls and rows."""

    batches_rows = True

    def __init__(self, weights: HeadWeights) -> None:
        super().__init__(weights)
        self.rows_per_call: list[int] = []

    def step(self, features: F32, tokens: npt.ArrayLike) -> tuple[F32, F32]:
        self.rows_per_call.append(features.shape[0])
        rows = [
            step_reference(self.weights, self.embed, features[i : i + 1], np.asarray([t]))
            for i, t in enumerate(np.asarray(tokens).tolist())
        ]
        return np.concatenate([f for f, _ in rows]), np.concatenate([g for _, g in rows])


def batching_head() -> BatchingHead:
    ids = np.arange(1, 16, 2)
    return BatchingHead(random_head_weights(6, ids, 3, vocab_size=16, name="eagle-t"))


def drafts_of(head: ReferenceHead) -> list[tuple[Proposer, list[int], int, float]]:
    """Drafters of several sessions: (drafter, context, k, temperature), each with its feature
    where it has one."""
    rng = np.random.default_rng(7)
    made: list[tuple[Proposer, list[int], int, float]] = []
    for index, (context, k, temperature) in enumerate(
        [
            ([3, 5, 7, 9], 4, 0.0),
            ([2, 4, 6], 2, 0.0),
            ([1, 2, 3, 1, 2], 3, 0.0),  # lookup proposes first in its hybrid
            ([9, 9, 1], 5, 1.0),  # sampled
            ([4, 1], 3, 0.0),  # no feature: its fallback drafts
            ([5, 3, 5, 3, 8], 6, 0.0),  # a feature two tokens behind: caught up first
        ]
    ):
        head_drafter = FeatureProposer(
            head, fallback=PromptLookupProposer(), temperature=temperature, top_k=4
        )
        drafter: Proposer = head_drafter
        if index == 2:
            drafter = HybridProposer([PromptLookupProposer(2, 2), head_drafter])
        if index != 4:
            behind = 2 if index == 5 else 0
            feature = rng.standard_normal(6).astype(np.float32)
            head_drafter.give_features(feature, len(context) - behind)
        made.append((drafter, context, k, temperature))
    return made


def test_drafts_run_together_are_each_drafts_alone_in_one_head_call_a_step() -> None:
    alone_head, together_head = batching_head(), batching_head()
    alone = [
        drafter.get_candidates(context, k, np.random.default_rng(11) if t else None)
        for drafter, context, k, t in drafts_of(alone_head)
    ]
    together = draft_together(
        [
            drafting(drafter, context, k, np.random.default_rng(11) if t else None)
            for drafter, context, k, t in drafts_of(together_head)
        ]
    )
    for one, many in zip(alone, together, strict=True):
        assert many.error is None and many.candidates is not None and many.ms >= 0.0
        assert many.candidates.tokens.tolist() == one.tokens.tolist()
        assert (many.candidates.q is None) == (one.q is None)
        if one.q is not None and many.candidates.q is not None:
            np.testing.assert_array_equal(many.candidates.q.ids, one.q.ids)
            np.testing.assert_array_equal(many.candidates.q.probs, one.q.probs)
    # Alone, every step is a call of one row; together, the same rows in as many calls as the
    # longest chain has steps.
    assert set(alone_head.rows_per_call) == {1}
    assert sum(together_head.rows_per_call) == len(alone_head.rows_per_call)
    assert len(together_head.rows_per_call) < len(alone_head.rows_per_call)
    assert max(together_head.rows_per_call) >= 4


def test_a_draft_that_fails_fails_alone_and_the_others_go_on() -> None:
    head = batching_head()
    feature = np.ones(6, dtype=np.float32)
    fine, sampled = FeatureProposer(head), FeatureProposer(head, temperature=1.0)
    fine.give_features(feature, 3)
    sampled.give_features(feature, 3)
    done = draft_together([drafting(sampled, [1, 2, 3], 3), drafting(fine, [1, 2, 3], 3)])
    assert isinstance(done[0].error, ValueError) and "rng" in str(done[0].error)
    assert done[1].error is None and done[1].candidates is not None
    assert done[1].candidates.tokens.tolist() == chained(head, feature, 3, 3)


def test_a_drafter_that_overrides_get_candidates_is_asked_that() -> None:
    class Fixed(HybridProposer):
        def get_candidates(
            self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
        ) -> Candidates:
            return Candidates(tokens=np.asarray([5] * k, dtype=np.int64), q=None)

    (done,) = draft_together([drafting(Fixed([PromptLookupProposer()]), [1, 2], 3)])
    assert done.candidates is not None and done.candidates.tokens.tolist() == [5, 5, 5]
