"""VerifierCore on the real target: batched equals single, greedy equals target-only, caches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from verifier_helpers import (
    GREEDY,
    cloud_request,
    draft_from,
    greedy_reference,
    make_request,
    prompt_ids,
)

from broker.messages import SamplingSpec, VerifyRequest
from inference.artifacts import default_models_dir
from inference.features import features_from_wire
from inference.onnx_runtime import OnnxRuntime
from inference.sampling import SamplingParams, SparseDraftProbs, rejection_sample, round_rng
from inference.speculative import decode_target
from inference.tokenizer import ChatTokenizer
from modelbuild.gguf_source import GgufModel
from modelbuild.onnx_graph import DecoderSpec, build_decoder
from verifier.core import INLINE_PREFILL_MAX, Verification, VerifierCore, sparse_q
from verifier.drafting import HostDrafters

Target = tuple[OnnxRuntime, ChatTokenizer]
K = 4
# (shared prompt, drafted from this offset of the target's answer, the drafted token made wrong)
GREEDY_CASES = [(0, 0, None), (1, 3, 0), (2, 5, 2), (3, 1, 3), (5, 2, None), (6, 0, 1)]


def verdict(v: Verification) -> tuple[int, int | None, str]:
    return v.n_accepted, v.next_token, v.error


def greedy_case(session: str, prompt: int, start: int, wrong_at: int | None) -> VerifyRequest:
    reference = greedy_reference(prompt, 12)
    context = prompt_ids(prompt) + reference[:start]
    return make_request(session, start, context, draft_from(reference, start, K, wrong_at))


def test_batched_verify_equals_per_session_and_the_target(target: Target) -> None:
    runtime, _ = target
    requests = [greedy_case(f"s{i}", *case) for i, case in enumerate(GREEDY_CASES)]
    batched = VerifierCore(runtime).verify_batch(requests)
    singles = [VerifierCore(runtime).verify_batch([r])[0] for r in requests]

    for request, joint, single, (prompt, start, wrong_at) in zip(
        requests, batched, singles, GREEDY_CASES, strict=True
    ):
        reference = greedy_reference(prompt, 12)
        n = K if wrong_at is None else wrong_at
        assert verdict(joint) == verdict(single) == (n, reference[start + n], "")
        assert joint.request_id == request.request_id
        assert joint.base_len == len(request.context_ids)
        # A round that prefills is scored in its own prefill, as plain serving takes a
        # prompt's first token: it adds no row to the batched pass.
        assert joint.batch_size == single.batch_size == 1
        assert joint.prefilled == single.prefilled == len(request.context_ids) - 1


def test_cached_rounds_share_one_pass_and_equal_per_session_and_the_target(
    target: Target,
) -> None:
    runtime, _ = target
    batched_core = VerifierCore(runtime)
    single_cores = [VerifierCore(runtime) for _ in GREEDY_CASES]
    firsts = [greedy_case(f"s{i}", *case) for i, case in enumerate(GREEDY_CASES)]
    batched_core.verify_batch(firsts)
    requests = []
    for request, core, (prompt, start, wrong_at) in zip(
        firsts, single_cores, GREEDY_CASES, strict=True
    ):
        first = core.verify_batch([request])[0]
        reference = greedy_reference(prompt, 24)
        at = start + first.n_accepted + 1  # the committed answer after the first round
        context = prompt_ids(prompt) + reference[:at]
        requests.append(
            make_request(request.session_id, 1, context, draft_from(reference, at, K, wrong_at))
        )
    batched = batched_core.verify_batch(requests)
    singles = [core.verify_batch([r])[0] for core, r in zip(single_cores, requests, strict=True)]

    for request, joint, single, (prompt, _, wrong_at) in zip(
        requests, batched, singles, GREEDY_CASES, strict=True
    ):
        reference = greedy_reference(prompt, 24)
        at = len(request.context_ids) - len(prompt_ids(prompt))
        n = K if wrong_at is None else wrong_at
        assert verdict(joint) == verdict(single) == (n, reference[at + n], "")
        assert joint.batch_size == len(requests) and single.batch_size == 1
        assert joint.prefilled == single.prefilled == 0


@pytest.mark.parametrize("prompts", [(0, 4, 8), (12, 20, 30)])
def test_greedy_speculative_through_the_core_equals_target_only(
    target: Target, prompts: tuple[int, ...]
) -> None:
    """Several sessions decode in shared batches, with drafts right, wrong and empty."""
    runtime, tokenizer = target
    max_new = 20
    draft_lengths = [4, 0, 3, 4, 1, 2]
    wrong_positions = [None, None, 1, 0, None, 1]
    core = VerifierCore(runtime)
    generated: dict[int, list[int]] = {p: [] for p in prompts}
    round_index = n_requests = 0
    while True:
        active = [
            p
            for p in prompts
            if len(generated[p]) < max_new
            and not (generated[p] and generated[p][-1] == tokenizer.eos_id)
        ]
        if not active:
            break
        requests = []
        for offset, p in enumerate(active):
            reference = greedy_reference(p, max_new)
            slot = (round_index + offset) % len(draft_lengths)
            k = min(draft_lengths[slot], max_new - len(generated[p]) - 1)
            tokens = draft_from(reference, len(generated[p]), k, wrong_positions[slot])
            context = prompt_ids(p) + tuple(generated[p])
            requests.append(make_request(f"sess-{p}", round_index, context, tokens))
        for p, request, v in zip(active, requests, core.verify_batch(requests), strict=True):
            assert v.ok, v.error
            assert v.next_token is not None
            new = [*request.tokens[: v.n_accepted], v.next_token]
            if tokenizer.eos_id in new:
                new = new[: new.index(tokenizer.eos_id) + 1]
            generated[p] += new
        round_index += 1
        n_requests += len(requests)

    for p in prompts:
        assert generated[p][:max_new] == list(greedy_reference(p, max_new))
    stats = core.stats()
    assert stats.misses == len(prompts)  # each session prefilled once, then always a hit
    assert stats.hits == n_requests - len(prompts)


def sampled_request(session: str, prompt: int, seed: int, round_index: int) -> VerifyRequest:
    reference = greedy_reference(prompt, 12)
    tokens = list(reference[2 : 2 + K])
    # q' puts most mass on the drafted token and some on two others: a real top-3 cut.
    q_ids = [[t, (t + 7) % 49152, (t + 11) % 49152] for t in tokens]
    q_probs = [[0.6, 0.25, 0.15]] * K
    spec = SamplingSpec(temperature=0.8, top_p=0.95, seed=seed)
    context = prompt_ids(prompt) + reference[:2]
    return make_request(session, round_index, context, tokens, spec, q_ids, q_probs)


def test_sampled_verify_matches_the_rejection_sampler_on_the_targets_logits(
    target: Target,
) -> None:
    runtime, _ = target
    requests = [
        sampled_request(f"t{i}", prompt, seed, round_index)
        for i, (prompt, seed, round_index) in enumerate(
            [(0, 1, 0), (1, 2, 5), (2, 3, 9), (0, 4, 2)]
        )
    ]
    batched = VerifierCore(runtime).verify_batch(requests)
    for request, joint in zip(requests, batched, strict=True):
        cache = runtime.new_cache()
        context = list(request.context_ids)
        runtime.forward(context[:-1], cache)
        logits = runtime.forward([context[-1], *request.tokens], cache)
        assert request.q_ids is not None and request.q_probs is not None
        q = SparseDraftProbs(np.asarray(request.q_ids), np.asarray(request.q_probs))
        s = request.sampling
        expected = rejection_sample(
            request.tokens,
            q,
            logits,
            SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed),
            round_rng(s.seed, request.round),
        )
        single = VerifierCore(runtime).verify_batch([request])[0]
        assert verdict(joint) == verdict(single) == (expected.n_accepted, expected.next_token, "")


def test_miss_divergence_and_resend_reprefill_to_the_same_verdict(target: Target) -> None:
    runtime, _ = target
    reference = greedy_reference(3, 16)
    prompt = prompt_ids(3)
    core = VerifierCore(runtime)

    def check(request: VerifyRequest, prefilled: int) -> Verification:
        (warm,) = core.verify_batch([request])
        (cold,) = VerifierCore(runtime).verify_batch([request])
        assert verdict(warm) == verdict(cold)
        assert warm.ok and warm.prefilled == prefilled
        held = core.cached_tokens(request.session_id)
        assert held == [*request.context_ids, *request.tokens][: warm.base_len + warm.n_accepted]
        return warm

    first = make_request("s", 0, prompt, reference[:K])
    assert check(first, len(prompt) - 1).n_accepted == K
    # The next round: the cache holds context[:-1] exactly.
    second = make_request("s", 1, prompt + reference[: K + 1], reference[K + 1 : 2 * K + 1])
    check(second, 0)
    # A resend of round 0 after round 1: the cache is longer than the context and is cut back.
    check(first, 0)
    # The coordinator's context diverges a couple of tokens before the cache's end: a short tail,
    # prefilled inside the batched pass.
    base = len(prompt) + 2
    diverged = [*prompt, *reference[:2], reference[2] + 1, reference[3]]
    assert len(diverged) - 1 - base <= INLINE_PREFILL_MAX
    check(make_request("s", 2, diverged, reference[4:8]), len(diverged) - 1 - base)
    # A context that differs inside the prompt (another user turn): a long re-prefill.
    edited = list(prompt)
    edited[len(prompt) // 2] += 1
    check(make_request("s", 3, edited, reference[:K]), len(prompt) - 1 - len(prompt) // 2)
    stats = core.stats()
    assert (stats.hits, stats.misses) == (2, 3)


def test_lru_eviction_by_sessions_and_by_positions(target: Target) -> None:
    runtime, _ = target
    requests = {
        name: make_request(name, 0, prompt_ids(p), greedy_reference(p, 8)[:2])
        for name, p in (("a", 0), ("b", 1), ("c", 2), ("d", 3))
    }
    core = VerifierCore(runtime, max_sessions=2)
    for name in "abc":
        core.verify_batch([requests[name]])
    assert [core.cached_tokens(n) is not None for n in "abc"] == [False, True, True]
    core.verify_batch([requests["b"]])  # b becomes the most recent
    core.verify_batch([requests["d"]])
    assert [core.cached_tokens(n) is not None for n in "abcd"] == [False, True, False, True]
    assert core.stats().evictions == 2
    # An evicted session comes back through a full re-prefill, with the same verdict.
    (again,) = core.verify_batch([requests["a"]])
    (fresh,) = VerifierCore(runtime).verify_batch([requests["a"]])
    assert verdict(again) == verdict(fresh)
    assert again.prefilled == len(requests["a"].context_ids) - 1

    one_session = max(len(r.context_ids) + 2 for r in requests.values())
    small = VerifierCore(runtime, max_cached_positions=one_session + 1)
    small.verify_batch([requests["a"], requests["b"]])
    assert small.sessions_cached == 1
    assert small.cached_tokens("b") is not None  # the most recent one stays
    assert small.cached_positions <= one_session + 1


def test_refused_request_and_duplicate_session_in_one_batch(target: Target) -> None:
    runtime, _ = target
    good = greedy_case("g", 1, 3, 0)
    bad = make_request("b", 0, prompt_ids(2), [runtime.vocab_size + 5])
    results = VerifierCore(runtime).verify_batch([good, bad, good])
    assert [r.request_id for r in results] == [good.request_id, bad.request_id, good.request_id]
    assert results[0].ok and verdict(results[0]) == verdict(results[2])
    assert results[2].prefilled == 0  # the resend ran after the first, on its cache
    assert "vocabulary" in results[1].error


def test_sparse_q_pads_ragged_rows_with_zero_probability() -> None:
    request = make_request(
        "q",
        0,
        [1, 2],
        [5, 6],
        SamplingSpec(temperature=1.0),
        [[5, 9, 3], [6]],
        [[0.5, 0.3, 0.2], [1.0]],
    )
    q = sparse_q(request)
    assert q is not None and q.ids.shape == q.probs.shape == (2, 3)
    assert q.prob_of(0, 5) == 0.5 and q.prob_of(1, 6) == 1.0 and q.prob_of(1, 9) == 0.0
    np.testing.assert_allclose(q.dense(1, 10)[6], 1.0)
    assert sparse_q(make_request("g", 0, [1, 2], [5])) is None


@pytest.fixture(scope="module")
def host_drafters() -> HostDrafters:
    return HostDrafters(default_models_dir())


@pytest.mark.parametrize("draft", ["hybrid", "draft-l1"])
def test_cloud_rounds_drafted_by_the_host_equal_the_target_alone(
    target: Target, host_drafters: HostDrafters, draft: str
) -> None:
    """A cloud round carries no tokens: the host drafts them, and the batch verifies them."""
    runtime, tokenizer = target
    max_new = 20
    core = VerifierCore(runtime, drafters=host_drafters)
    prompts = (1, 9)
    generated: dict[int, list[int]] = {p: [] for p in prompts}
    ended: set[int] = set()
    drafted = round_index = 0
    while active := [p for p in prompts if p not in ended]:
        requests = [
            cloud_request(
                f"cloud-{draft}-{p}",
                round_index,
                prompt_ids(p) + tuple(generated[p]),
                draft,
                4,
                SamplingSpec(),
            )
            for p in active
        ]
        for p, v in zip(active, core.verify_batch(requests), strict=True):
            assert v.ok, v.error
            assert v.draft_tokens is not None and len(v.draft_tokens) <= 4
            assert v.q_ids is None  # greedy: no q'
            # A first round is scored in its own prefill; later ones share the pass.
            assert v.batch_size == (1 if v.prefilled else len(active))
            assert v.next_token is not None
            drafted += len(v.draft_tokens)
            generated[p] += [*v.draft_tokens[: v.n_accepted], v.next_token]
            if tokenizer.eos_id in generated[p] or len(generated[p]) >= max_new:
                ended.add(p)
        round_index += 1

    for p in prompts:
        reference = list(greedy_reference(p, max_new))
        assert generated[p][: len(reference)] == reference
    assert drafted > 0


@pytest.mark.parametrize("draft", ["hybrid", "hybrid+draft-l1"])
def test_a_lone_rows_long_match_copies_past_its_window_and_the_verdict_is_the_targets(
    target: Target, host_drafters: HostDrafters, draft: str
) -> None:
    """A context that ends with the start of a span it holds earlier: the hybrid's long match
    copies on. In a pass of its own row alone the copy runs past the window of 1 to the round's
    `cloud_reach`; beside another row the window holds. Either way the committed tokens are the
    target's own greedy continuation."""
    runtime, _ = target
    span = prompt_ids(2)
    context = (*span, *span[:12])
    reference = decode_target(runtime, context, 10, GREEDY).tokens

    def round_of(session: str) -> VerifyRequest:
        request = cloud_request(session, 3, context, draft, 1, SamplingSpec())
        return request.model_copy(update={"cloud_reach": 8})

    (lone,) = VerifierCore(runtime, drafters=host_drafters).verify_batch([round_of("lone")])
    beside, other = VerifierCore(runtime, drafters=host_drafters).verify_batch(
        [round_of("beside"), cloud_request("other", 3, prompt_ids(4), draft, 1, SamplingSpec())]
    )
    assert lone.ok and beside.ok and other.ok
    assert lone.draft_tokens is not None and 1 < len(lone.draft_tokens) <= 8
    assert lone.draft_tokens == tuple(span[12 : 12 + len(lone.draft_tokens)])  # the copy
    assert beside.draft_tokens is not None and len(beside.draft_tokens) <= 1
    for verification in (lone, beside):
        assert verification.draft_tokens is not None and verification.next_token is not None
        kept = [*verification.draft_tokens[: verification.n_accepted], verification.next_token]
        assert kept == list(reference[: len(kept)])


def test_sampled_cloud_rounds_send_q_and_are_reproducible(
    target: Target, host_drafters: HostDrafters
) -> None:
    runtime, _ = target
    spec = SamplingSpec(temperature=0.9, seed=7)
    context = prompt_ids(3)
    verdicts = []
    for attempt in range(2):
        core = VerifierCore(runtime, drafters=host_drafters)
        request = cloud_request(f"sampled-{attempt}", 5, context, "draft-l1", 3, spec)
        (v,) = core.verify_batch([request])
        assert v.ok, v.error
        assert v.draft_tokens is not None and v.q_ids is not None and v.q_probs is not None
        assert len(v.q_ids) == len(v.draft_tokens)
        for token, ids, probs in zip(v.draft_tokens, v.q_ids, v.q_probs, strict=True):
            assert token in ids
            assert sum(probs) == pytest.approx(1.0, abs=1e-6)
        verdicts.append((v.draft_tokens, v.n_accepted, v.next_token))
    assert verdicts[0] == verdicts[1]


@pytest.mark.parametrize(
    ("with_drafters", "draft", "reason"),
    [(False, "hybrid", "does not draft cloud rounds"), (True, "no-such-draft", "no drafter")],
)
def test_a_cloud_round_the_host_cannot_draft_fails_alone(
    target: Target, host_drafters: HostDrafters, with_drafters: bool, draft: str, reason: str
) -> None:
    runtime, _ = target
    core = VerifierCore(runtime, drafters=host_drafters if with_drafters else None)
    bad = cloud_request("bad", 0, prompt_ids(0), draft, 4, SamplingSpec())
    good = greedy_case("good", 0, 0, None)
    failed, served = core.verify_batch([bad, good])
    assert not failed.ok and reason in failed.error
    assert served.ok and served.n_accepted == K


def target_alone_hidden(runtime: OnnxRuntime, sequence: Sequence[int]) -> np.ndarray:
    """The target's hidden state at the last position of `sequence`, in a pass of its own."""
    ((_, hidden),) = runtime.forward_batch_hidden([(list(sequence), runtime.new_cache())])
    last: np.ndarray = hidden[-1]
    return last


def test_features_are_the_targets_hidden_state_where_next_token_was_chosen(
    target: Target,
) -> None:
    """Rows that ask get h_{n-1}: the hidden state at the last accepted position (or at the
    context's last token when none was accepted), as a target-alone pass computes it; rows that
    do not ask get none, and asking changes no verdict."""
    runtime, _ = target
    requests = [
        greedy_case(f"f{i}", *case).model_copy(update={"want_features": i % 2 == 0 or None})
        for i, case in enumerate(GREEDY_CASES)
    ]
    plain = VerifierCore(runtime).verify_batch(
        [r.model_copy(update={"want_features": None}) for r in requests]
    )
    results = VerifierCore(runtime).verify_batch(requests)
    assert [verdict(v) for v in results] == [verdict(v) for v in plain]
    assert all(v.features is None for v in plain)
    for request, result in zip(requests, results, strict=True):
        if not request.want_features:
            assert result.features is None
            continue
        assert result.features is not None
        features = features_from_wire(result.features)
        assert features.shape == (runtime.hidden_size,)
        accepted = request.tokens[: result.n_accepted]
        expected = target_alone_hidden(runtime, [*request.context_ids, *accepted])
        # fp16 on the wire (|h| <= ~50: steps of 2^-5 at the top) and batched kernels' last bits.
        np.testing.assert_allclose(features, expected, rtol=2e-3, atol=2e-3)


def test_a_target_without_the_hidden_output_verifies_without_features(tmp_path: Path) -> None:
    """A target built before the output existed (here a 2-layer cut of it): a round that asks
    is verified as usual and gets no features."""
    source = GgufModel()
    path = tmp_path / "no-hidden.onnx"
    onnx.save(build_decoder(source.config, source.weights(2), DecoderSpec(n_layers=2)), str(path))
    runtime = OnnxRuntime(path)
    assert not runtime.has_hidden
    request = greedy_case("no-hidden", 0, 0, None)
    core = VerifierCore(runtime)
    assert core.features is None
    (asked,) = core.verify_batch([request.model_copy(update={"want_features": True})])
    (plain,) = VerifierCore(runtime).verify_batch([request])
    assert asked.ok and asked.features is None
    assert verdict(asked) == verdict(plain)
