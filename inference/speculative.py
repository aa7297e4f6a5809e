"""Decoding in one process: the target alone, or speculative with a drafter, with no bus between.

Both loops keep the same invariant: the target's cache holds every committed token but the
last, which is "pending" and goes first into the next target pass. A target-only step is then a
speculative round with an empty draft: one pass over [pending] gives the next token's logits;
a round with k drafted tokens runs one pass over [pending, d_1..d_k], whose k+1 logits rows
score each drafted position and the bonus position. Round r draws its random numbers from
round_rng(seed, r), so target-only and speculative runs are each reproducible from the seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from inference.proposers import Proposer, give_features, no_candidates, wants_features
from inference.runtime import FeatureRuntime, Features, KVCache, Logits, Runtime
from inference.sampling import RngStream, SamplingParams, rejection_sample, round_rng

StopReason = Literal["eos", "max_tokens"]


@dataclass(frozen=True)
class RoundStats:
    """One target pass: how many tokens were drafted and accepted, and what each side cost."""

    k: int  # tokens drafted this round (0 for a target-only step)
    n_accepted: int
    draft_ms: float
    verify_ms: float  # the target pass, the rejection sampler and the cache trim


@dataclass(frozen=True)
class DecodeResult:
    """The generated tokens (the prompt excluded) and how they were made."""

    tokens: list[int]  # [n_generated]; ends with the eos token when stopped by it
    rounds: list[RoundStats]
    prefill_ms: float
    decode_ms: float  # wall clock after the prefill
    stopped_by: StopReason
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def target_passes(self) -> int:
        return len(self.rounds)

    @property
    def n_drafted(self) -> int:
        return sum(r.k for r in self.rounds)

    @property
    def n_accepted(self) -> int:
        return sum(r.n_accepted for r in self.rounds)

    @property
    def tokens_per_pass(self) -> float:
        """Committed tokens per target pass after the prefill (1.0 for the target alone)."""
        return len(self.tokens) / self.target_passes if self.rounds else 0.0

    @property
    def draft_ms(self) -> float:
        return sum(r.draft_ms for r in self.rounds)

    @property
    def verify_ms(self) -> float:
        return sum(r.verify_ms for r in self.rounds)

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    def content_tokens(self) -> list[int]:
        """The tokens without a final eos."""
        if self.tokens and self.tokens[-1] in self.eos_ids:
            return self.tokens[:-1]
        return list(self.tokens)


def _eos_set(eos: int | Collection[int] | None) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset({eos})
    return frozenset(int(t) for t in eos)


def _check(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def decode_target(
    target: Runtime,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos: int | Collection[int] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> DecodeResult:
    """Generate with the target alone, one pass per token."""
    return decode_speculative(target, None, prompt_ids, 0, max_new_tokens, params, eos, on_tokens)


def decode_speculative(
    target: Runtime,
    proposer: Proposer | None,
    prompt_ids: Sequence[int],
    k: int,
    max_new_tokens: int,
    params: SamplingParams,
    eos: int | Collection[int] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> DecodeResult:
    """Generate with a drafter proposing up to k tokens a round and the target verifying them.

    Greedy output is token-identical to `decode_target`; sampled output follows the same
    distribution. A round never drafts more than fits in `max_new_tokens`, and nothing after an
    eos token is kept, exactly as the target alone would stop. `on_tokens` hears each round's
    committed tokens as soon as they are final. A feature drafter gets the target's feature
    after each round, as a verdict brings it over the bus (none before the first round).
    """
    _check(prompt_ids, max_new_tokens)
    if k < 0 or (proposer is not None and k < 1):
        raise ValueError(f"k must be >= 1 with a drafter, got {k}")
    eos_ids = _eos_set(eos)
    features_from: FeatureRuntime | None = None
    feature_drafting = proposer is not None and wants_features(proposer)
    if feature_drafting and isinstance(target, FeatureRuntime) and target.has_hidden:
        features_from = target
    committed = [int(t) for t in prompt_ids]
    generated: list[int] = []
    rounds: list[RoundStats] = []

    start = time.perf_counter()
    cache = target.new_cache()
    if len(committed) > 1:
        target.forward(committed[:-1], cache)
    if proposer is not None:
        proposer.rollback(0)  # a drafter may be reused across prompts
    decode_start = time.perf_counter()

    stopped_by: StopReason = "max_tokens"
    round_index = 0
    while len(generated) < max_new_tokens:
        # Accepted tokens plus the target's own token must fit in what is left.
        k_round = min(k, max_new_tokens - len(generated) - 1)
        t0 = time.perf_counter()
        if proposer is not None and k_round > 0:
            draft_rng = round_rng(params.seed, round_index, RngStream.DRAFT)
            candidates = proposer.get_candidates(committed, k_round, draft_rng)
        else:
            candidates = no_candidates()
        t1 = time.perf_counter()
        base_len = len(committed)
        window = [committed[-1], *candidates.tokens.tolist()]
        logits, hidden = _score(target, features_from, window, cache)
        verdict = rejection_sample(
            candidates.tokens,
            candidates.q,
            logits,
            params,
            round_rng(params.seed, round_index, RngStream.VERIFY),
        )
        # The cache now holds every drafted position; keep the accepted ones only, so that
        # next_token becomes the pending token of the next round.
        cache.trim(base_len + verdict.n_accepted)
        t2 = time.perf_counter()

        rounds.append(
            RoundStats(
                k=candidates.n,
                n_accepted=verdict.n_accepted,
                draft_ms=(t1 - t0) * 1e3,
                verify_ms=(t2 - t1) * 1e3,
            )
        )
        if proposer is not None:
            proposer.update_candidate_strategy(verdict.n_accepted)
            # The drafted token at the first rejected position was replaced by next_token, so
            # only the accepted prefix of the draft's own state is still valid.
            proposer.rollback(base_len + verdict.n_accepted)
        new_tokens = [*candidates.tokens[: verdict.n_accepted].tolist(), verdict.next_token]
        for index, token in enumerate(new_tokens):
            if token in eos_ids:
                stopped_by = "eos"
                del new_tokens[index + 1 :]
                break
        generated += new_tokens
        committed += new_tokens
        if proposer is not None and hidden is not None and stopped_by != "eos":
            # Row n_accepted scored the position that chose next_token: h_{n-1}.
            give_features(proposer, hidden[verdict.n_accepted], len(committed))
        if on_tokens is not None:
            on_tokens(new_tokens)
        if stopped_by == "eos":
            break
        round_index += 1

    end = time.perf_counter()
    return DecodeResult(
        tokens=generated,
        rounds=rounds,
        prefill_ms=(decode_start - start) * 1e3,
        decode_ms=(end - decode_start) * 1e3,
        stopped_by=stopped_by,
        eos_ids=eos_ids,
    )


def _score(
    target: Runtime, features_from: FeatureRuntime | None, window: list[int], cache: KVCache
) -> tuple[Logits, Features | None]:
    """One target pass over a round's window: its logits, and its hidden states when a feature
    drafter wants them # [len(window), V], [len(window), H]."""
    if features_from is None:
        return target.forward(window, cache), None
    ((logits, hidden),) = features_from.forward_batch_hidden([(window, cache)])
    return logits, hidden


def greedy_acceptance(
    proposer: Proposer,
    context_ids: Sequence[int],
    target_tokens: Sequence[int],
    k: int = 1,
    hidden: Features | None = None,
) -> tuple[int, int]:
    """Along the target's greedy continuation, how often the drafter's first token matches.

    Returns (matches, positions): at every position of `target_tokens` the drafter proposes
    from the true prefix, and its first proposed token is compared with the target's; the
    drafter must be greedy (it gets no rng). A drafter
    that proposes nothing at a position counts as a miss, as it saves nothing there. A feature
    drafter gets, at each position, the target's feature for the prefix from `hidden`, the
    target's hidden states over context_ids + target_tokens # [len, H].
    """
    context = [int(t) for t in context_ids]
    proposer.rollback(0)
    matches = 0
    for token in target_tokens:
        if hidden is not None and len(context) >= 2:
            give_features(proposer, hidden[len(context) - 2], len(context))
        candidates = proposer.get_candidates(context, k)
        if candidates.n and int(candidates.tokens[0]) == int(token):
            matches += 1
        context.append(int(token))
    return matches, len(target_tokens)


def replay_greedy(
    proposer: Proposer,
    prompt_ids: Sequence[int],
    target_tokens: Sequence[int],
    k: int,
    max_new_tokens: int,
    hidden: Features | None = None,
) -> DecodeResult:
    """Greedy speculative decoding replayed along the target's known greedy output.

    Greedy speculative output equals the target's own, so a round's verdict follows from the
    drafted tokens alone: the longest prefix that matches `target_tokens`, then the target's
    next token. This gives the rounds of `decode_speculative` with greedy sampling without
    running the target, in the drafter's time only (the rounds' verify_ms is 0): the same
    passes and drafted counts, and the same accepted counts but where a draft runs past the
    target's eos (the target may accept those positions too before they are cut).
    `target_tokens` is the target's greedy output for `max_new_tokens`, ending at its eos if
    it stopped there. A feature drafter gets, after each round as a verdict brings it (none
    before the first), the target's feature from `hidden`, its hidden states over prompt_ids +
    target_tokens # [len, H] (one prefill's; a verify pass's differ from them by rounding only).
    """
    _check(prompt_ids, max_new_tokens)
    if k < 1:
        raise ValueError(f"k must be >= 1 with a drafter, got {k}")
    path = [int(t) for t in target_tokens]
    if len(path) > max_new_tokens:
        raise ValueError(f"{len(path)} target tokens for max_new_tokens={max_new_tokens}")
    committed = [int(t) for t in prompt_ids]
    generated = 0
    rounds: list[RoundStats] = []
    proposer.rollback(0)
    start = time.perf_counter()
    while generated < len(path):
        k_round = min(k, max_new_tokens - generated - 1)
        t0 = time.perf_counter()
        candidates = proposer.get_candidates(committed, k_round) if k_round > 0 else None
        drafted = [] if candidates is None else candidates.tokens.tolist()
        t1 = time.perf_counter()
        n_accepted = 0
        while (
            n_accepted < len(drafted)
            and generated + n_accepted < len(path)
            and drafted[n_accepted] == path[generated + n_accepted]
        ):
            n_accepted += 1
        rounds.append(RoundStats(len(drafted), n_accepted, (t1 - t0) * 1e3, 0.0))
        proposer.update_candidate_strategy(n_accepted)
        proposer.rollback(len(committed) + n_accepted)
        # The accepted tokens and the target's own next one, never past its end (its eos).
        new_tokens = path[generated : generated + n_accepted + 1]
        committed += new_tokens
        generated += len(new_tokens)
        if hidden is not None and generated < len(path):
            give_features(proposer, hidden[len(committed) - 2], len(committed))
    return DecodeResult(
        tokens=path,
        rounds=rounds,
        prefill_ms=0.0,
        decode_ms=(time.perf_counter() - start) * 1e3,
        stopped_by="max_tokens" if len(path) == max_new_tokens else "eos",
    )


def apply_stop_rules(
    generated_len: int, accepted: list[int], next_token: int, max_tokens: int, eos_id: int
) -> tuple[list[int], bool]:
    """The tokens a target-only decoder would also have emitted, and whether the output ended.

    It stops after the first eos (kept) or at max_tokens generated tokens. The caller reports
    the last kept token as the round's `next_token`, so a verdict always commits >= 1 token.
    """
    kept: list[int] = []
    for token in [*accepted, next_token]:
        kept.append(token)
        if token == eos_id or generated_len + len(kept) >= max_tokens:
            return kept, True
    return kept, False
