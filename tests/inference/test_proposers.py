"""Drafters: prompt lookup, the n-gram table, the neural draft and the hybrid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic_lm import SyntheticLM, TrimmedHeadLM

from inference.proposers import (
    Candidates,
    HybridProposer,
    NeuralProposer,
    NGramEntry,
    NGramTable,
    NGramTableProposer,
    PromptLookupProposer,
    concat_candidates,
)
from inference.sampling import SparseDraftProbs, round_rng, softmax

# A sentence-like sequence with repeats, as token ids: "the cat sat on the mat . the cat ran ."
THE, CAT, SAT, ON, MAT, DOT, RAN = 5, 9, 3, 7, 11, 2, 13
SENTENCE = [THE, CAT, SAT, ON, THE, MAT, DOT, THE, CAT, RAN, DOT]


@pytest.mark.parametrize(
    ("context", "k", "max_ngram", "min_ngram", "expected"),
    [
        pytest.param([1, 2, 3, 4, 5, 1, 2, 3], 3, 3, 1, [4, 5, 1], id="repeat of a trigram"),
        pytest.param([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 1, [4], id="k limits the copy"),
        pytest.param([1, 2, 3, 4, 1, 2, 3], 8, 3, 1, [4, 1, 2, 3], id="copy runs to the end"),
        pytest.param([1, 2, 3, 4], 3, 3, 1, [], id="no earlier occurrence"),
        pytest.param([7, 2, 3, 9, 5, 3, 8, 2, 3], 2, 2, 1, [9, 5], id="longest n-gram wins"),
        pytest.param([7, 2, 3, 9, 5, 3, 8, 2, 4, 6, 3], 2, 2, 1, [8, 2], id="unigram fallback"),
        pytest.param(
            [7, 2, 3, 9, 5, 3, 8, 2, 4, 6, 3], 2, 2, 2, [], id="min_ngram refuses unigrams"
        ),
        pytest.param([1, 2, 8, 1, 2, 9, 1, 2], 3, 2, 1, [9, 1, 2], id="most recent match"),
        pytest.param([*SENTENCE, THE], 2, 3, 1, [CAT, RAN], id="sentence: after 'the'"),
        pytest.param(
            [*SENTENCE[:-3], THE, CAT], 3, 3, 1, [SAT, ON, THE], id="sentence: after 'the cat'"
        ),
        pytest.param([4], 3, 3, 1, [], id="single token"),
    ],
)
def test_prompt_lookup_table(
    context: list[int],
    k: int,
    max_ngram: int,
    min_ngram: int,
    expected: list[int],
) -> None:
    proposer = PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
    candidates = proposer.get_candidates(context, k)
    assert candidates.tokens.tolist() == expected
    assert candidates.q is None


CORPUS = [
    [1, 2, 3, 4, 5],
    [1, 2, 3, 4, 6],
    [9, 2, 3, 4, 5],
    [7, 8, 1, 2, 3, 4, 5],
]


@pytest.mark.parametrize(
    ("max_tokens", "k", "expected"), [(None, 3, 3), (2, 3, 2), (5, 3, 3), (1, 8, 1)]
)
def test_max_tokens_caps_the_proposal(max_tokens: int | None, k: int, expected: int) -> None:
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    lookup = PromptLookupProposer(max_tokens=max_tokens)
    ngram = NGramTableProposer(NGramTable.build([context]), min_context=1, max_tokens=max_tokens)
    assert lookup.get_candidates(context, k).n == expected
    assert ngram.get_candidates(context, k).n == expected


def test_ngram_table_counts() -> None:
    table = NGramTable.build(CORPUS, order=4)
    # (2, 3, 4) was followed by 5 three times and by 6 once.
    assert table.entries[(2, 3, 4)] == NGramEntry(next_token=5, seen=3, total=4)
    assert table.entries[(1,)] == NGramEntry(next_token=2, seen=3, total=3)
    assert all(1 <= len(ctx) <= 3 for ctx in table.entries)


def test_ngram_table_file_roundtrip(tmp_path: Path) -> None:
    table = NGramTable.build(CORPUS, order=4)
    first, second = tmp_path / "a.ngram", tmp_path / "b.ngram"
    table.save(first)
    NGramTable.build(CORPUS, order=4).save(second)
    assert first.read_bytes() == second.read_bytes()
    loaded = NGramTable.load(first)
    assert loaded.order == 4 and loaded.entries == table.entries


def test_ngram_table_refuses_other_files(tmp_path: Path) -> None:
    path = tmp_path / "x.ngram"
    path.write_bytes(b"not a table")
    with pytest.raises(ValueError, match="not an n-gram table"):
        NGramTable.load(path)


@pytest.mark.parametrize(
    ("context", "k", "min_context", "min_count", "min_share", "expected"),
    [
        pytest.param([0, 1], 8, 1, 1, 0.0, [2, 3, 4, 5], id="chain through the table"),
        pytest.param([0, 1], 2, 1, 1, 0.0, [2, 3], id="k limits the chain"),
        pytest.param([0, 0, 9], 3, 1, 1, 0.0, [2, 3, 4], id="backs off to one token"),
        pytest.param([0, 0, 9], 3, 2, 1, 0.0, [], id="min_context refuses the backoff"),
        pytest.param([0, 0, 42], 3, 1, 1, 0.0, [], id="unseen context"),
        pytest.param([7, 8], 4, 2, 2, 0.0, [], id="min_count stops at rare"),
        pytest.param([2, 3, 4], 2, 3, 1, 0.8, [], id="min_share stops at an even split"),
        pytest.param([2, 3, 4], 2, 3, 1, 0.7, [5], id="min_share passes a clear winner"),
    ],
)
def test_ngram_proposer_table(
    context: list[int],
    k: int,
    min_context: int,
    min_count: int,
    min_share: float,
    expected: list[int],
) -> None:
    proposer = NGramTableProposer(
        NGramTable.build(CORPUS, order=4),
        min_context=min_context,
        min_count=min_count,
        min_share=min_share,
    )
    assert proposer.get_candidates(context, k).tokens.tolist() == expected


def greedy_chain(model: SyntheticLM, context: list[int], k: int) -> list[int]:
    """The model's greedy continuation, computed from scratch with a fresh cache."""
    cache = model.new_cache()
    logits = model.forward(context, cache)[-1]
    out = []
    for _ in range(k):
        token = int(logits.argmax())
        out.append(token)
        logits = model.forward([token], cache)[-1]
    return out


@pytest.fixture
def draft_model() -> SyntheticLM:
    return SyntheticLM.random(vocab_size=16, dim=8, seed=3)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_neural_greedy_follows_the_draft(draft_model: SyntheticLM, k: int) -> None:
    proposer = NeuralProposer(draft_model)
    context = [1, 4, 9, 2, 2, 7]
    candidates = proposer.get_candidates(context, k)
    assert candidates.tokens.tolist() == greedy_chain(draft_model, context, k)
    assert candidates.q is None


def test_neural_reuses_and_rolls_back_its_cache(draft_model: SyntheticLM) -> None:
    proposer = NeuralProposer(draft_model)
    context = [1, 4, 9, 2, 2, 7]
    first = proposer.get_candidates(context, 4).tokens.tolist()
    # The cache holds the context and the first three drafted tokens (the last one is not fed).
    assert proposer._cache.length == len(context) + 3
    # The target accepts two, then emits its own token 0 at the third position.
    proposer.rollback(len(context) + 2)
    assert proposer._cache.length == len(context) + 2
    committed = [*context, *first[:2], 0]
    calls = draft_model.forward_calls
    second = proposer.get_candidates(committed, 3).tokens.tolist()
    # One pass for the new token, then two for the drafted ones: no re-prefill.
    assert draft_model.forward_calls - calls == 3
    assert second == greedy_chain(draft_model, committed, 3)


def test_neural_resyncs_without_a_rollback(draft_model: SyntheticLM) -> None:
    proposer = NeuralProposer(draft_model)
    proposer.get_candidates([1, 4, 9, 2, 2, 7], 5)
    other = [1, 4, 3, 3]
    assert proposer.get_candidates(other, 4).tokens.tolist() == greedy_chain(draft_model, other, 4)


def test_neural_sampling_returns_q_and_is_reproducible(draft_model: SyntheticLM) -> None:
    context = [1, 4, 9, 2]
    runs = [
        NeuralProposer(draft_model, temperature=1.0, top_k=4).get_candidates(
            context, 5, round_rng(3, 1)
        )
        for _ in range(2)
    ]
    a, b = runs
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.q is not None and b.q is not None
    assert a.q.ids.shape == (5, 4)
    assert np.allclose(a.q.probs.sum(axis=1), 1.0)
    for i, token in enumerate(a.tokens.tolist()):
        assert token in a.q.ids[i].tolist()
    # q' is the draft's own top-4 distribution at each drafted prefix.
    cache = draft_model.new_cache()
    logits = draft_model.forward([*context, *a.tokens[:2].tolist()], cache)[-1]
    full = softmax(logits)
    top = np.argsort(-full)[:4]
    assert a.q.ids[2].tolist() == top.tolist()
    assert np.allclose(a.q.probs[2], full[top] / full[top].sum())


def test_neural_sampling_needs_an_rng(draft_model: SyntheticLM) -> None:
    with pytest.raises(ValueError, match="rng"):
        NeuralProposer(draft_model, temperature=0.7).get_candidates([1, 2], 3)


def test_neural_confidence_threshold_stops_drafting() -> None:
    flat = SyntheticLM.random(vocab_size=16, dim=8, seed=3, sharpness=0.05)
    context = [1, 4, 9, 2]
    top = float(softmax(flat.forward(context, flat.new_cache())[-1]).max())
    assert top < 0.2  # a nearly flat draft
    assert NeuralProposer(flat, min_confidence=0.5, min_tokens=0).get_candidates(context, 4).n == 0
    assert NeuralProposer(flat, min_confidence=0.5, min_tokens=2).get_candidates(context, 4).n == 2
    assert NeuralProposer(flat, min_confidence=0.0).get_candidates(context, 4).n == 4


def test_neural_maps_a_trimmed_head(draft_model: SyntheticLM) -> None:
    head_ids = np.array([0, 2, 3, 5, 7, 8, 11, 13], dtype=np.int64)
    trimmed = TrimmedHeadLM(draft_model, head_ids)
    context = [1, 4, 9, 2]
    greedy = NeuralProposer(trimmed).get_candidates(context, 4)
    cache = draft_model.new_cache()
    logits = draft_model.forward(context, cache)[-1]
    assert greedy.tokens[0] == head_ids[int(logits[head_ids].argmax())]
    sampled = NeuralProposer(trimmed, temperature=1.0, top_k=3).get_candidates(
        context, 4, round_rng(0, 0)
    )
    assert sampled.q is not None
    assert set(sampled.q.ids.ravel().tolist()) <= set(head_ids.tolist())
    assert set(sampled.tokens.tolist()) <= set(head_ids.tolist())


@pytest.mark.parametrize(
    ("accepted", "expected_windows"),
    [
        ([4, 6, 8], [4, 6, 8, 8]),  # every proposal accepted: grow by 2, capped by k = 8
        ([0, 0, 0, 0], [4, 3, 2, 1]),  # rejected: shrink by 1, not below 1
    ],
)
def test_neural_adaptive_window(
    draft_model: SyntheticLM, accepted: list[int], expected_windows: list[int]
) -> None:
    proposer = NeuralProposer(draft_model, adaptive=True)
    proposer.window = 4
    windows = []
    context = [1, 4, 9]
    for n in [*accepted, 0][: len(expected_windows)]:
        candidates = proposer.get_candidates(context, 8)
        windows.append(candidates.n)
        proposer.update_candidate_strategy(min(n, candidates.n))
    assert windows == expected_windows


def test_hybrid_prefers_lookup_then_falls_back(draft_model: SyntheticLM) -> None:
    hybrid = HybridProposer([PromptLookupProposer(), NeuralProposer(draft_model)])
    repeating = [1, 2, 3, 4, 1, 2]
    assert hybrid.get_candidates(repeating, 2).tokens.tolist() == [3, 4]
    fresh = [1, 4, 9, 2]
    assert hybrid.get_candidates(fresh, 3).tokens.tolist() == greedy_chain(draft_model, fresh, 3)


def test_hybrid_fill_extends_a_short_lookup(draft_model: SyntheticLM) -> None:
    context = [1, 2, 3, 6, 1, 2]
    hybrid = HybridProposer(
        [PromptLookupProposer(), NeuralProposer(draft_model, temperature=1.0, top_k=4)], fill=True
    )
    candidates = hybrid.get_candidates(context, 5, round_rng(1, 1))
    # Lookup copies [3, 6, 1, 2] and the draft adds one sampled token after it.
    assert candidates.tokens[:4].tolist() == [3, 6, 1, 2]
    assert candidates.n == 5
    assert candidates.q is not None
    assert candidates.q.ids[:4, 0].tolist() == [3, 6, 1, 2]
    assert candidates.q.probs[:4].tolist() == [[1.0, 0.0, 0.0, 0.0]] * 4
    assert candidates.q.prob_of(4, int(candidates.tokens[4])) > 0


def test_concat_candidates_pads_one_hot_rows() -> None:
    sparse = SparseDraftProbs(ids=np.array([[4, 6, 1]]), probs=np.array([[0.5, 0.3, 0.2]]))
    joined = concat_candidates(
        [
            Candidates(tokens=np.array([8, 9]), q=None),
            Candidates(tokens=np.array([6]), q=sparse),
        ]
    )
    assert joined.tokens.tolist() == [8, 9, 6]
    assert joined.q is not None
    assert joined.q.prob_of(0, 8) == 1.0 and joined.q.prob_of(1, 9) == 1.0
    assert joined.q.prob_of(2, 6) == pytest.approx(0.3)


def test_build_prompts_are_distinct_reproducible_and_not_the_benchmark() -> None:
    import json

    from modelbuild.ngram_build import TASKS, build_prompts

    shared = Path(__file__).resolve().parents[3] / "shared" / "bench" / "prompts.jsonl"
    benchmark = {json.loads(line)["prompt"] for line in shared.read_text().splitlines() if line}
    prompts = build_prompts(300)
    texts = [p.prompt for p in prompts]
    assert len(set(texts)) == len(texts) == 300
    assert not benchmark & set(texts)
    assert {p.task for p in prompts} == set(TASKS)
    assert build_prompts(300) == prompts


def test_batched_greedy_answers_match_the_target_alone() -> None:
    from inference.sampling import SamplingParams
    from inference.speculative import decode_target
    from modelbuild.ngram_build import greedy_answers

    model = SyntheticLM.random(vocab_size=16, dim=8, seed=0, sharpness=0.6)
    prompts = [[1, 4, 9], [2], [7, 7, 7, 3, 5]]
    eos = 6
    answers = greedy_answers(model, prompts, 20, eos, batch_size=2, progress=False)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == decode_target(model, prompt, 20, SamplingParams(), eos).tokens


@pytest.mark.parametrize(
    ("gate_after", "expected"), [(0, [2, 3, 4]), (3, [2, 3, 4]), (4, [2, 3, 4, 5])]
)
def test_ngram_gate_holds_from_gate_after_on(gate_after: int, expected: list[int]) -> None:
    # 4 -> 5 is a 3-in-4 continuation: below a 0.8 share, so the chain stops there once gated.
    proposer = NGramTableProposer(
        NGramTable.build(CORPUS, order=4), min_context=1, min_share=0.8, gate_after=gate_after
    )
    assert proposer.get_candidates([0, 1], 8).tokens.tolist() == expected
    with pytest.raises(ValueError, match="gate_after"):
        NGramTableProposer(NGramTable.build(CORPUS), gate_after=-1)
