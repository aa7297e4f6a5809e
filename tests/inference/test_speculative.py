"""Local speculative decoding against target-only decoding, on a small synthetic model pair."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from goodness_of_fit import chi_square, chi_square_critical, total_variation
from synthetic_lm import SyntheticLM

from inference.drafters import make_proposer
from inference.proposers import (
    HybridProposer,
    NeuralProposer,
    NGramTable,
    NGramTableProposer,
    PromptLookupProposer,
    Proposer,
)
from inference.sampling import SamplingParams, target_probs
from inference.speculative import (
    DecodeResult,
    decode_speculative,
    decode_target,
    greedy_acceptance,
    replay_greedy,
)

GREEDY = SamplingParams(temperature=0.0)
TARGET = SyntheticLM.random(vocab_size=16, dim=8, seed=0, sharpness=0.6)
PROMPTS = [[1, 4, 9, 2], [7], [3, 3, 3, 12, 5, 0], [15, 14, 13, 12, 11, 10, 9, 8]]


def ngram_from_target() -> NGramTable:
    """A table of the target's own greedy outputs on prompts other than PROMPTS."""
    rng = np.random.default_rng(99)
    corpus = []
    for _ in range(12):
        prompt = rng.integers(0, 16, size=5).tolist()
        result = decode_target(TARGET, prompt, 40, GREEDY)
        corpus.append(prompt + result.tokens)
    return NGramTable.build(corpus, order=4)


TABLE = ngram_from_target()


def make_drafter(name: str) -> Proposer:
    draft = TARGET.perturbed(scale=0.4, seed=1)
    if name == "lookup":
        return PromptLookupProposer()
    if name == "ngram":
        return NGramTableProposer(TABLE, min_context=1)
    if name == "neural":
        return NeuralProposer(draft)
    if name == "neural-confident":
        return NeuralProposer(draft, min_confidence=0.6, min_tokens=0)
    if name == "hybrid":
        return HybridProposer([PromptLookupProposer(), NGramTableProposer(TABLE)])
    if name == "hybrid-fill":
        return HybridProposer([PromptLookupProposer(), NeuralProposer(draft)], fill=True)
    raise AssertionError(name)


DRAFTER_NAMES = ["lookup", "ngram", "neural", "neural-confident", "hybrid", "hybrid-fill"]


@pytest.mark.parametrize("name", DRAFTER_NAMES)
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_is_token_identical(name: str, k: int) -> None:
    drafter = make_drafter(name)  # one drafter reused across prompts, as a session would
    for prompt in PROMPTS:
        reference = decode_target(TARGET, prompt, 30, GREEDY)
        result = decode_speculative(TARGET, drafter, prompt, k, 30, GREEDY)
        assert result.tokens == reference.tokens
        assert result.stopped_by == reference.stopped_by == "max_tokens"


@pytest.mark.parametrize("name", DRAFTER_NAMES)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculative_stops_at_eos_like_the_target(name: str, k: int) -> None:
    for prompt in PROMPTS:
        # Take a token the target emits a few steps in as the eos, so the stop falls mid-draft.
        eos = decode_target(TARGET, prompt, 12, GREEDY).tokens[7]
        reference = decode_target(TARGET, prompt, 30, GREEDY, eos=eos)
        result = decode_speculative(TARGET, make_drafter(name), prompt, k, 30, GREEDY, eos=eos)
        assert reference.stopped_by == "eos" and reference.tokens[-1] == eos
        assert reference.tokens.count(eos) == 1
        assert result.tokens == reference.tokens
        assert result.stopped_by == "eos"
        assert result.content_tokens() == reference.tokens[:-1]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 16])
def test_rounds_never_overshoot_max_tokens(max_new_tokens: int) -> None:
    exact = NeuralProposer(TARGET)  # the target as its own draft: every token is accepted
    result = decode_speculative(TARGET, exact, PROMPTS[0], 8, max_new_tokens, GREEDY)
    assert len(result.tokens) == max_new_tokens
    assert result.tokens == decode_target(TARGET, PROMPTS[0], max_new_tokens, GREEDY).tokens
    assert sum(r.n_accepted + 1 for r in result.rounds) == max_new_tokens
    assert all(r.n_accepted == r.k for r in result.rounds)
    assert result.tokens_per_pass == max_new_tokens / result.target_passes


def test_target_only_makes_one_pass_per_token() -> None:
    result = decode_target(TARGET, PROMPTS[2], 10, GREEDY)
    assert result.target_passes == 10 and result.tokens_per_pass == 1.0
    assert all(r.k == 0 and r.n_accepted == 0 for r in result.rounds)


def test_perfect_draft_commits_k_plus_one_per_pass() -> None:
    result = decode_speculative(TARGET, NeuralProposer(TARGET), PROMPTS[1], 4, 25, GREEDY)
    assert [r.k for r in result.rounds] == [4] * 5
    assert result.tokens_per_pass == 5.0


@pytest.mark.parametrize(
    "name", ["lookup", "neural", "hybrid-fill", "neural-sampled"], ids=lambda n: str(n)
)
def test_sampled_output_is_reproducible_from_the_seed(name: str) -> None:
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        drafter = (
            NeuralProposer(TARGET.perturbed(0.4, 1), temperature=0.9, top_k=4)
            if name == "neural-sampled"
            else make_drafter(name)
        )
        return decode_speculative(TARGET, drafter, PROMPTS[0], 4, 20, params).tokens

    assert run(5) == run(5)
    assert len({tuple(run(seed)) for seed in range(6)}) > 1


def test_greedy_acceptance_of_the_target_itself_is_one() -> None:
    tokens = decode_target(TARGET, PROMPTS[0], 20, GREEDY).tokens
    assert greedy_acceptance(NeuralProposer(TARGET), PROMPTS[0], tokens) == (20, 20)
    matches, positions = greedy_acceptance(NeuralProposer(TARGET.perturbed(3.0, 2)), [1], tokens)
    assert positions == 20 and matches < 20


# The joint law of the first three tokens over a 5-token vocabulary (125 outcomes).
SMALL_TARGET = SyntheticLM.random(vocab_size=5, dim=4, seed=4, sharpness=0.2)
SMALL_DRAFT = SMALL_TARGET.perturbed(scale=0.8, seed=5)
SMALL_PROMPT = [2, 0, 3]
SMALL_PARAMS = SamplingParams(temperature=0.9, top_p=0.95)
TRIALS = 6000


def exact_first_tokens(n: int) -> dict[tuple[int, ...], float]:
    """P(t_1..t_n | prompt) under the target's sampling distribution, by enumeration."""
    law: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(5), repeat=n):
        logits = SMALL_TARGET.forward([*SMALL_PROMPT, *seq[:-1]], SMALL_TARGET.new_cache())
        p = target_probs(logits[len(SMALL_PROMPT) - 1 :], SMALL_PARAMS)
        law[seq] = float(np.prod([p[i, t] for i, t in enumerate(seq)]))
    return law


@pytest.mark.parametrize(
    "drafter",
    ["target-only", "sampled-draft", "greedy-draft", "lookup"],
)
def test_first_three_tokens_follow_the_target(drafter: str) -> None:
    """Speculative sampling leaves the law of the output unchanged (Leviathan et al., Thm 1).

    6,000 seeded runs each; the threshold is Pearson's chi-square at p = 0.001 with sparse
    outcomes pooled, and a total variation distance under 0.06 (a correct sampler gives about
    0.04 here, with 125 outcomes and 6,000 draws). Runs draft k = 3, so the first round drafts
    two tokens (max 3 tokens) and the third token is either a bonus or the next round's.
    """
    counts = Counter[tuple[int, ...]]()
    for trial in range(TRIALS):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=trial)
        if drafter == "target-only":
            result = decode_target(SMALL_TARGET, SMALL_PROMPT, 3, params)
        else:
            proposer: Proposer = {
                "sampled-draft": lambda: NeuralProposer(SMALL_DRAFT, temperature=1.0, top_k=3),
                "greedy-draft": lambda: NeuralProposer(SMALL_DRAFT),
                "lookup": lambda: PromptLookupProposer(),
            }[drafter]()
            result = decode_speculative(SMALL_TARGET, proposer, SMALL_PROMPT, 3, 3, params)
        counts[tuple(result.tokens)] += 1
    law = exact_first_tokens(3)
    stat, df = chi_square(counts, law)
    assert stat < chi_square_critical(df), (stat, df)
    assert total_variation(counts, law) < 0.06


# ---- The real target (SmolLM2-135M-Instruct through ONNX Runtime) with real drafters. ----

REAL_MAX_TOKENS = 48


def real_drafter(name: str) -> Proposer:
    from inference.artifacts import default_models_dir

    return make_proposer(name, default_models_dir())


def real_drafter_names() -> list[str]:
    from inference.artifacts import default_models_dir
    from inference.drafters import drafter_names

    return drafter_names(default_models_dir())


def check_identical(name: str, prompt_id: str, k: int, max_tokens: int = REAL_MAX_TOKENS) -> None:
    from real_target import greedy_reference, prompt_ids, target_pair

    target, tokenizer = target_pair()
    # A greedy answer's first n tokens are the answer to a run of n tokens.
    reference = greedy_reference(prompt_id, REAL_MAX_TOKENS)[:max_tokens]
    result = decode_speculative(
        target,
        real_drafter(name),
        prompt_ids(prompt_id),
        k,
        max_tokens,
        GREEDY,
        eos=tokenizer.eos_id,
    )
    assert tuple(result.tokens) == reference, (name, prompt_id, k)


@pytest.mark.parametrize("name", ["lookup", "hybrid", "ngram"])
@pytest.mark.parametrize("k", range(1, 9))
def test_real_target_greedy_identity(name: str, k: int) -> None:
    """Every k for the built-in drafters, each k on one prompt (of a different task each)."""
    from real_target import one_prompt_per_task

    prompts = one_prompt_per_task()
    check_identical(name, prompts[(k + ["lookup", "hybrid", "ngram"].index(name)) % 5].id, k)


def test_real_target_greedy_identity_neural_drafts() -> None:
    """All k for each neural draft (ONNX and LiteRT), one prompt per k, 16 tokens each."""
    from real_target import one_prompt_per_task

    from inference.artifacts import default_models_dir
    from inference.drafters import draft_model_names

    prompts = one_prompt_per_task()
    for name in draft_model_names(default_models_dir()):
        for k in range(1, 9):
            check_identical(name, prompts[k % 5].id, k, max_tokens=16)


@pytest.mark.slow
def test_real_target_greedy_identity_full_matrix() -> None:
    """Every shared prompt, every drafter, every k from 1 to 8."""
    from real_target import shared_prompts

    for name in real_drafter_names():
        for prompt in shared_prompts():
            for k in range(1, 9):
                check_identical(name, prompt.id, k)


def assert_same_rounds(replayed: DecodeResult, decoded: DecodeResult) -> None:
    assert replayed.tokens == decoded.tokens
    assert [r.k for r in replayed.rounds] == [r.k for r in decoded.rounds]
    accepted = [r.n_accepted for r in replayed.rounds]
    assert accepted[:-1] == [r.n_accepted for r in decoded.rounds][:-1]
    # In the last round the target may also accept drafted tokens past its eos, which are cut.
    assert accepted[-1] <= decoded.rounds[-1].n_accepted


@pytest.mark.parametrize("name", DRAFTER_NAMES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_replay_gives_the_rounds_of_greedy_speculative_decoding(name: str, k: int) -> None:
    for prompt in PROMPTS:
        for eos, max_new in ((None, 30), (decode_target(TARGET, prompt, 12, GREEDY).tokens[7], 30)):
            decoded = decode_speculative(
                TARGET, make_drafter(name), prompt, k, max_new, GREEDY, eos
            )
            answer = decode_target(TARGET, prompt, max_new, GREEDY, eos).tokens
            assert_same_rounds(
                replay_greedy(make_drafter(name), prompt, answer, k, max_new), decoded
            )


def test_replay_refuses_a_longer_answer_than_max_tokens() -> None:
    with pytest.raises(ValueError, match="max_new_tokens=4"):
        replay_greedy(PromptLookupProposer(), [1, 2], [3, 4, 5, 6, 7], 2, 4)


@pytest.mark.parametrize("name", ["hybrid", "hybrid+draft-l1"])
def test_replay_on_the_real_target_gives_its_rounds(name: str) -> None:
    from real_target import greedy_reference, one_prompt_per_task, prompt_ids, target_pair

    target, tokenizer = target_pair()
    for prompt in one_prompt_per_task()[:3]:
        ids = prompt_ids(prompt.id)
        decoded = decode_speculative(
            target, real_drafter(name), ids, 8, 48, GREEDY, eos=tokenizer.eos_id
        )
        answer = list(greedy_reference(prompt.id, REAL_MAX_TOKENS)[:48])
        assert_same_rounds(replay_greedy(real_drafter(name), ids, answer, 8, 48), decoded)


@pytest.mark.parametrize("name", ["eagle-h1", "hybrid+eagle-h1"])
def test_replay_hands_a_feature_drafter_the_features_its_verdicts_would(name: str) -> None:
    """Replayed with the target's hidden states over prompt + answer (one prefill), a feature
    head drafts what it drafts in real speculative decoding, whose verify passes hand it the
    same features round by round; without them it falls back from the first round on."""
    from real_target import greedy_reference, one_prompt_per_task, prompt_ids, target_pair

    target, tokenizer = target_pair()
    fell_back = 0
    for prompt in one_prompt_per_task()[:3]:
        ids = prompt_ids(prompt.id)
        decoded = decode_speculative(
            target, real_drafter(name), ids, 8, 48, GREEDY, eos=tokenizer.eos_id
        )
        answer = list(greedy_reference(prompt.id, REAL_MAX_TOKENS)[:48])
        ((_, hidden),) = target.forward_batch_hidden([([*ids, *answer], target.new_cache())])
        assert_same_rounds(replay_greedy(real_drafter(name), ids, answer, 8, 48, hidden), decoded)
        blind = replay_greedy(real_drafter(name), ids, answer, 8, 48)
        fell_back += [r.k for r in blind.rounds] != [r.k for r in decoded.rounds]
    assert fell_back > 0


def test_real_target_sampling_is_reproducible() -> None:
    """The hybrid, and a neural draft sampling its own q' when one is built."""
    from real_target import one_prompt_per_task, prompt_ids, target_pair

    from inference.artifacts import default_models_dir
    from inference.drafters import draft_model_names

    target, tokenizer = target_pair()
    ids = prompt_ids(one_prompt_per_task()[0].id)
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def run(name: str, seed: int) -> list[int]:
        seeded = SamplingParams(params.temperature, params.top_p, seed=seed)
        drafter = make_proposer(name, default_models_dir(), temperature=params.temperature)
        return decode_speculative(target, drafter, ids, 4, 24, seeded, tokenizer.eos_id).tokens

    for name in ["hybrid", *draft_model_names(default_models_dir())[:1]]:
        first = run(name, 11)
        assert run(name, 11) == first, name
        assert run(name, 12) != first, name


REAL_TRIALS = 240


def test_real_target_first_sampled_token_follows_the_target() -> None:
    """With a real drafter proposing, the first sampled token is still distributed as p.

    The context repeats a phrase, so prompt lookup proposes the phrase's next word x
    (" pears"), to which the target gives a probability well inside (0, 1), about 0.3: both the
    acceptance and the residual path run. Over 240 seeded runs, a correct sampler passes
    Pearson's chi-square at p = 0.001 (sparse tokens pooled) 999 times in 1000; the seeds are
    fixed, so the check is deterministic. The frequency of x itself must lie within 4
    standard errors (about 0.12) of p(x): accepting every draft would give 1.0, and resampling
    a rejection from p instead of the residual about 0.5.
    """
    from real_target import target_pair

    target, tokenizer = target_pair()
    ids = tokenizer.encode("I like apples and pears. You like apples and")
    params = SamplingParams(temperature=1.0, top_p=0.95)
    p = target_probs(target.forward(ids, target.new_cache())[-1:], params)[0]
    x = int(PromptLookupProposer().get_candidates(ids, 1).tokens[0])
    assert 0.1 < p[x] < 0.9, p[x]

    counts = Counter[int]()
    for trial in range(REAL_TRIALS):
        seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=trial)
        result = decode_speculative(target, PromptLookupProposer(), ids, 1, 2, seeded)
        assert result.rounds[0].k == 1
        counts[result.tokens[0]] += 1
    expected = {int(t): float(p[t]) for t in np.flatnonzero(p)}
    stat, df = chi_square(counts, expected)
    assert stat < chi_square_critical(max(df, 1)), (stat, df)
    standard_error = float(np.sqrt(p[x] * (1 - p[x]) / REAL_TRIALS))
    assert abs(counts[x] / REAL_TRIALS - p[x]) < 4 * standard_error
