"""Drafters: prompt lookup, an n-gram table, a neural draft model, a feature head, and hybrids.

Every drafter has the shape of transformers' candidate generator: `get_candidates` proposes up
to k tokens after the committed context, and `update_candidate_strategy(n_accepted)` feeds the
verdict back. Drafters that hold a KV cache also `rollback(committed_len)`. A feature drafter
also hears the target's own features after each verdict (`give_features`).

A feature head's step is stateless, so the drafts of many sessions can share its calls: a
drafter that steps a head also drafts as a generator (`drafting`) that yields each step it needs
(`HeadCall`) and is sent the step's result, and `draft_together` runs many such drafts in
lockstep, one batched head call per step for all of them. On ONNX Runtime a call of 16 rows
took 1.9 ms where 16 calls of one took 20 (bench of the shipped head, 1 thread), and a row's
result is the same in a batch as alone (compared bit for bit), so the drafts are the ones each
session would get alone.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from inference.runtime import KVCache, Runtime
from inference.sampling import (
    IntArray,
    SparseDraftProbs,
    draft_sparse_probs,
    sample_sparse,
    softmax,
)


@dataclass(frozen=True)
class Candidates:
    """A proposal: the drafted tokens and the q' they were sampled from."""

    tokens: IntArray  # [n], n <= k
    # [n, K]; None for a deterministic proposal, which the verifier treats as q' one-hot.
    q: SparseDraftProbs | None

    def __post_init__(self) -> None:
        if self.q is not None and self.q.k != self.tokens.shape[0]:
            raise ValueError(f"q' has {self.q.k} rows for {self.tokens.shape[0]} tokens")

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def no_candidates() -> Candidates:
    return Candidates(tokens=np.zeros(0, dtype=np.int64), q=None)


class Proposer(Protocol):
    """Anything that drafts tokens for the verifier."""

    name: str

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        """Up to k tokens that may follow `context_ids` (the committed sequence so far).

        `rng` is the round's draft stream (sampling.round_rng(..., RngStream.DRAFT)); only a
        drafter that samples uses it.
        """
        ...

    def update_candidate_strategy(self, n_accepted: int) -> None:
        """The verdict of the last proposal: how many of its tokens the target accepted."""
        ...

    def rollback(self, committed_len: int) -> None:
        """Forget any state past the first `committed_len` tokens of the sequence."""
        ...


class PromptLookupProposer:
    """Copies from the context: finds the last n tokens earlier on and proposes what followed.

    It tries n from `max_ngram` down to `min_ngram` and takes the most recent earlier match.
    The proposal is a deterministic function of the context, so with sampling its q' is the
    one-hot on each proposed token, and verification with q' = one-hot stays exact: x is kept
    with probability p(x), and otherwise resampled from p with x removed.
    """

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_tokens: int | None = None,
        name: str = "lookup",
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # A short match predicts less far ahead than a long one; this caps what it proposes.
        self.max_tokens = max_tokens

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        if self.max_tokens is not None:
            k = min(k, self.max_tokens)
        tokens = lookup_continuation(
            np.asarray(context_ids, dtype=np.int64), k, self.max_ngram, self.min_ngram
        )
        return Candidates(tokens=tokens, q=None)

    def update_candidate_strategy(self, n_accepted: int) -> None:
        """Nothing to adapt: the match alone decides the proposal."""

    def rollback(self, committed_len: int) -> None:
        """Stateless: the proposal is recomputed from the context each round."""


def lookup_continuation(context: IntArray, k: int, max_ngram: int, min_ngram: int) -> IntArray:
    """The tokens that followed the most recent earlier occurrence of the context's tail # [<=k]."""
    length = int(context.shape[0])
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = context[length - n :]
        # Windows that start before the tail itself, so that something follows each of them.
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            return context[begin : begin + k].copy()
    return np.zeros(0, dtype=np.int64)


# An n-gram table file: magic, version, order, then per context length m = order-1 .. 1 a count
# and int32 rows of (context[m], next, count, total); lower orders are the backoff.
_NGRAM_MAGIC = b"SFNG"
_NGRAM_VERSION = 1


class NGramEntry(NamedTuple):
    """The most frequent continuation of one context, with how often it was seen (a tuple, so
    that loading a table of hundreds of thousands of them stays fast)."""

    next_token: int
    seen: int  # how often the context was followed by next_token
    total: int  # how often the context itself was seen with any continuation


@dataclass
class NGramTable:
    """For each context of 1 .. order-1 tokens, its most frequent next token in a corpus."""

    order: int
    entries: dict[tuple[int, ...], NGramEntry] = field(default_factory=dict)

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], order: int = 4) -> NGramTable:
        if order < 2:
            raise ValueError(f"order must be >= 2, got {order}")
        counts: dict[tuple[int, ...], Counter[int]] = {}
        for sequence in sequences:
            seq = [int(t) for t in sequence]
            for end in range(1, len(seq)):
                for m in range(1, min(order - 1, end) + 1):
                    counts.setdefault(tuple(seq[end - m : end]), Counter())[seq[end]] += 1
        entries = {}
        for ctx, counter in counts.items():
            # Ties go to the smaller token id, so that a rebuild gives the same file.
            next_token, count = min(counter.items(), key=lambda item: (-item[1], item[0]))
            entries[ctx] = NGramEntry(next_token, count, sum(counter.values()))
        return cls(order=order, entries=entries)

    def save(self, path: Path) -> None:
        """Write the table compactly; the same table always gives the same bytes."""
        parts = [_NGRAM_MAGIC, struct.pack("<II", _NGRAM_VERSION, self.order)]
        for m in range(self.order - 1, 0, -1):
            keys = sorted(ctx for ctx in self.entries if len(ctx) == m)
            rows = np.array(
                [
                    [*ctx, e.next_token, e.seen, e.total]
                    for ctx in keys
                    for e in (self.entries[ctx],)
                ],
                dtype="<i4",
            ).reshape(len(keys), m + 3)
            parts += [struct.pack("<I", len(keys)), rows.tobytes()]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(parts))

    @classmethod
    def load(cls, path: Path) -> NGramTable:
        blob = path.read_bytes()
        if blob[:4] != _NGRAM_MAGIC:
            raise ValueError(f"{path} is not an n-gram table")
        version, order = struct.unpack_from("<II", blob, 4)
        if version != _NGRAM_VERSION:
            raise ValueError(f"{path}: n-gram table version {version}, expected {_NGRAM_VERSION}")
        offset = 12
        entries: dict[tuple[int, ...], NGramEntry] = {}
        for m in range(order - 1, 0, -1):
            (n_rows,) = struct.unpack_from("<I", blob, offset)
            offset += 4
            rows = np.frombuffer(blob, dtype="<i4", count=n_rows * (m + 3), offset=offset)
            offset += rows.nbytes
            rows = rows.reshape(n_rows, m + 3)
            contexts = map(tuple, rows[:, :m].tolist())
            entries.update(zip(contexts, map(NGramEntry._make, rows[:, m:].tolist()), strict=True))
        return cls(order=order, entries=entries)

    def lookup(self, context: Sequence[int], min_context: int) -> NGramEntry | None:
        """The entry of the longest context tail (down to `min_context` tokens) in the table."""
        for m in range(min(self.order - 1, len(context)), min_context - 1, -1):
            entry = self.entries.get(tuple(context[len(context) - m :]))
            if entry is not None:
                return entry
        return None


class NGramTableProposer:
    """Chains the table's most frequent continuations, backing off to shorter contexts.

    A continuation is proposed only when it was seen at least `min_count` times and makes up at
    least `min_share` of its context's continuations; drafting stops at the first that is not.
    With `gate_after`, the first `gate_after` tokens need only be in the table, and the gate
    holds from there on: a chain's first steps are usually right, its long tails only where the
    table is sure. Deterministic, so q' is one-hot (see PromptLookupProposer).
    """

    def __init__(
        self,
        table: NGramTable,
        min_context: int = 2,
        min_count: int = 1,
        min_share: float = 0.0,
        max_tokens: int | None = None,
        gate_after: int = 0,
        name: str = "ngram",
    ) -> None:
        if not 1 <= min_context <= table.order - 1:
            raise ValueError(f"min_context must be in 1..{table.order - 1}, got {min_context}")
        if gate_after < 0:
            raise ValueError(f"gate_after must be >= 0, got {gate_after}")
        self.name = name
        self.table = table
        self.min_context = min_context
        self.min_count = min_count
        self.min_share = min_share
        self.gate_after = gate_after
        self.max_tokens = max_tokens  # a cap below k, as chained guesses degrade quickly

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        if self.max_tokens is not None:
            k = min(k, self.max_tokens)
        tail = [int(t) for t in context_ids[len(context_ids) - (self.table.order - 1) :]]
        proposed: list[int] = []
        for _ in range(k):
            entry = self.table.lookup(tail, self.min_context)
            if entry is None:
                break
            gated = len(proposed) >= self.gate_after
            if gated and (entry.seen < self.min_count or entry.seen < self.min_share * entry.total):
                break
            proposed.append(entry.next_token)
            tail = [*tail, entry.next_token][-(self.table.order - 1) :]
        return Candidates(tokens=np.asarray(proposed, dtype=np.int64), q=None)

    def update_candidate_strategy(self, n_accepted: int) -> None:
        """Nothing to adapt: the table is fixed."""

    def rollback(self, committed_len: int) -> None:
        """Stateless: the proposal is recomputed from the context each round."""


class NeuralProposer:
    """A draft model run by any Runtime, with its own KV cache kept in step with the context.

    Greedy drafting (temperature 0) proposes the draft's argmax and is deterministic (q' one-hot).
    Sampled drafting draws each token from q', the draft's softmax at `temperature` cut to its
    top `top_k` and renormalised, and returns q' for the verifier. Drafting stops early when the
    draft's top probability (at temperature 1) falls below `min_confidence`, after `min_tokens`.
    A runtime whose output axis is a subset of the vocabulary says which (`head_token_ids`).
    With `adaptive`, the window follows transformers' heuristic: +2 after a fully accepted
    proposal, -1 otherwise, never above the k asked for.
    """

    def __init__(
        self,
        runtime: Runtime,
        temperature: float = 0.0,
        top_k: int = 8,
        min_confidence: float = 0.0,
        min_tokens: int = 1,
        adaptive: bool = False,
        max_tokens: int | None = None,
        name: str | None = None,
    ) -> None:
        if temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.runtime = runtime
        self.name = name or runtime.name
        self.temperature = temperature
        self.top_k = top_k
        self.min_confidence = min_confidence
        self.min_tokens = min_tokens
        self.adaptive = adaptive
        self.max_tokens = max_tokens
        self.window: int | None = None
        self.output_ids = head_token_ids(runtime)
        self._cache: KVCache = runtime.new_cache()
        self._cached: list[int] = []  # the tokens whose positions the cache holds
        self._last_proposed = 0

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        if not context_ids:
            raise ValueError("the draft needs at least one context token")
        if self.temperature > 0.0 and rng is None:
            raise ValueError("a sampling draft needs the round's draft rng")
        if self.max_tokens is not None:
            k = min(k, self.max_tokens)
        if self.adaptive:
            self.window = k if self.window is None else min(self.window, k)
            k = self.window
        logits = self._sync(context_ids)
        tokens: list[int] = []
        rows: list[tuple[IntArray, npt.NDArray[np.float64]]] = []
        while len(tokens) < k:
            if self.min_confidence > 0.0 and len(tokens) >= self.min_tokens:
                top_prob = float(softmax(logits).max())
                if top_prob < self.min_confidence:
                    break
            if self.temperature == 0.0:
                column = int(logits.argmax())
                token = column if self.output_ids is None else int(self.output_ids[column])
            else:
                assert rng is not None
                ids, probs = draft_sparse_probs(logits, self.temperature, self.top_k)
                if self.output_ids is not None:
                    ids = self.output_ids[ids]
                token = sample_sparse(ids, probs, rng)
                rows.append((ids, probs))
            tokens.append(token)
            if len(tokens) < k:
                logits = self._feed([token])
        self._last_proposed = len(tokens)
        token_array = np.asarray(tokens, dtype=np.int64)
        if self.temperature == 0.0 or not rows:
            return Candidates(tokens=token_array, q=None)
        q = SparseDraftProbs(
            ids=np.stack([ids for ids, _ in rows]), probs=np.stack([p for _, p in rows])
        )
        return Candidates(tokens=token_array, q=q)

    def update_candidate_strategy(self, n_accepted: int) -> None:
        if not self.adaptive or self.window is None:
            return
        if n_accepted >= self._last_proposed:
            self.window += 2
        else:
            self.window = max(1, self.window - 1)

    def rollback(self, committed_len: int) -> None:
        if committed_len < len(self._cached):
            self._cache.trim(committed_len)
            del self._cached[committed_len:]

    def _sync(self, context_ids: Sequence[int]) -> npt.NDArray[np.float32]:
        """Bring the cache to the context, reusing the common prefix; the last row's logits."""
        common = 0
        limit = min(len(self._cached), len(context_ids) - 1)  # the last token is always re-fed
        while common < limit and self._cached[common] == context_ids[common]:
            common += 1
        self.rollback(common)
        return self._feed([int(t) for t in context_ids[common:]])

    def _feed(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        logits = self.runtime.forward(token_ids, self._cache)
        self._cached += token_ids
        last: npt.NDArray[np.float32] = logits[-1]
        return last


# The most tokens a feature drafter steps over on its own predicted features to catch a context
# up with its last real feature (a pre-drafted window is k + 1 ahead); further behind (tokens
# that came from a cloud stretch, a resync, local mode), it falls back as if it had none.
FEATURE_CATCH_UP_MAX = 16


class FeatureHeadStep(Protocol):
    """A feature head (`inference.feature_head.FeatureHead`): a stateless step over the target's
    hidden states, with logits over a reduced vocabulary."""

    name: str
    hidden_size: int
    vocab_ids: IntArray  # [V'] the target's token id of each logit column
    # Whether a call of many rows costs less than as many calls of one (ONNX Runtime's does;
    # LiteRT's resizes its tensors for every new batch size, 10.8 ms for 16 rows against 1.3
    # for one), so that `draft_together` batches the head's steps.
    batches_rows: bool

    def step(
        self, features: npt.NDArray[np.float32], tokens: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """(next_features # [B, H], logits # [B, V']) from features # [B, H], tokens # [B]."""
        ...


class HeadCall(NamedTuple):
    """One step a draft needs of a feature head: its next feature and logits after `token`
    from `feature` # [H]."""

    head: FeatureHeadStep
    feature: npt.NDArray[np.float32]
    token: int


# What a head step gives back: the next feature # [H] and the logits # [V'].
HeadReply = tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]
# A draft in progress: yields the head steps it needs, is sent each one's reply, and returns
# its proposal.
Drafting = Generator[HeadCall, HeadReply, Candidates]


@dataclass
class _Chain:
    """The head's steps from one real feature of the target: F(L) for a context of L tokens,
    then the tokens it consumed (context[L-1], then the context or its own drafts) and what each
    step gave."""

    length: int  # L
    feature: npt.NDArray[np.float32]  # [H]: the target's hidden state at context[L-2]
    consumed: list[int] = field(default_factory=list)
    features: list[npt.NDArray[np.float32]] = field(default_factory=list)  # [H] after each step
    logits: list[npt.NDArray[np.float32]] = field(default_factory=list)  # [V'] after each step


class FeatureProposer:
    """Drafts with a feature head from the target's own features (EAGLE-style).

    After a verdict that committed x_1..x_n the target's feature h_{n-1} (its hidden state at
    x_{n-1}, whose logits chose x_n) is at hand (`give_features`). The head then chains:
    step(h_{n-1}, x_n) gives the predicted feature at x_n and d_1, step(that, d_1) gives d_2, and
    so on. A context longer than the one the feature belongs to (a pre-drafted window) is
    caught up by stepping the head over the extra tokens on its own predicted features (up to
    FEATURE_CATCH_UP_MAX of them); steps already taken for the same tokens are reused. Without
    a feature (a session's first round, after a rewind, a verdict that carried none, a context
    too far ahead of it) it asks `fallback`, or proposes nothing. Greedy drafting proposes the
    head's argmax (q' one-hot); sampling draws from q', the head's softmax over its reduced
    vocabulary at `temperature` cut to the top `top_k` (zero outside it), as NeuralProposer
    does. `min_confidence`, `min_tokens` and `max_tokens` mean what they mean there.
    """

    wants_features = True

    def __init__(
        self,
        head: FeatureHeadStep,
        fallback: Proposer | None = None,
        temperature: float = 0.0,
        top_k: int = 8,
        min_confidence: float = 0.0,
        min_tokens: int = 1,
        max_tokens: int | None = None,
        name: str | None = None,
    ) -> None:
        if temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.head = head
        self.fallback = fallback
        self.name = name or head.name
        self.temperature = temperature
        self.top_k = top_k
        self.min_confidence = min_confidence
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self._chain: _Chain | None = None
        self._fell_back = False  # whether the last proposal was the fallback's
        self.head_rounds = 0  # proposals drafted by the head (the rest fell back)
        self.fallback_rounds = 0

    @property
    def has_features(self) -> bool:
        return self._chain is not None

    def give_features(self, features: npt.ArrayLike, committed_len: int) -> None:
        """The target's feature for a committed context of `committed_len` tokens: its hidden
        state at position committed_len - 2 # [H]. Raises ValueError for a wrong size."""
        feature = np.asarray(features, dtype=np.float32).reshape(-1)
        if feature.shape != (self.head.hidden_size,):
            raise ValueError(
                f"{self.name} drafts from {self.head.hidden_size} features, got {feature.shape[0]}"
            )
        if committed_len < 2:
            raise ValueError(f"a feature needs a context of >= 2 tokens, got {committed_len}")
        self._chain = _Chain(committed_len, feature)

    def forget_features(self) -> None:
        self._chain = None

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        return run_drafting(self.drafting(context_ids, k, rng))

    def drafting(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Drafting:
        """`get_candidates` as a generator of the head's steps (see `draft_together`)."""
        if self.temperature > 0.0 and rng is None:
            raise ValueError("a sampling draft needs the round's draft rng")
        chain = self._chain
        behind = -1 if chain is None else len(context_ids) - chain.length
        if chain is None or not 0 <= behind <= FEATURE_CATCH_UP_MAX:
            self._fell_back = self.fallback is not None
            if self.fallback is None:
                return no_candidates()
            self.fallback_rounds += 1
            return (yield from drafting(self.fallback, context_ids, k, rng))
        self._fell_back = False
        self.head_rounds += 1
        if self.max_tokens is not None:
            k = min(k, self.max_tokens)
        path = [int(t) for t in context_ids[chain.length - 1 :]]
        logits = yield from self._advance(chain, path)
        tokens: list[int] = []
        rows: list[tuple[IntArray, npt.NDArray[np.float64]]] = []
        while len(tokens) < k:
            unsure = self.min_confidence > 0.0 and len(tokens) >= self.min_tokens
            if unsure and float(softmax(logits).max()) < self.min_confidence:
                break
            if self.temperature == 0.0:
                token = int(self.head.vocab_ids[int(logits.argmax())])
            else:
                assert rng is not None
                ids, probs = draft_sparse_probs(logits, self.temperature, self.top_k)
                ids = self.head.vocab_ids[ids]
                token = sample_sparse(ids, probs, rng)
                rows.append((ids, probs))
            tokens.append(token)
            if len(tokens) < k:
                path.append(token)
                logits = yield from self._advance(chain, path)
        token_array = np.asarray(tokens, dtype=np.int64)
        if self.temperature == 0.0 or not rows:
            return Candidates(tokens=token_array, q=None)
        q = SparseDraftProbs(
            ids=np.stack([ids for ids, _ in rows]), probs=np.stack([p for _, p in rows])
        )
        return Candidates(tokens=token_array, q=q)

    def _advance(
        self, chain: _Chain, path: list[int]
    ) -> Generator[HeadCall, HeadReply, npt.NDArray[np.float32]]:
        """Step the head along `path` (the tokens after the feature's own position), reusing the
        steps already taken for a common prefix; the last step's logits # [V']."""
        common = 0
        limit = min(len(chain.consumed), len(path))
        while common < limit and chain.consumed[common] == path[common]:
            common += 1
        del chain.consumed[common:], chain.features[common:], chain.logits[common:]
        for token in path[common:]:
            feature = chain.features[-1] if chain.features else chain.feature
            next_feature, logits = yield HeadCall(self.head, feature, token)
            chain.consumed.append(token)
            chain.features.append(next_feature)
            chain.logits.append(logits)
        return chain.logits[-1]

    def update_candidate_strategy(self, n_accepted: int) -> None:
        if self._fell_back and self.fallback is not None:
            self.fallback.update_candidate_strategy(n_accepted)

    def rollback(self, committed_len: int) -> None:
        """A feature belongs to its context: a rewind before it drops it (and its steps)."""
        if self._chain is not None and committed_len < self._chain.length:
            self._chain = None
        if self.fallback is not None:
            self.fallback.rollback(committed_len)


def feature_drafters(proposer: Proposer) -> list[FeatureProposer]:
    """The feature drafters in a drafter: itself, or the parts of a hybrid."""
    if isinstance(proposer, FeatureProposer):
        return [proposer]
    if isinstance(proposer, HybridProposer):
        return [found for part in proposer.proposers for found in feature_drafters(part)]
    return []


def wants_features(proposer: Proposer) -> bool:
    """Whether the drafter has use for the target's features (its drafts ask for them)."""
    return bool(feature_drafters(proposer))


def give_features(proposer: Proposer, features: npt.ArrayLike, committed_len: int) -> None:
    """Hand the target's feature for a committed context of `committed_len` tokens to every
    feature drafter in `proposer`; ValueError when it does not fit one."""
    for drafter in feature_drafters(proposer):
        drafter.give_features(features, committed_len)


def forget_features(proposer: Proposer) -> None:
    """Drop the feature every feature drafter in `proposer` holds: they fall back until the next
    verdict brings one (local mode drafts without the target)."""
    for drafter in feature_drafters(proposer):
        drafter.forget_features()


def set_min_confidence(proposer: Proposer, min_confidence: float) -> None:
    """Stop drafting once the draft's top probability falls below `min_confidence`: in a neural
    drafter, and in the neural parts of a hybrid; copying drafters have no confidence to cut."""
    if isinstance(proposer, (NeuralProposer, FeatureProposer)):
        proposer.min_confidence = min_confidence
    elif isinstance(proposer, HybridProposer):
        for part in proposer.proposers:
            set_min_confidence(part, min_confidence)


def head_token_ids(runtime: Runtime) -> IntArray | None:
    """The vocabulary id of each output column of a trimmed head; None for a full head.

    ONNX drafts name them `head_ids`; other runtimes may call them `output_ids`.
    """
    for attribute in ("head_ids", "output_ids"):
        ids = getattr(runtime, attribute, None)
        if ids is not None:
            return np.asarray(ids, dtype=np.int64)
    return None


class HybridProposer:
    """Asks its drafters in order and takes the first non-empty proposal.

    With `fill`, a proposal shorter than k is extended by the following drafters from the
    context plus what is already proposed. A drafter named in `reaching` (a long match in the
    context) may propose up to a `reach` wider than k (`drafting`).
    """

    def __init__(
        self,
        proposers: Sequence[Proposer],
        fill: bool = False,
        name: str = "hybrid",
        reaching: Iterable[str] = (),
    ):
        if not proposers:
            raise ValueError("a hybrid needs at least one drafter")
        self.name = name
        self.proposers = list(proposers)
        self.fill = fill
        self.reaching = frozenset(reaching)
        self._used: list[tuple[Proposer, int]] = []  # who proposed how many, in order

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        return run_drafting(self.drafting(context_ids, k, rng))

    def drafting(
        self,
        context_ids: Sequence[int],
        k: int,
        rng: np.random.Generator | None = None,
        reach: int = 0,
    ) -> Drafting:
        """`get_candidates` as a generator of its drafters' head steps (`draft_together`).

        With `reach` > k, a drafter in `reaching` that proposes first may propose up to `reach`
        tokens; a proposal past k ends the window, nothing filled after it. Where a position
        costs the target little (a pass of one row), a long match copies as far as it goes, as
        a device's hybrid does with its own window, while the window the pass chose still
        bounds every other drafter (a neural one costs a step a token)."""
        self._used = []
        parts: list[Candidates] = []
        context = [int(t) for t in context_ids]
        for proposer in self.proposers:
            remaining = k - sum(part.n for part in parts)
            if remaining <= 0 or (parts and not self.fill):
                break
            reaches = not parts and reach > k and getattr(proposer, "name", "") in self.reaching
            budget = reach if reaches else remaining
            candidates = yield from drafting(proposer, context, budget, rng)
            if candidates.n:
                parts.append(candidates)
                self._used.append((proposer, candidates.n))
                context += candidates.tokens.tolist()
                if candidates.n > remaining:
                    break  # it ran past the window
        return concat_candidates(parts)

    def update_candidate_strategy(self, n_accepted: int) -> None:
        # Each drafter hears how much of its own part was accepted.
        offset = 0
        for proposer, n in self._used:
            proposer.update_candidate_strategy(max(0, min(n, n_accepted - offset)))
            offset += n

    def rollback(self, committed_len: int) -> None:
        for proposer in self.proposers:
            proposer.rollback(committed_len)


def concat_candidates(parts: Sequence[Candidates]) -> Candidates:
    """One proposal from consecutive parts; deterministic parts get one-hot rows of q'."""
    if not parts:
        return no_candidates()
    tokens = np.concatenate([part.tokens for part in parts])
    if all(part.q is None for part in parts):
        return Candidates(tokens=tokens, q=None)
    width = max(part.q.ids.shape[1] for part in parts if part.q is not None)
    ids = np.zeros((tokens.shape[0], width), dtype=np.int64)
    probs = np.zeros((tokens.shape[0], width), dtype=np.float64)
    row = 0
    for part in parts:
        if part.q is None:
            ids[row : row + part.n, 0] = part.tokens
            probs[row : row + part.n, 0] = 1.0
        else:
            ids[row : row + part.n, : part.q.ids.shape[1]] = part.q.ids
            probs[row : row + part.n, : part.q.ids.shape[1]] = part.q.probs
        row += part.n
    return Candidates(tokens=tokens, q=SparseDraftProbs(ids=ids, probs=probs))


# --- drafting by steps ---------------------------------------------------------------------------


def drafting(
    proposer: Proposer, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
) -> Drafting:
    """`proposer.get_candidates(...)` as a generator of its head steps: a drafter's own
    (`drafting`) where its `get_candidates` is the one that runs it (a subclass that overrides
    `get_candidates` is asked that instead), else one that yields nothing."""
    if getattr(type(proposer), "get_candidates", None) in _DRAFTS_BY_STEPS:
        steps: Drafting = proposer.drafting(context_ids, k, rng)  # type: ignore[attr-defined]
        return steps
    return _at_once(proposer, context_ids, k, rng)


def _at_once(
    proposer: Proposer, context_ids: Sequence[int], k: int, rng: np.random.Generator | None
) -> Drafting:
    return proposer.get_candidates(context_ids, k, rng)
    yield  # a generator that needs no step: unreachable, and what makes it one


def _step_alone(call: HeadCall) -> HeadReply:
    features, logits = call.head.step(call.feature.reshape(1, -1), [call.token])
    return features[0], logits[0]


def run_drafting(steps: Drafting) -> Candidates:
    """A draft run alone, each head step a call of one row."""
    try:
        call = next(steps)
        while True:
            call = steps.send(_step_alone(call))
    except StopIteration as done:
        result: Candidates = done.value
        return result


@dataclass
class Drafted:
    """One draft of `draft_together`: its proposal, or what it raised, and its time (its own
    steps, plus its share of each head call it was in)."""

    candidates: Candidates | None = None
    error: Exception | None = None
    ms: float = 0.0


def draft_together(drafts: Sequence[Drafting]) -> list[Drafted]:
    """Run `drafts` in lockstep: each step, every draft's pending head call goes into one call
    per head, of all their rows (a head that does not batch rows gets them one by one). A draft
    that raises fails alone. The drafts must not share a drafter's state (one per session)."""
    done = [Drafted() for _ in drafts]
    waiting: dict[int, HeadCall] = {}

    def advance(index: int, reply: HeadReply | None) -> None:
        started = time.perf_counter()
        try:
            steps = drafts[index]
            waiting[index] = next(steps) if reply is None else steps.send(reply)
        except StopIteration as finished:
            done[index].candidates = finished.value
        except Exception as exc:
            done[index].error = exc
        done[index].ms += (time.perf_counter() - started) * 1e3

    for index in range(len(drafts)):
        advance(index, None)
    while waiting:
        calls = list(waiting.items())
        waiting.clear()
        by_head: dict[int, list[tuple[int, HeadCall]]] = {}
        for index, call in calls:
            by_head.setdefault(id(call.head), []).append((index, call))
        for group in by_head.values():
            replies = _step_group(group)
            for (index, _), (reply, ms) in zip(group, replies, strict=True):
                done[index].ms += ms
                if isinstance(reply, Exception):
                    done[index].error = reply
                    drafts[index].close()
                else:
                    advance(index, reply)
    return done


def _step_group(
    group: list[tuple[int, HeadCall]],
) -> list[tuple[HeadReply | Exception, float]]:
    """One head's pending steps: one call of all of them where the head batches rows, each
    row's reply a copy (a draft keeps it past the call); each with its share of the time."""
    head = group[0][1].head
    if len(group) == 1 or not getattr(head, "batches_rows", False):
        return [_timed_step(call) for _, call in group]
    started = time.perf_counter()
    replies: list[HeadReply | Exception]
    try:
        features, logits = head.step(
            np.stack([call.feature for _, call in group]), [call.token for _, call in group]
        )
    except Exception as exc:
        replies = [exc] * len(group)
    else:
        replies = [(np.array(features[row]), np.array(logits[row])) for row in range(len(group))]
    share = (time.perf_counter() - started) * 1e3 / len(group)
    return [(reply, share) for reply in replies]


def _timed_step(call: HeadCall) -> tuple[HeadReply | Exception, float]:
    started = time.perf_counter()
    reply: HeadReply | Exception
    try:
        reply = _step_alone(call)
    except Exception as exc:
        reply = exc
    return reply, (time.perf_counter() - started) * 1e3


# The `get_candidates` that run a drafter's `drafting` (see `drafting`).
_DRAFTS_BY_STEPS: frozenset[Any] = frozenset(
    {FeatureProposer.get_candidates, HybridProposer.get_candidates}
)
