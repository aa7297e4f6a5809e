"""Cloud rounds: the verifier host drafts a session's window with its own copy of the drafter.

A cloud round's VerifyRequest names a drafter and a window (`cloud_draft`, `cloud_k`) instead of
carrying tokens. The core asks `HostDrafters` for the window, then verifies it in the same
batched pass as every other draft. The host runs the drafters the device would (the same models
directory, `inference.drafters`), with the same random stream per round
(`round_rng(seed, round, DRAFT)`), so a cloud round is exactly a distributed round whose draft
was made next to the target.

One copying proposer serves every session of a (drafter, temperature): copying drafters are
functions of the context alone. A drafter with a neural draft keeps a KV cache in step with its
context, so each session gets its own proposer (the loaded model is shared): one proposer for
all would re-prefill the draft on every session's whole context each time sessions take turns,
which made a pass of 4 host-drafted sessions take ~800 ms instead of ~90.

A fresh host loads its drafters' models in the background, while no batch waits
(`HostDrafters.preloads`, `load`): a draft's first cloud round otherwise paid 0.15-0.6 s for the
n-gram table, the model and its first run, in a pass that other sessions' rows shared.

A feature head drafts here from the target's own features, which the verifier computed in the
same pass: after each verdict of a session whose drafter here wants them (a cloud round of
`eagle-h1` or `hybrid+eagle-h1`, and then every round of the session, plain stream rounds
included), the core hands over the hidden state that chose the round's last token
(`give_features`), with the committed context it belongs to. A draft uses it only when its
context extends that one; otherwise (a rewind, a diverged resend, a round verified elsewhere) the
head has none, and alone it falls back to the hybrid, behind the copying tiers it proposes
nothing. Nothing of this crosses the bus. The head's step is stateless, so one loaded head serves
every session.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from broker.messages import VerifyRequest
from inference.drafters import (
    BUILTIN_DRAFTERS,
    HYBRID,
    HYBRID_PREFIX,
    DrafterError,
    drafter_names,
    head_names,
    load_draft_runtime,
    load_head,
    load_ngram_table,
    make_proposer,
)
from inference.drafts import TFLITE_SUFFIX
from inference.proposers import (
    Drafting,
    FeatureHeadStep,
    HybridProposer,
    Proposer,
    draft_together,
    drafting,
    forget_features,
    give_features,
    wants_features,
)
from inference.runtime import Runtime
from inference.sampling import RngStream, SparseDraftProbs, one_hot_draft, round_rng

log = logging.getLogger(__name__)

ProposerFactory = Callable[[str, float], Proposer]
# Sessions whose neural drafting state a host keeps (the least recently drafted go first); a
# small draft's cache for a few hundred positions is a few MB.
SESSION_PROPOSERS_KEPT = 64


@dataclass(frozen=True)
class HostDraft:
    """The window a verifier host drafted for one cloud round."""

    tokens: tuple[int, ...]  # [n], n <= cloud_k (or cloud_reach, a long match of a lone row)
    q: SparseDraftProbs | None  # [n, K]; None for a greedy session
    draft_ms: float

    @property
    def q_rows(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]] | None:
        """q' as the bus carries it (ids and probabilities, one row per token)."""
        if self.q is None:
            return None
        ids = tuple(tuple(int(t) for t in row) for row in self.q.ids.tolist())
        probs = tuple(tuple(float(p) for p in row) for row in self.q.probs.tolist())
        return ids, probs


@dataclass
class _SessionFeature:
    """The target's latest feature for a session whose drafter here chains from features."""

    committed: tuple[int, ...] = ()  # the committed context it belongs to; () before the first
    feature: npt.NDArray[np.float32] | None = None  # [H]: the hidden state at committed[-2]


def session_waves(requests: Iterable[tuple[int, str]]) -> list[list[int]]:
    """The indices of (index, session id) pairs in waves: each session's first request in the
    first wave, its second (a resend) in the second, and so on, in order within each."""
    waves: list[list[int]] = []
    seen: dict[str, int] = {}
    for index, session_id in requests:
        wave = seen.get(session_id, 0)
        seen[session_id] = wave + 1
        if wave == len(waves):
            waves.append([])
        waves[wave].append(index)
    return waves


class HostDrafters:
    """The drafters of one verifier host, loaded on first use and kept."""

    def __init__(
        self,
        models_dir: Path,
        *,
        threads: int | None = None,
        factory: ProposerFactory | None = None,
        vocab: str | None = None,
    ) -> None:
        self.models_dir = models_dir
        self.threads = threads
        self._factory = factory or self._make
        self._own_factory = factory is None  # a factory of its own loads what it needs itself
        self._table_loaded = False  # the n-gram table, by `load`
        self._proposers: OrderedDict[tuple[str, float, str], Proposer] = OrderedDict()
        self._runtimes: dict[str, Runtime] = {}
        self._heads: dict[str, FeatureHeadStep] = {}  # stateless: one per name serves all
        # The sessions with a feature drafter among `_proposers`, and the feature each has.
        self._features: dict[str, _SessionFeature] = {}
        # With the target's vocabulary given, drafts built for another target are left out.
        self.names: tuple[str, ...] = tuple(drafter_names(models_dir, vocab))
        self._head_names = frozenset(head_names(models_dir, vocab))

    def _make(self, name: str, temperature: float) -> Proposer:
        return make_proposer(
            name,
            self.models_dir,
            temperature=temperature,
            threads=self.threads,
            load_runtime=self._runtime,
            load_head_step=self._head,
        )

    def preloads(self) -> list[str]:
        """What `load` can take ahead of the first cloud rounds: the copying tiers' n-gram table
        (as `hybrid`), then every draft and head of this host not loaded yet, ONNX before
        LiteRT. Nothing with a factory of its own, which loads what it needs itself."""
        if not self._own_factory:
            return []
        models = [
            name
            for name in self.names
            if name not in BUILTIN_DRAFTERS
            and not name.startswith(HYBRID_PREFIX)
            and name not in self._runtimes
            and name not in self._heads
        ]
        models.sort(key=lambda name: (name.endswith(TFLITE_SUFFIX), name))
        return models if self._table_loaded else [HYBRID, *models]

    def load(self, name: str) -> float:
        """Load `name` (a draft, a head, or `hybrid` for the n-gram table) and run it once, so
        that no cloud round pays for it; the seconds it took. One that cannot load is logged,
        and its cloud rounds fail as they would have."""
        started = time.perf_counter()
        try:
            if name == HYBRID:
                load_ngram_table()
                self._table_loaded = True
            elif name in self._head_names:
                head = self._head(name)
                head.step(np.zeros((1, head.hidden_size), dtype=np.float32), [0])
            else:
                runtime = self._runtime(name)
                runtime.forward([0, 1], runtime.new_cache())
        except Exception as exc:
            log.warning("could not load drafter %s ahead of its rounds: %s", name, exc)
        return time.perf_counter() - started

    def _runtime(self, draft_name: str) -> Runtime:
        runtime = self._runtimes.get(draft_name)
        if runtime is None:
            runtime = load_draft_runtime(self.models_dir, draft_name, self.threads)
            self._runtimes[draft_name] = runtime
        return runtime

    def _head(self, head_name: str) -> FeatureHeadStep:
        head = self._heads.get(head_name)
        if head is None:
            head = self._heads[head_name] = load_head(self.models_dir, head_name, self.threads)
        return head

    def proposer(self, name: str, temperature: float, session_id: str = "") -> Proposer:
        """The drafter `name` at `temperature` (a session's own, for one with a neural draft);
        DrafterError when this host lacks it."""
        key = (name, temperature, "" if name in BUILTIN_DRAFTERS else session_id)
        proposer = self._proposers.get(key)
        if proposer is not None:
            self._proposers.move_to_end(key)
        else:
            if name not in self.names:
                raise DrafterError(
                    f"this verifier host has no drafter {name!r}; it has: {', '.join(self.names)}"
                )
            proposer = self._proposers[key] = self._factory(name, temperature)
            log.debug("made drafter %s (temperature %.2f) for %s", name, temperature, key[2])
            if key[2] and wants_features(proposer):
                self._features.setdefault(key[2], _SessionFeature())
            while len(self._proposers) > SESSION_PROPOSERS_KEPT:
                evicted, _ = self._proposers.popitem(last=False)
                self._drop_features_unless_wanted(evicted[2])
        return proposer

    def wants_features(self, session_id: str) -> bool:
        """Whether the session has a drafter here that chains from the target's features."""
        return session_id in self._features

    def give_features(
        self, session_id: str, feature: npt.ArrayLike, committed: Sequence[int]
    ) -> None:
        """The target's hidden state that chose the last token of `committed`, the session's
        committed context after a verdict # [H]; its next cloud round drafts from it. Nothing
        for a session without a feature drafter here; a feature that is not finite is none."""
        state = self._features.get(session_id)
        if state is None:
            return
        # A copy: the row is a view of the whole pass's hidden states.
        row = np.array(feature, dtype=np.float32).reshape(-1)
        if not np.isfinite(row).all():
            log.warning("a feature of %s is not finite; its head drafts without", session_id)
            state.committed, state.feature = (), None
            return
        state.committed, state.feature = tuple(committed), row

    def drop_session(self, session_id: str) -> None:
        """Forget the session's own drafters and its feature."""
        for key in [key for key in self._proposers if key[2] == session_id]:
            del self._proposers[key]
        self._features.pop(session_id, None)

    def _drop_features_unless_wanted(self, session_id: str) -> None:
        if session_id and not any(
            key[2] == session_id and wants_features(proposer)
            for key, proposer in self._proposers.items()
        ):
            self._features.pop(session_id, None)

    def _hand_feature(self, proposer: Proposer, request: VerifyRequest) -> None:
        """Give the proposer the session's feature when the round's context extends the one it
        belongs to, and make it forget any other: a feature applied to another context (a
        rewind, a resend that diverged) would chain from the wrong position."""
        state = self._features.get(request.session_id)
        context = request.context_ids
        if (
            state is None
            or state.feature is None
            or context[: len(state.committed)] != state.committed
        ):
            forget_features(proposer)
            return
        try:
            give_features(proposer, state.feature, len(state.committed))
        except ValueError as exc:  # a head of another hidden size than the target's
            log.warning("%s drafts without features: %s", request.cloud_draft, exc)
            forget_features(proposer)

    def draft(self, request: VerifyRequest) -> HostDraft:
        """The window of a cloud round: up to `cloud_k` tokens after `context_ids`."""
        (drafted,) = self.draft_many([request])
        if isinstance(drafted, Exception):
            raise drafted
        return drafted

    def draft_many(
        self, requests: Sequence[VerifyRequest], *, reach: bool = False
    ) -> list[HostDraft | Exception]:
        """The windows of a pass's cloud rounds, in order; what failed, in its place. With
        `reach` (the pass's only row), a hybrid's long match may run to `cloud_reach`.

        The drafts run together (`draft_together`): a feature head steps every session's
        chain in one call. A session's drafter holds its state, so a session that comes twice
        (a resend) drafts its second window after the first, in a second lockstep."""
        results: dict[int, HostDraft | Exception] = {}
        for wave in session_waves(enumerate(r.session_id for r in requests)):
            drafted = self._draft_together([requests[index] for index in wave], reach)
            results.update(zip(wave, drafted, strict=True))
        return [results[index] for index in range(len(requests))]

    def _draft_together(
        self, requests: Sequence[VerifyRequest], reach: bool
    ) -> list[HostDraft | Exception]:
        drafts: list[Drafting | Exception] = []
        for request in requests:
            try:
                drafts.append(self._start(request, reach))
            except Exception as exc:
                drafts.append(exc)
        started = [d for d in drafts if not isinstance(d, Exception)]
        ran = iter(draft_together(started))
        out: list[HostDraft | Exception] = []
        for request, draft in zip(requests, drafts, strict=True):
            if isinstance(draft, Exception):
                out.append(draft)
                continue
            done = next(ran)
            if done.error is not None:
                out.append(done.error)
                continue
            assert done.candidates is not None
            tokens = tuple(int(t) for t in done.candidates.tokens.tolist())
            q = None
            if not request.sampling.greedy and tokens:
                # A deterministic proposal is sent one-hot, as the agent sends it.
                q = done.candidates.q if done.candidates.q is not None else one_hot_draft(tokens)
            out.append(HostDraft(tokens, q, done.ms))
        return out

    def _start(self, request: VerifyRequest, reach: bool = False) -> Drafting:
        """A cloud round's draft, ready to run: its drafter, with the session's feature; with
        `reach`, a hybrid's long match may run to the request's `cloud_reach`."""
        if request.cloud_draft is None or request.cloud_k is None:
            raise ValueError("not a cloud round request")
        sampling = request.sampling
        proposer = self.proposer(request.cloud_draft, sampling.temperature, request.session_id)
        if wants_features(proposer):
            self._hand_feature(proposer, request)
        rng = None
        if not sampling.greedy:
            rng = round_rng(sampling.seed, request.round, RngStream.DRAFT)
        if reach and request.cloud_reach and isinstance(proposer, HybridProposer):
            return proposer.drafting(request.context_ids, request.cloud_k, rng, request.cloud_reach)
        return drafting(proposer, request.context_ids, request.cloud_k, rng)
