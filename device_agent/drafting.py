"""One session's drafting, free of the bus: windows, verdicts, resynchronisation, proactive drafts.

`SessionDrafter` is the agent's half of docs/protocol.md. It drafts the window of the current
round after the committed sequence, applies the verdict of that round, and resynchronises from
the coordinator's `SessionState`. With `proactive` on it also drafts the next round's window
while a verdict is in flight (SpecEdge), on the assumption that the target accepts the whole
window and its bonus token equals the draft's own next guess; the verdict then decides whether
that window is sent at once (a hit) or thrown away (a miss).

Offline (local mode), the drafter generates alone: its tokens form a provisional tail after the
committed sequence, shown to the user as provisional. When the coordinator answers again the tail
goes out as one long draft, and every commit reconciles it (`reconcile`): the target keeps a
prefix of it and replaces the rest from the first rejected token on.

Nothing here blocks on I/O. Drafting a neural window is CPU work, which the agent runs on its
drafting thread; the caller must not call two methods of one drafter at the same time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from broker import messages as m
from device_agent.draft_supervisor import drafted_by
from inference.features import features_from_wire
from inference.proposers import (
    Candidates,
    Proposer,
    forget_features,
    give_features,
    no_candidates,
    set_min_confidence,
    wants_features,
)
from inference.sampling import RngStream, SparseDraftProbs, one_hot_draft, round_rng

log = logging.getLogger(__name__)

# The guess for the bonus token never reaches the verifier, so its draws need only be
# reproducible and apart from the DRAFT and VERIFY streams; they change the hit rate, nothing else.
_GUESS_STREAM = 2
# Offline generation draws from a stream of its own, for the same reason.
_LOCAL_STREAM = 3

ProactiveOutcome = Literal["hit", "miss", "none"]

# Drafting ahead costs a window of draft compute, all of it wasted on a miss (and on a device
# that shares its cores, taken from everything else). A session whose pre-drafted windows keep
# missing stops drafting ahead, and tries again every so often. Module-level so tests can set them.
PROACTIVE_MIN_HIT_RATE = 0.15
PROACTIVE_EWMA_WEIGHT = 0.25
PROACTIVE_PROBE_EVERY = 16  # rounds between tries while the recent hit rate is below the minimum
# Drafting ahead that costs less than this (copying drafters: tens of microseconds) always goes on.
PROACTIVE_FREE_MS = 0.5
# The longest provisional tail: local mode stops generating there (or at eos or max_tokens) and
# waits for the link. It goes out as one draft, so it must fit m.MAX_DRAFT_TOKENS.
PROVISIONAL_MAX_TOKENS = 256


class OutOfSync(Exception):
    """A verdict that does not fit the round in flight: the agent must ask for the state."""


@dataclass(frozen=True)
class SessionSpec:
    """What a session is: fixed when it opens."""

    session_id: str
    prompt: str
    prompt_ids: tuple[int, ...]  # [prompt_len], chat-templated
    task_type: str
    sampling: m.SamplingSpec
    max_tokens: int
    draft_model: str
    k: int
    # cloud: the verifier host drafts (with a fixed k > 0); plain: it decodes with no drafter.
    mode: m.Mode = m.Mode.DISTRIBUTED
    # The vocabulary hash of the tokenizer that wrote prompt_ids: the coordinator checks it.
    vocab: str = ""

    def open_message(self) -> m.SessionOpen:
        return m.SessionOpen(
            session_id=self.session_id,
            prompt=self.prompt,
            prompt_ids=self.prompt_ids,
            task_type=self.task_type,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            draft_model=self.draft_model,
            k=self.k,
            mode=self.mode,
            # This agent streams host rounds too: cloud (the host drafts) and plain (no drafter).
            modes=(m.Mode.DISTRIBUTED, m.Mode.CLOUD, m.Mode.PLAIN),
            vocab=self.vocab,
            awaits_stream=True,
        )


@dataclass(frozen=True)
class DraftWindow:
    """The draft of one round: k tokens after the first `base_len` committed tokens."""

    round: int
    base_len: int
    tokens: tuple[int, ...]  # [k]
    q: SparseDraftProbs | None  # [k, K]; None for a greedy session
    draft_model: str
    draft_ms: float  # spent drafting it (for a pre-drafted window: while the last verdict flew)
    proactive: bool  # True when it was drafted before the previous verdict came
    provisional: bool = False  # the tail generated offline, already shown to the user
    # A cloud round: no tokens; the verifier host drafts up to cloud_k with `draft_model`.
    cloud_k: int | None = None
    # Drafted by a feature drafter: the verdict should bring the target's features.
    want_features: bool = False

    def message(self, session_id: str, sent_at: float, downlink_ms: float | None = None) -> m.Draft:
        q_ids = q_probs = None
        if self.q is not None:
            q_ids = tuple(tuple(int(t) for t in row) for row in self.q.ids.tolist())
            q_probs = tuple(tuple(float(p) for p in row) for row in self.q.probs.tolist())
        return m.Draft(
            session_id=session_id,
            round=self.round,
            base_len=self.base_len,
            tokens=self.tokens,
            q_ids=q_ids,
            q_probs=q_probs,
            draft_model=self.draft_model,
            provisional=self.provisional,
            timings=m.DraftTimings(
                draft_ms=self.draft_ms, sent_at=sent_at, downlink_ms=downlink_ms
            ),
            cloud_k=self.cloud_k,
            want_features=True if self.want_features else None,
        )


@dataclass(frozen=True)
class RoundRecord:
    """One verified round as the agent saw it."""

    round: int
    base_len: int
    drafted: int
    accepted: int
    committed: int  # tokens the round committed: the accepted ones plus the target's token
    draft_ms: float
    draft_model: str
    proactive_window: bool  # this round sent a window drafted while the last verdict flew
    predraft: ProactiveOutcome  # what became of the window drafted while this verdict flew
    verifier_id: str
    provisional: bool = False  # the round verified a provisional tail


@dataclass(frozen=True)
class Speculation:
    """A window drafted for the next round before the current verdict came."""

    round: int  # the round it is for
    base_len: int  # committed length it assumes
    assumed: tuple[int, ...]  # the in-flight window plus the guessed bonus token
    candidates: Candidates  # [n <= k]
    k: int  # the window size it was drafted for
    draft_model: str
    draft_ms: float


@dataclass(frozen=True)
class Resync:
    """What a SessionState changed."""

    in_sync: bool  # the state matched what the agent held: nothing changed
    new_tokens: list[int]  # committed beyond what the agent held, to stream
    rewound: bool  # the state dropped tokens the agent held (the protocol rules it out)


@dataclass(frozen=True)
class Reconciliation:
    """What the target's committed tokens make of a provisional tail after the same position."""

    kept: int  # tail tokens the committed ones confirm: their common prefix
    replaced: tuple[int, ...]  # tail tokens from the first one the committed ones contradict
    pending: tuple[int, ...]  # tail tokens past the committed ones: not decided yet


def reconcile(
    tail: Sequence[int], committed: Sequence[int], finished: bool = False
) -> Reconciliation:
    """Split a provisional tail by the tokens the target committed after its first position.

    The common prefix is kept. If the committed tokens end inside the tail, the rest of the tail
    is still pending (it goes out as the next draft), unless the session finished, which drops
    it. Otherwise the target contradicted the tail at the first differing position, and the
    tail is replaced from there on.
    """
    kept = 0
    limit = min(len(tail), len(committed))
    while kept < limit and tail[kept] == committed[kept]:
        kept += 1
    rest = tuple(tail[kept:])
    if kept == len(committed) and not finished:
        return Reconciliation(kept=kept, replaced=(), pending=rest)
    return Reconciliation(kept=kept, replaced=rest, pending=())


@dataclass(frozen=True)
class Reconciled:
    """A spell of local mode, settled: every provisional token was either kept or replaced."""

    at: int  # generated tokens committed before the first provisional one
    provisional: int  # tokens the spell generated (the window in flight when it began included)
    kept: int
    replaced: tuple[int, ...]  # ids of the provisional tokens the target replaced, in order


@dataclass
class LocalSpell:
    """Local mode: the tokens generated alone since the coordinator was last heard."""

    at: int  # generated tokens committed when the spell began: where its tail starts
    round: int  # the round in flight when it began (seeds its draws)
    generated: int = 0  # provisional tokens made, the window in flight included
    kept: int = 0
    replaced: list[int] = field(default_factory=list)
    since: float = 0.0  # unix time of the coordinator's last answer before the spell
    stalled: bool = False  # the drafter proposed nothing: wait for the link

    def to_json(self) -> dict[str, object]:
        return {
            "at": self.at,
            "round": self.round,
            "generated": self.generated,
            "kept": self.kept,
            "replaced": list(self.replaced),
            "since": self.since,
        }


@dataclass
class ProactiveStats:
    """Pre-drafted windows used (hits) and thrown away (misses), and rounds not drafted ahead."""

    hits: int = 0
    misses: int = 0
    skipped: int = 0
    recent: float = 0.5  # EWMA of the hit rate
    cost_ms: float = 0.0  # EWMA of the time one window drafted ahead takes
    _since_try: int = 0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def record(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self.recent += PROACTIVE_EWMA_WEIGHT * (float(hit) - self.recent)

    def record_cost(self, ms: float) -> None:
        self.cost_ms += PROACTIVE_EWMA_WEIGHT * (ms - self.cost_ms) if self.cost_ms else ms

    def should_try(self) -> bool:
        """Whether to draft ahead this round, given how the last pre-drafted windows fared."""
        if self.recent >= PROACTIVE_MIN_HIT_RATE or self.cost_ms < PROACTIVE_FREE_MS:
            return True
        self._since_try += 1
        if self._since_try >= PROACTIVE_PROBE_EVERY:
            self._since_try = 0
            return True
        self.skipped += 1
        return False


def _q_rows(q: SparseDraftProbs) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """q' as one (ids, probs) row per drafted token, the padding at p = 0 left out."""
    rows = []
    for ids, probs in zip(q.ids.tolist(), q.probs.tolist(), strict=True):
        kept = [(int(i), float(p)) for i, p in zip(ids, probs, strict=True) if p > 0.0]
        rows.append((tuple(i for i, _ in kept), tuple(p for _, p in kept)))
    return rows


def _slice(candidates: Candidates, k: int) -> Candidates:
    """The first k tokens of a proposal; every drafter here proposes prefix-consistently."""
    if candidates.n <= k:
        return candidates
    q = candidates.q
    cut = None if q is None else SparseDraftProbs(ids=q.ids[:k], probs=q.probs[:k])
    return Candidates(tokens=candidates.tokens[:k], q=cut)


@dataclass
class SessionDrafter:
    """The agent's state of one session: committed tokens, round, policy, the window in flight."""

    spec: SessionSpec
    proposer: Proposer
    eos_id: int
    proactive: bool = True
    # Switches drafter when a policy names another; returns None when the device lacks it.
    swap_proposer: Callable[[Proposer, str], Proposer | None] | None = None
    committed: list[int] = field(default_factory=list)
    round: int = 0
    k: int = 0
    draft_model: str = ""
    finished: bool = False
    status: str = "active"
    in_flight: DraftWindow | None = None
    records: list[RoundRecord] = field(default_factory=list)
    stats: ProactiveStats = field(default_factory=ProactiveStats)
    # Local mode: the provisional tail after `committed`, its q' rows when sampling, the spell.
    provisional: list[int] = field(default_factory=list)  # [n]
    provisional_q: list[tuple[tuple[int, ...], tuple[float, ...]]] = field(
        default_factory=list
    )  # [n] rows of (ids, probs); empty for a greedy session
    spell: LocalSpell | None = None
    reconciled: Reconciled | None = None  # the last spell settled, until the caller takes it
    _speculation: Speculation | None = None
    _wanted_model: str | None = None
    _local_rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        if not self.committed:
            self.committed = list(self.spec.prompt_ids)
        self.k = self.spec.k
        self.draft_model = self.draft_model or self.spec.draft_model
        # Cloud mode (the policy's, or the session's own): the host drafts with `cloud_draft`.
        self.mode = self.spec.mode
        self.cloud_draft = self.spec.draft_model
        self.min_confidence: float | None = None  # the policy's, for the neural drafters

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len :]

    @property
    def sampling(self) -> bool:
        return not self.spec.sampling.greedy

    def _window_size(self, n_generated: int) -> int:
        """k, cut so that the accepted tokens plus the target's own fit in max_tokens."""
        return max(0, min(self.k, self.spec.max_tokens - n_generated - 1))

    def _draft_rng(self, round_index: int) -> np.random.Generator | None:
        if not self.sampling:
            return None
        return round_rng(self.spec.sampling.seed, round_index, RngStream.DRAFT)

    def _propose(self, context: Sequence[int], k: int, round_index: int) -> Candidates:
        if k <= 0:
            return no_candidates()
        return self.proposer.get_candidates(context, k, self._draft_rng(round_index))

    @property
    def has_speculation(self) -> bool:
        """Whether a window for the next round is already drafted."""
        return self._speculation is not None

    @property
    def next_draft_model(self) -> str:
        """The drafter the next window will come from (a policy may have asked for another)."""
        return self._wanted_model or self.draft_model

    def _apply_policy(self, policy: m.Policy | None) -> None:
        if policy is None:
            return
        self.k = policy.k
        self.min_confidence = policy.min_confidence
        if policy.mode is m.Mode.LOCAL:
            log.warning(
                "session %s: a coordinator does not ask for local mode; drafting on",
                self.spec.session_id,
            )
        self.mode = policy.mode if policy.mode in m.HOST_MODES else m.Mode.DISTRIBUTED
        if self.mode in m.HOST_MODES:
            self.cloud_draft = policy.draft_model
            return  # the host drafts; the device's own drafter waits as it is
        # The swap itself waits for `draft`, which may load a model and so runs off the loop.
        self._wanted_model = None if policy.draft_model == self.draft_model else policy.draft_model

    def _swap_if_wanted(self) -> None:
        wanted = self._wanted_model
        self._wanted_model = None
        if wanted is None:
            return
        swapped = None if self.swap_proposer is None else self.swap_proposer(self.proposer, wanted)
        if swapped is None:
            log.warning(
                "session %s: policy asks for drafter %r, which this device lacks; keeping %r",
                self.spec.session_id,
                wanted,
                self.draft_model,
            )
            return
        self.proposer = swapped
        self.draft_model = wanted

    def draft(self) -> DraftWindow:
        """The window of the current round: the provisional tail when one waits to be verified,
        else the pre-drafted one when it still fits, else a fresh one."""
        if self.finished:
            raise RuntimeError("the session has finished")
        if self.provisional:
            return self._provisional_window()
        if self.mode in m.HOST_MODES:
            return self._cloud_window()
        self._swap_if_wanted()
        if self.min_confidence is not None:
            set_min_confidence(self.proposer, self.min_confidence)
        base_len = len(self.committed)
        k = self._window_size(len(self.generated))
        speculation = self._speculation
        self._speculation = None
        start = time.perf_counter()
        if (
            speculation is not None
            and speculation.round == self.round
            and speculation.base_len == base_len
            and speculation.draft_model == self.draft_model
            and k <= speculation.k
        ):
            candidates = _slice(speculation.candidates, k)
            draft_ms = speculation.draft_ms
            proactive = True
            self.stats.record(hit=True)
        else:
            if speculation is not None:
                self.stats.record(hit=False)
                self.proposer.rollback(base_len)
            candidates = self._propose(self.committed, k, self.round)
            draft_ms = (time.perf_counter() - start) * 1e3
            proactive = False
        q = candidates.q
        if not self.sampling:
            q = None
        elif q is None and candidates.n:
            # A deterministic proposal: q' is one-hot, sent explicitly so the verifier need not
            # know which drafter made it.
            q = one_hot_draft(candidates.tokens.tolist())
        window = DraftWindow(
            round=self.round,
            base_len=base_len,
            tokens=tuple(int(t) for t in candidates.tokens.tolist()),
            q=q,
            # The last proposal is this window's (fresh, or the pre-drafted one).
            draft_model=drafted_by(self.proposer, self.draft_model),
            draft_ms=draft_ms,
            proactive=proactive,
            want_features=wants_features(self.proposer),
        )
        self.in_flight = window
        return window

    def _cloud_window(self) -> DraftWindow:
        """The window of a cloud round: no tokens; the verifier host drafts it."""
        if self._speculation is not None:  # drafted ahead in distributed mode: of no use now
            self._discard_speculation()
            self.proposer.rollback(len(self.committed))
        k = self._window_size(len(self.generated))
        window = DraftWindow(
            round=self.round,
            base_len=len(self.committed),
            tokens=(),
            q=None,
            draft_model=self.cloud_draft,
            draft_ms=0.0,
            proactive=False,
            cloud_k=max(1, min(k, m.MAX_CLOUD_K)),
        )
        self.in_flight = window
        return window

    def speculate(self) -> bool:
        """Draft the next round's window assuming the in-flight one is wholly accepted.

        The assumed bonus token is the draft's own next guess. Returns whether it drafted.
        """
        window = self.in_flight
        if not self.proactive or window is None or self.finished or self.spell is not None:
            return False
        if window.cloud_k is not None:
            return False
        if self.sampling and wants_features(self.proposer):
            # Ahead of the verdict a feature drafter has only its own predicted features, and
            # its window would differ from the one the verdict's features give: whether the
            # pre-drafted one is used would then depend on timing, and sampled output must be
            # reproducible from (seed, round).
            return False
        start = time.perf_counter()
        n_after = len(self.generated) + len(window.tokens) + 1
        k_next = self._window_size(n_after)
        if k_next <= 0 or self.eos_id in window.tokens or not self.stats.should_try():
            return False
        context = [*self.committed, *window.tokens]
        guess_rng = None
        if self.sampling:
            seed = self.spec.sampling.seed
            guess_rng = np.random.default_rng([seed, window.round, _GUESS_STREAM])
        guess = self.proposer.get_candidates(context, 1, guess_rng)
        if guess.n == 0 or int(guess.tokens[0]) == self.eos_id:
            return False
        context.append(int(guess.tokens[0]))
        candidates = self._propose(context, k_next, window.round + 1)
        draft_ms = (time.perf_counter() - start) * 1e3
        self.stats.record_cost(draft_ms)
        self._speculation = Speculation(
            round=window.round + 1,
            base_len=len(context),
            assumed=(*window.tokens, int(guess.tokens[0])),
            candidates=candidates,
            k=k_next,
            draft_model=self.draft_model,
            draft_ms=draft_ms,
        )
        return True

    def _discard_speculation(self) -> ProactiveOutcome:
        if self._speculation is None:
            return "none"
        self._speculation = None
        self.stats.record(hit=False)
        return "miss"

    def apply_verdict(self, verdict: m.Verdict) -> list[int] | None:
        """Commit a verdict of the round in flight; returns the new tokens, None when stale.

        Raises OutOfSync when the verdict belongs to a round the agent has not sent, or does not
        fit the window in flight; the agent then asks the coordinator for the session's state.
        """
        window = self.in_flight
        if verdict.round < self.round:
            return None  # a duplicate of a verdict already applied
        if window is not None and window.cloud_k is not None and verdict.round == window.round:
            # A cloud round: the verifier host drafted the window, and the verdict brings it.
            if verdict.draft_tokens is None:
                raise OutOfSync(f"the verdict of cloud round {verdict.round} lacks its draft")
            window = replace(window, tokens=verdict.draft_tokens)
        if window is None or verdict.round != window.round:
            raise OutOfSync(f"verdict for round {verdict.round}, but round {self.round} is next")
        if verdict.base_len != window.base_len or verdict.n_accepted > len(window.tokens):
            raise OutOfSync(
                f"verdict of round {verdict.round} (base_len {verdict.base_len}, "
                f"{verdict.n_accepted} accepted) does not fit the window sent (base_len "
                f"{window.base_len}, {len(window.tokens)} tokens)"
            )
        n = verdict.n_accepted
        new_tokens = list(window.tokens[:n])
        if verdict.next_token is not None:
            new_tokens.append(verdict.next_token)
        self.committed += new_tokens
        self.round += 1
        self.in_flight = None
        if not window.provisional:  # the tail was not drafted as one window
            self.proposer.update_candidate_strategy(n)
        self._apply_policy(verdict.policy)

        outcome: ProactiveOutcome = "none"
        speculation = self._speculation
        if speculation is not None:
            confirmed = (
                tuple(new_tokens) == speculation.assumed
                and speculation.base_len == len(self.committed)
                and speculation.draft_model == self.next_draft_model
                and self._window_size(len(self.generated)) <= speculation.k
            )
            # A confirmed window is counted as a hit when `draft` sends it.
            outcome = "hit" if confirmed else self._discard_speculation()
        if outcome != "hit":
            # Only the accepted prefix of the window is still valid in the draft's own state.
            self.proposer.rollback(window.base_len + n)
        if verdict.features is not None and not verdict.finished:
            self._take_features(verdict.features)

        stopped = self.eos_id in new_tokens or len(self.generated) >= self.spec.max_tokens
        if stopped != verdict.finished:
            log.warning(
                "session %s round %d: the verdict says finished=%s, the stop rules say %s",
                self.spec.session_id,
                verdict.round,
                verdict.finished,
                stopped,
            )
        if verdict.finished or stopped:
            self.finished = True
            self.status = "finished"
            self._speculation = None
        self.records.append(
            RoundRecord(
                round=verdict.round,
                base_len=window.base_len,
                drafted=len(window.tokens),
                accepted=n,
                committed=len(new_tokens),
                draft_ms=window.draft_ms,
                draft_model=window.draft_model,
                proactive_window=window.proactive,
                predraft=outcome,
                verifier_id=verdict.verifier_id,
                provisional=window.provisional,
            )
        )
        self._settle_tail(new_tokens)
        if verdict.continues and not self.finished:
            self._cloud_window()  # the coordinator runs the next round itself: it is in flight
        return new_tokens

    def _take_features(self, text: str) -> None:
        """The target's feature for the committed sequence, to the feature drafter; one that does
        not fit it (another target's size) is logged and the drafter falls back."""
        if not wants_features(self.proposer):
            return
        try:
            give_features(self.proposer, features_from_wire(text), len(self.committed))
        except ValueError as exc:
            log.warning("session %s: features of a verdict refused: %s", self.spec.session_id, exc)

    def resync(self, state: m.SessionState) -> Resync:
        """Take the coordinator's truth: committed = prompt + generated_ids, round = next_round."""
        if state.prompt_len != self.prompt_len:
            raise OutOfSync(
                f"the coordinator holds a prompt of {state.prompt_len} tokens, the agent "
                f"{self.prompt_len}"
            )
        target = [*self.spec.prompt_ids, *state.generated_ids]
        if state.policy is not None:
            self._apply_policy(state.policy)
        if state.status != "active":
            self.finished = True
            self.status = state.status
        if target == self.committed and state.next_round == self.round:
            if self.finished:
                self.in_flight = None
                self._settle_tail([])
            return Resync(in_sync=True, new_tokens=[], rewound=False)
        common = 0
        limit = min(len(target), len(self.committed))
        while common < limit and target[common] == self.committed[common]:
            common += 1
        rewound = common < len(self.committed)
        new_tokens = target[common:]
        self.committed = target
        self.round = state.next_round
        self.in_flight = None
        self._discard_speculation()
        self.proposer.rollback(common)
        if rewound:  # the tail followed tokens that are gone: none of it can stand
            self._settle_tail(None)
        else:
            self._settle_tail(new_tokens)
        return Resync(in_sync=False, new_tokens=new_tokens, rewound=rewound)

    # -- local mode ------------------------------------------------------------------------

    def start_local(self) -> list[int]:
        """Enter local mode; returns the tokens that became provisional on entering it.

        The window in flight, if any, opens the tail: its verdict may still come (the bus may
        be up and the coordinator slow), and a verdict of that round then fits the tail too.
        """
        self._discard_speculation()
        # Offline there are no verdicts: a feature drafter drafts as its fallback (the hybrid).
        forget_features(self.proposer)
        if self.spell is not None:
            self.spell.stalled = False
            return []
        window = self.in_flight
        self.spell = LocalSpell(at=len(self.generated), round=self.round)
        if self.sampling:
            seed = self.spec.sampling.seed
            self._local_rng = np.random.default_rng([seed, self.round, _LOCAL_STREAM])
        if self.provisional or window is None or window.provisional or not window.tokens:
            return []
        self.provisional = list(window.tokens)
        if self.sampling:
            q = window.q if window.q is not None else one_hot_draft(list(window.tokens))
            self.provisional_q = _q_rows(q)
        self.spell.generated = len(self.provisional)
        return list(self.provisional)

    @property
    def can_generate_locally(self) -> bool:
        """In local mode with room left in the tail, and a drafter that still proposes."""
        spell = self.spell
        if spell is None or spell.stalled or self.finished:
            return False
        return self._local_room() > 0 and self.eos_id not in self.provisional

    def _local_room(self) -> int:
        left = self.spec.max_tokens - len(self.generated)
        return min(PROVISIONAL_MAX_TOKENS, left) - len(self.provisional)

    def generate_locally(self, n: int) -> list[int]:
        """Extend the tail by up to n tokens from the drafter alone (greedy: its argmax; sampled:
        draws from q'); stops after an eos. Returns the new provisional tokens, [] when the
        drafter has nothing to propose (local mode then waits for the link)."""
        spell = self.spell
        if spell is None or not self.can_generate_locally:
            return []
        context = [*self.committed, *self.provisional]
        candidates = self.proposer.get_candidates(
            context, min(n, self._local_room()), self._local_rng
        )
        tokens = [int(t) for t in candidates.tokens.tolist()]
        if self.eos_id in tokens:
            tokens = tokens[: tokens.index(self.eos_id) + 1]
        if not tokens:
            spell.stalled = True
            return []
        if self.sampling:
            q = candidates.q if candidates.q is not None else one_hot_draft(tokens)
            self.provisional_q += _q_rows(q)[: len(tokens)]
        self.provisional += tokens
        spell.generated += len(tokens)
        return tokens

    def _provisional_window(self) -> DraftWindow:
        """The provisional tail as one draft of the current round."""
        self._speculation = None
        q = None
        if self.sampling:
            width = max(len(ids) for ids, _ in self.provisional_q)
            ids = np.zeros((len(self.provisional_q), width), dtype=np.int64)
            probs = np.zeros((len(self.provisional_q), width), dtype=np.float64)
            for row, (row_ids, row_probs) in enumerate(self.provisional_q):
                ids[row, : len(row_ids)] = row_ids
                ids[row, len(row_ids) :] = row_ids[0]  # padding at p = 0
                probs[row, : len(row_probs)] = row_probs
            q = SparseDraftProbs(ids=ids, probs=probs)
        window = DraftWindow(
            round=self.round,
            base_len=len(self.committed),
            tokens=tuple(self.provisional),
            q=q,
            draft_model=self.draft_model,
            draft_ms=0.0,
            proactive=False,
            provisional=True,
            want_features=wants_features(self.proposer),
        )
        self.in_flight = window
        return window

    @property
    def tail_unsent(self) -> bool:
        """A provisional tail waits that is not the window in flight."""
        window = self.in_flight
        return bool(self.provisional) and (
            window is None or window.tokens != tuple(self.provisional)
        )

    def take_reconciled(self) -> Reconciled | None:
        reconciled, self.reconciled = self.reconciled, None
        return reconciled

    def _settle_tail(self, new_tokens: list[int] | None) -> None:
        """Reconcile the tail with tokens just committed after it began (None: it is void)."""
        spell = self.spell
        if spell is None:
            return
        if new_tokens is None:
            outcome = Reconciliation(kept=0, replaced=tuple(self.provisional), pending=())
        else:
            outcome = reconcile(self.provisional, new_tokens, self.finished)
        spell.kept += outcome.kept
        spell.replaced += outcome.replaced
        self.provisional = list(outcome.pending)
        self.provisional_q = self.provisional_q[len(self.provisional_q) - len(outcome.pending) :]
        if self.provisional or (new_tokens == [] and not self.finished):
            return  # tokens still wait for the target's word
        self.spell = None
        self._local_rng = None
        if spell.generated:
            self.reconciled = Reconciled(
                at=spell.at,
                provisional=spell.generated,
                kept=spell.kept,
                replaced=tuple(spell.replaced),
            )
