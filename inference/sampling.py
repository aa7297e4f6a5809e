"""Verification math of speculative decoding: target distributions and the rejection sampler.

Implements Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1, and the equivalent speculative sampling of Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling". Names follow the papers: p is the target's
distribution, q the draft's (here q', its top-K cut, which is what the draft samples from and
what it sends), and p_prime = norm(max(0, p - q)) the residual a rejected token is resampled from.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next token is chosen; temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SparseDraftProbs:
    """q': per drafted position, the draft's top-K token ids and their renormalised probabilities.

    Rows may be padded with probability 0 (a one-hot row of a deterministic proposal, say).
    """

    ids: IntArray  # [k, K]
    probs: FloatArray  # [k, K], each row sums to 1

    def __post_init__(self) -> None:
        if self.ids.ndim != 2 or self.ids.shape != self.probs.shape:
            raise ValueError(
                f"ids and probs must both be [k, K], got {self.ids.shape} and {self.probs.shape}"
            )

    @property
    def k(self) -> int:
        return int(self.ids.shape[0])

    def prob_of(self, position: int, token: int) -> float:
        """q'(token) at one drafted position; 0 when the token is outside the top-K."""
        row = self.probs[position]
        hit = self.ids[position] == token
        return float(row[hit].sum() / row.sum())

    def dense(self, position: int, vocab_size: int) -> FloatArray:
        """q' at one position as a full distribution # [V]."""
        q = np.zeros(vocab_size, dtype=np.float64)
        np.add.at(q, self.ids[position], self.probs[position].astype(np.float64))
        out: FloatArray = q / q.sum()
        return out


@dataclass(frozen=True)
class VerifyResult:
    """The verdict of one round: accept the first n_accepted drafted tokens, then next_token."""

    n_accepted: int
    next_token: int


class RngStream(enum.IntEnum):
    """Independent random streams derived from one (session seed, round)."""

    DRAFT = 0  # the draft sampling its tokens from q'
    VERIFY = 1  # the verifier's acceptance tests and resampling


def round_rng(
    session_seed: int, round_index: int, stream: RngStream = RngStream.VERIFY
) -> np.random.Generator:
    """The generator of one stream of one round: a function of (seed, round, stream) only.

    Seeding from SeedSequence([seed, round]) and spawning one child per stream means that a
    re-verified round draws the same numbers, whichever process or host runs it, and that the
    draft's draws never shift the verifier's.
    """
    seq = np.random.SeedSequence([session_seed, round_index], spawn_key=(int(stream),))
    return np.random.Generator(np.random.PCG64(seq))


def softmax(logits: npt.NDArray[np.floating], temperature: float = 1.0) -> FloatArray:
    """softmax(logits / temperature) along the last axis, in float64 # [..., V]."""
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    out: FloatArray = e / e.sum(axis=-1, keepdims=True)
    return out


def target_probs(logits: npt.NDArray[np.floating], params: SamplingParams) -> FloatArray:
    """p: the target's sampling distribution per row # [..., V] from logits # [..., V].

    Greedy gives a one-hot row on the argmax. Otherwise temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches top_p; ties broken by token id).
    """
    if params.greedy:
        one_hot = np.zeros(logits.shape, dtype=np.float64)
        np.put_along_axis(one_hot, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return one_hot
    p = softmax(logits, params.temperature)
    if params.top_k is None and params.top_p >= 1.0:
        return p
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    keep_sorted = np.ones(sorted_p.shape, dtype=bool)
    if params.top_k is not None:
        keep_sorted[..., params.top_k :] = False
    if params.top_p < 1.0:
        # Keep a token when the mass before it is still short of top_p, so the first always stays.
        mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted &= mass_before < params.top_p
    keep = np.zeros(p.shape, dtype=bool)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    cut = np.where(keep, p, 0.0)
    out: FloatArray = cut / cut.sum(axis=-1, keepdims=True)
    return out


def draft_sparse_probs(
    logits: npt.NDArray[np.floating], temperature: float, top_k: int
) -> tuple[IntArray, FloatArray]:
    """q' at one position: the draft's top-K ids # [K] and renormalised probabilities # [K].

    The draft's own distribution is softmax(logits / temperature); greedy drafting (temperature
    0) gives a one-hot q' on the argmax, padded to K with probability 0.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    flat = logits.reshape(-1)
    k = min(top_k, flat.shape[0])
    top = np.argpartition(-flat, k - 1)[:k]
    top = top[np.argsort(-flat[top], kind="stable")].astype(np.int64)
    if temperature == 0.0:
        probs = np.zeros(k, dtype=np.float64)
        probs[0] = 1.0
        return top, probs
    z = flat[top].astype(np.float64) / temperature
    e = np.exp(z - z.max())
    return top, e / e.sum()


def sample_sparse(ids: IntArray, probs: FloatArray, rng: np.random.Generator) -> int:
    """Draw one token from a sparse distribution (ids # [K], probs # [K])."""
    p = probs.astype(np.float64)
    return int(ids[int(rng.choice(p.shape[0], p=p / p.sum()))])


def sample_dense(p: FloatArray, rng: np.random.Generator) -> int:
    """Draw one token id from a full distribution p # [V] by inverting its CDF."""
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), p.shape[0] - 1))


def one_hot_draft(tokens: Sequence[int]) -> SparseDraftProbs:
    """q' of a deterministic proposal: probability 1 on each proposed token."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
    return SparseDraftProbs(ids=ids, probs=np.ones(ids.shape, dtype=np.float64))


def rejection_sample(
    draft_tokens: Sequence[int] | IntArray,  # [k]
    q_sparse: SparseDraftProbs | None,  # [k, K]; None: a deterministic proposal (q' one-hot)
    target_logits: npt.NDArray[np.floating],  # [k+1, V]: row i scores position i of the draft
    params: SamplingParams,
    rng: np.random.Generator,
) -> VerifyResult:
    """Verify k drafted tokens against the target (Leviathan et al. 2023, Algorithm 1).

    Greedy: accept the longest prefix that matches the target's argmax, then emit the target's
    own token at the first mismatch (or the bonus token at position k when all match).

    Sampling: accept draft token x at position i with probability min(1, p(x) / q'(x)); at the
    first rejection emit a token drawn from p_prime = norm(max(0, p - q')) and stop; when all k
    are accepted, draw the bonus token from p at position k. The emitted sequence then follows
    the target's distribution exactly, whatever q' is, provided the draft sampled from q'.
    """
    draft = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    k = int(draft.shape[0])
    if target_logits.ndim != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must be [k+1, V] = [{k + 1}, V], got {target_logits.shape}"
        )
    if q_sparse is not None and q_sparse.k != k:
        raise ValueError(f"q' has {q_sparse.k} rows for {k} drafted tokens")

    if params.greedy:
        best = target_logits.argmax(axis=-1)
        mismatch = np.flatnonzero(best[:k] != draft)
        n = int(mismatch[0]) if mismatch.size else k
        return VerifyResult(n_accepted=n, next_token=int(best[n]))

    vocab_size = int(target_logits.shape[1])
    p = target_probs(target_logits, params)
    for i in range(k):
        x = int(draft[i])
        q_x = 1.0 if q_sparse is None else q_sparse.prob_of(i, x)
        if q_x <= 0.0:
            raise ValueError(f"drafted token {x} at position {i} has q'(x) = 0")
        # u < p/q with u ~ U[0, 1) accepts with probability min(1, p/q).
        if rng.random() * q_x < p[i, x]:
            continue
        if q_sparse is None:
            q = np.zeros(vocab_size, dtype=np.float64)
            q[x] = 1.0
        else:
            q = q_sparse.dense(i, vocab_size)
        residual = np.maximum(p[i] - q, 0.0)
        # A rejection implies p(x) < q'(x), so the residual has mass; guard against rounding.
        p_prime = residual if residual.sum() > 0.0 else p[i]
        return VerifyResult(n_accepted=i, next_token=sample_dense(p_prime, rng))
    return VerifyResult(n_accepted=k, next_token=sample_dense(p[k], rng))
