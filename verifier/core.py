"""Batched verification of drafts against the target, with an LRU of per-session KV caches.

Each cached session holds `context[:-1]` of its last request, so a round is one pass over
`[context[-1]] + tokens`, which scores every drafted position plus the bonus position (the
invariant of `inference.speculative`). A request whose context the cache does not hold as a
prefix (a miss, another verifier served the last round, a resend) is trimmed to the common
prefix and the rest is prefilled; only short tails ride inside the batched pass, since a long
one would pad every other sequence of the batch to its length.

A cloud round names a drafter instead of carrying tokens: the host drafts its window first
(`verifier.drafting`), and the window then rides in the batched pass like any other.

The target's hidden state at the position whose logits chose a round's next token is what a
feature drafter chains from. A device's draft that asks for it (`want_features`) gets it in its
verdict; a session whose drafter on this host wants it (its cloud rounds, and from then on its
plain stream rounds too) has it handed to that drafter after the verdict, and nothing of it goes
on the bus. A pass copies the hidden states out only when one of its rows needs them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from broker.messages import VerifyRequest
from inference.drafters import DrafterError
from inference.features import features_to_wire
from inference.runtime import FeatureRuntime, Features, KVCache, Logits, Runtime
from inference.sampling import (
    SamplingParams,
    SparseDraftProbs,
    rejection_sample,
    round_rng,
)
from verifier.drafting import HostDraft, HostDrafters, session_waves

log = logging.getLogger(__name__)

# A missing tail of at most this many positions joins the batched pass; a longer one is
# prefilled on its own first. Every row of a batch is padded to the longest row, so a tail of
# t tokens costs the whole batch about t extra rows.
INLINE_PREFILL_MAX = 4
# Prefill in chunks: the graph returns logits for every position (196 KiB each), so one pass over
# thousands of tokens would allocate gigabytes of logits nobody reads.
PREFILL_CHUNK = 512
MAX_SESSIONS = 256
# 2**20 positions of SmolLM2-135M in fp32 (46 KiB each) is about 45 GiB, so the practical bound
# is set by the caller from its memory budget (see `kv_bytes_per_position`).
MAX_CACHED_POSITIONS = 1 << 20


def kv_bytes_per_position(n_layers: int, n_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
    """Bytes one cached position takes: keys and values of every layer."""
    return 2 * n_layers * n_kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class Verification:
    """The target's answer to one VerifyRequest, or the reason there is none (`error`)."""

    request_id: str
    session_id: str
    round: int
    base_len: int  # len(context_ids)
    n_accepted: int = 0
    next_token: int | None = None
    error: str = ""
    prefilled: int = 0  # positions computed before this request's window (0 on a cache hit)
    batch_size: int = 1  # windows scored by the forward pass that scored this one
    # A cloud round: the window this host drafted, q' when sampling, and what drafting took.
    draft_tokens: tuple[int, ...] | None = None  # [k]
    q_ids: tuple[tuple[int, ...], ...] | None = None  # [k, K]
    q_probs: tuple[tuple[float, ...], ...] | None = None  # [k, K]
    draft_ms: float = 0.0
    # Asked for: the hidden state at the position that chose next_token, in its wire form.
    features: str | None = None

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class CoreStats:
    sessions_cached: int
    cached_positions: int
    hits: int  # requests whose context the cache already held
    misses: int  # requests that needed a prefill (new session, eviction, divergence)
    prefilled_positions: int
    evictions: int


@dataclass
class _Session:
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # [cache.length]: the ids the cache holds


@dataclass
class _Row:
    """One request's share of the batched pass."""

    index: int  # position of the request in the caller's list
    request: VerifyRequest
    session: _Session
    ids: list[int]  # [tail + 1 + k]: inline prefill tail, context[-1], then the draft
    prefilled: int


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    mismatch = np.flatnonzero(
        np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    )
    return int(mismatch[0]) if mismatch.size else n


def sparse_q(request: VerifyRequest) -> SparseDraftProbs | None:
    """q' of a request as [k, K] arrays; rows shorter than the longest are padded with p = 0."""
    if request.q_ids is None or request.q_probs is None:
        return None
    width = max((len(row) for row in request.q_ids), default=1)
    k = len(request.q_ids)
    ids = np.zeros((k, width), dtype=np.int64)
    probs = np.zeros((k, width), dtype=np.float64)
    for i, (row_ids, row_probs) in enumerate(zip(request.q_ids, request.q_probs, strict=True)):
        ids[i, : len(row_ids)] = row_ids
        ids[i, len(row_ids) :] = row_ids[0]
        probs[i, : len(row_probs)] = row_probs
    return SparseDraftProbs(ids=ids, probs=probs)


class VerifierCore:
    """Verifies batches of VerifyRequests on one runtime; owns the sessions' KV caches."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_sessions: int = MAX_SESSIONS,
        max_cached_positions: int = MAX_CACHED_POSITIONS,
        max_positions: int | None = None,
        drafters: HostDrafters | None = None,
    ) -> None:
        if max_sessions < 1 or max_cached_positions < 1:
            raise ValueError("max_sessions and max_cached_positions must be >= 1")
        self.runtime = runtime
        self.max_sessions = max_sessions
        self.max_cached_positions = max_cached_positions
        self.max_positions = max_positions  # the model's context length, when it has one
        self.drafters = drafters  # None: this host refuses cloud rounds
        # None: the target has no hidden output, and rounds that ask for features get none.
        self.features: FeatureRuntime | None = (
            runtime if isinstance(runtime, FeatureRuntime) and runtime.has_hidden else None
        )
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recent first
        self._hits = 0
        self._misses = 0
        self._prefilled = 0
        self._evictions = 0

    # -- public ---------------------------------------------------------------------------

    def verify_batch(self, requests: Sequence[VerifyRequest]) -> list[Verification]:
        """Verify every request; results come in the order of `requests`.

        Requests for distinct sessions share one forward pass. A session that appears twice (a
        resend) is verified again in a second pass, after the first, since both need its cache.
        """
        results: list[Verification | None] = [None] * len(requests)
        requests = list(requests)
        drafted = self._draft_cloud_rounds(requests, results)
        ready: list[tuple[int, str]] = []
        for index, request in enumerate(requests):
            if results[index] is not None:
                continue
            error = self._refusal(request)
            if error:
                results[index] = _failed(request, error)
                continue
            ready.append((index, request.session_id))
        for wave_indices in session_waves(ready):
            for index, verification in self._verify_wave(requests, wave_indices):
                results[index] = verification
            self._evict()
        for index, host in drafted.items():
            done = results[index]
            assert done is not None
            q = host.q_rows
            results[index] = replace(
                done,
                draft_tokens=host.tokens,
                q_ids=None if q is None else q[0],
                q_probs=None if q is None else q[1],
                draft_ms=host.draft_ms,
            )
        return [r for r in results if r is not None]

    def _draft_cloud_rounds(
        self, requests: list[VerifyRequest], results: list[Verification | None]
    ) -> dict[int, HostDraft]:
        """Draft the cloud rounds among `requests` here, all together (`HostDrafters.draft_many`),
        each replaced by the request as if the device had sent its window; a round whose
        drafting failed gets its failure in `results`. The windows drafted, by index."""
        cloud = [index for index, request in enumerate(requests) if request.cloud_k is not None]
        if not cloud:
            return {}
        if self.drafters is None:
            refusal = DrafterError("this verifier does not draft cloud rounds")
            windows: list[HostDraft | Exception] = [refusal] * len(cloud)
        else:
            # The pass's only row: its extra positions cost the target little, and a long
            # match may run past its window (`VerifyRequest.cloud_reach`).
            lone = len(requests) == 1
            windows = self.drafters.draft_many([requests[index] for index in cloud], reach=lone)
        drafted: dict[int, HostDraft] = {}
        for index, host in zip(cloud, windows, strict=True):
            request = requests[index]
            if isinstance(host, DrafterError):
                results[index] = _failed(request, f"cloud round: {host}")
                continue
            # A drafter is an engine boundary too: whatever it raises fails this request only.
            if isinstance(host, Exception):
                log.error("drafting a cloud round of %s failed", request.session_id, exc_info=host)
                results[index] = _failed(request, f"cloud round drafting failed: {host}")
                continue
            q = host.q_rows
            requests[index] = request.model_copy(
                update={
                    "tokens": host.tokens,
                    "q_ids": None if q is None else q[0],
                    "q_probs": None if q is None else q[1],
                }
            )
            drafted[index] = host
        return drafted

    def stats(self) -> CoreStats:
        return CoreStats(
            sessions_cached=len(self._sessions),
            cached_positions=self.cached_positions,
            hits=self._hits,
            misses=self._misses,
            prefilled_positions=self._prefilled,
            evictions=self._evictions,
        )

    @property
    def sessions_cached(self) -> int:
        return len(self._sessions)

    @property
    def cached_positions(self) -> int:
        return sum(s.cache.length for s in self._sessions.values())

    def cached_tokens(self, session_id: str) -> list[int] | None:
        """The ids a session's cache holds, or None when it is not cached."""
        session = self._sessions.get(session_id)
        return None if session is None else list(session.tokens)

    def drop(self, session_id: str) -> bool:
        """Forget a session: its cache, and its drafters and feature on this host."""
        if self.drafters is not None:
            self.drafters.drop_session(session_id)
        return self._sessions.pop(session_id, None) is not None

    # -- internals ------------------------------------------------------------------------

    def _refusal(self, request: VerifyRequest) -> str:
        vocab = self.runtime.vocab_size
        top = max(max(request.context_ids), max(request.tokens, default=0))
        if top >= vocab:
            return f"token id {top} is outside the target's vocabulary of {vocab}"
        total = len(request.context_ids) + len(request.tokens)
        if self.max_positions is not None and total > self.max_positions:
            return f"context plus draft is {total} positions; the target holds {self.max_positions}"
        return ""

    def _session(self, session_id: str) -> tuple[_Session, bool]:
        """The session's cache, most recent from now on; True when it was cached already."""
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(self.runtime.new_cache())
            return session, False
        self._sessions.move_to_end(session_id)
        return session, True

    def _missing_tail(self, session: _Session, prefix: list[int]) -> list[int]:
        """Trim the cache to what it shares with `prefix`; return the part of `prefix` it lacks."""
        if session.tokens == prefix:
            return []
        keep = common_prefix_len(session.tokens, prefix)
        if keep < session.cache.length:
            session.cache.trim(keep)
            del session.tokens[keep:]
        return prefix[keep:]

    def _prefill_scored(
        self, session: _Session, ids: list[int], window: int, request: VerifyRequest
    ) -> tuple[Logits, Features | None]:
        """Prefill `ids` (the missing tail, context[-1], then the draft) in chunks, the last
        chunk holding the whole window, and score the window from it: logits # [window, V],
        hidden states # [window, H] when the session wants them. As plain serving takes a
        prompt's first token from its prefill, the round needs no row in the batched pass
        (which had cost a wave of 32 sessions one more 32-row pass, its stacking included)."""
        rest = len(ids) - window
        head = rest - rest % PREFILL_CHUNK
        for start in range(0, head, PREFILL_CHUNK):
            chunk = ids[start : start + PREFILL_CHUNK]
            self.runtime.forward(chunk, session.cache)
            session.tokens += chunk
        last = ids[head:]
        if self.features is not None and self._wants_hidden(request):
            ((logits, hidden),) = self.features.forward_batch_hidden([(last, session.cache)])
            return logits[-window:], hidden[-window:]
        return self.runtime.forward(last, session.cache)[-window:], None

    def _verify_wave(
        self, requests: Sequence[VerifyRequest], indices: list[int]
    ) -> list[tuple[int, Verification]]:
        done: list[tuple[int, Verification]] = []
        rows: list[_Row] = []
        for index in indices:
            request = requests[index]
            context = list(request.context_ids)
            session, cached = self._session(request.session_id)
            alone: tuple[Logits, Features | None] | None = None
            try:
                tail = self._missing_tail(session, context[:-1])
                prefilled = len(tail)
                ids = [*tail, context[-1], *request.tokens]
                if len(tail) > INLINE_PREFILL_MAX:
                    alone = self._prefill_scored(session, ids, len(request.tokens) + 1, request)
            # The runtime is an engine boundary: whatever it raises fails this request only.
            except Exception as exc:
                log.exception("prefill of session %s failed", request.session_id)
                self._sessions.pop(request.session_id, None)
                done.append((index, _failed(request, f"prefill failed: {exc}")))
                continue
            if prefilled or not cached:
                self._misses += 1
                self._prefilled += prefilled
            else:
                self._hits += 1
            row = _Row(index, request, session, ids, prefilled)
            if alone is None:
                rows.append(row)
            else:
                done.append((index, self._decide(row, alone[0], alone[1], 1)))
        if not rows:
            return done

        try:
            scored = self._score(rows)
        except Exception as exc:
            log.exception("batched pass over %d sessions failed", len(rows))
            for row in rows:
                self._sessions.pop(row.request.session_id, None)
                done.append((row.index, _failed(row.request, f"target pass failed: {exc}")))
            return done

        for row, (row_logits, row_hidden) in zip(rows, scored, strict=True):
            window = len(row.request.tokens) + 1
            hidden = None if row_hidden is None else row_hidden[-window:]
            done.append((row.index, self._decide(row, row_logits[-window:], hidden, len(rows))))
        return done

    def _score(self, rows: list[_Row]) -> list[tuple[Logits, Features | None]]:
        """The batched pass: logits per row, and hidden states only if a row asks for them."""
        requests = [(row.ids, row.session.cache) for row in rows]
        asked = any(self._wants_hidden(row.request) for row in rows)
        if asked and self.features is not None:
            return [
                (logits, hidden) for logits, hidden in self.features.forward_batch_hidden(requests)
            ]
        return [(logits, None) for logits in self.runtime.forward_batch(requests)]

    def _wants_hidden(self, request: VerifyRequest) -> bool:
        """A device's feature drafter asked, or the session's drafter here chains from them."""
        if request.want_features and request.cloud_k is None:
            return True
        return self.drafters is not None and self.drafters.wants_features(request.session_id)

    def _decide(
        self, row: _Row, logits: Logits, hidden: Features | None, batch_size: int
    ) -> Verification:
        """Rejection-sample one window (logits # [k+1, V], hidden # [k+1, H] when asked for);
        roll the cache back to the verdict."""
        request = row.request
        spec = request.sampling
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed)
        base_len = len(request.context_ids)
        draft: npt.NDArray[np.int64] = np.asarray(request.tokens, dtype=np.int64)
        try:
            verdict = rejection_sample(
                draft,
                None if params.greedy else sparse_q(request),
                logits,
                params,
                # Greedy draws nothing: seeding a generator per row cost ~0.4% of a pass.
                _NO_DRAWS if params.greedy else round_rng(spec.seed, request.round),
            )
        except ValueError as exc:  # e.g. a drafted token with q'(x) = 0: the draft lied
            self._rollback(row.session, request, base_len - 1)
            return _failed(request, f"rejection sampling refused the draft: {exc}", row.prefilled)
        self._rollback(row.session, request, base_len + verdict.n_accepted)
        features = None
        if hidden is not None:
            features = self._hand_features(
                request, hidden[verdict.n_accepted], verdict.n_accepted, verdict.next_token
            )
        return Verification(
            request_id=request.request_id,
            session_id=request.session_id,
            round=request.round,
            base_len=base_len,
            n_accepted=verdict.n_accepted,
            next_token=verdict.next_token,
            prefilled=row.prefilled,
            batch_size=batch_size,
            features=features,
        )

    def _hand_features(
        self, request: VerifyRequest, hidden: Features, n_accepted: int, next_token: int
    ) -> str | None:
        """The feature that chose the round's next token # [H]: to the session's drafter here
        when it wants it, with the committed context it belongs to; returned in wire form to a
        device's draft that asked."""
        if self.drafters is not None and self.drafters.wants_features(request.session_id):
            committed = (*request.context_ids, *request.tokens[:n_accepted], next_token)
            self.drafters.give_features(request.session_id, hidden, committed)
        if request.want_features and request.cloud_k is None:
            return _wire_features(request, hidden)
        return None

    def _rollback(self, session: _Session, request: VerifyRequest, length: int) -> None:
        """Keep the first `length` positions of context + draft, which the cache now holds."""
        session.cache.trim(length)
        session.tokens = [*request.context_ids, *request.tokens][:length]

    def _evict(self) -> None:
        positions = self.cached_positions
        while self._sessions and (
            len(self._sessions) > self.max_sessions or positions > self.max_cached_positions
        ):
            session_id, session = self._sessions.popitem(last=False)
            positions -= session.cache.length
            self._evictions += 1
            log.debug("evicted session %s (%d positions)", session_id, session.cache.length)


# The generator handed to greedy verification, which takes the argmax and draws nothing.
_NO_DRAWS = np.random.default_rng(0)


def _wire_features(request: VerifyRequest, hidden: Features) -> str | None:
    """Row n_accepted of the window scored [context[-1], *draft] and chose the next token: its
    hidden state is the one a feature drafter chains from. None (logged) if it is not finite."""
    try:
        return features_to_wire(hidden)
    except ValueError as exc:
        log.warning("no features for round %d of %s: %s", request.round, request.session_id, exc)
        return None


def _failed(request: VerifyRequest, error: str, prefilled: int = 0) -> Verification:
    return Verification(
        request_id=request.request_id,
        session_id=request.session_id,
        round=request.round,
        base_len=len(request.context_ids),
        error=error,
        prefilled=prefilled,
    )
