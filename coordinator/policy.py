"""The adaptive policy: per round, the draft model and window k that maximise committed tokens/s.

For a draft d with acceptance rate a (the chance that the target accepts each drafted token) and
window k, one round commits E(a, k) = (1 - a^(k+1)) / (1 - a) tokens in expectation, and takes
T(k) = k * t_draft(d) + RTT + queue + t_verify(k, load). The policy picks the (d, k) with the
highest E / T (DESIGN.md, "Adaptive policy"; the expectation is Leviathan et al. 2023, eq. 1).

Every input is measured: a is an exponentially weighted count of accepted over tried tokens per
(device, draft, task type); t_draft per (device, draft); RTT per device, from telemetry and from
the uplink leg of rounds; queue time over the fleet; and t_verify(k, load) is a ridge regression
on [1, k, load, k * load] over recent rounds, pulled toward a prior so it is defined from the
first round. The k * load term is what makes k shrink under load: a verifier batching many
sessions pays each drafted token once per sequence in the batch.

Only distributed mode is chosen for now: cloud and local mode need agent support that does
not exist yet. The module is pure: no clock, no I/O; callers pass in what they measured.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from broker import messages as m

TASK_TYPES = ("chat", "code", "translate", "summarize", "math")
DEFAULT_TASK = "chat"
BUILTIN_DRAFTS = ("lookup", "ngram", "hybrid")  # inference.drafters.BUILTIN_DRAFTERS

K_MIN = 1  # k = 0 would stop drafting, and with it every measurement of a
K_MAX = 16
SWITCH_MARGIN = 1.1  # another draft must promise 10% more tokens/s before we switch to it
REFUSED_AFTER_ROUNDS = 3  # rounds a device may keep its old draft after we asked for another

# Exponential forgetting: each new observation weighs as much as the last ~1/(1 - decay).
ALPHA_DECAY = 0.9
TIME_DECAY = 0.8
VERIFY_DECAY = 0.98

# Priors, used until measurements replace them. An unknown draft gets a middling a and the cost
# of a small neural draft on a phone-class CPU; the copying drafters cost almost nothing.
PRIOR_ALPHA = 0.5
PRIOR_ALPHA_WEIGHT = 2.0  # in tried tokens
PRIOR_DRAFT_MS_PER_TOKEN = {"lookup": 0.05, "ngram": 0.1, "hybrid": 0.2}
PRIOR_NEURAL_DRAFT_MS_PER_TOKEN = 8.0
PRIOR_RTT_MS = 20.0
PRIOR_QUEUE_MS = 1.0
# t_verify = a + b k + c load + d k load, in ms: a rough guess for a CPU verifier of the 135M
# target, not a measurement; measured rounds replace it within a few rounds.
PRIOR_VERIFY = (25.0, 2.0, 5.0, 2.0)
VERIFY_PRIOR_ROUNDS = 4.0  # how many rounds' worth of belief the prior holds
# Typical sizes of k, load and k * load; the intercept is held only lightly (0.05), since every
# round measures it and a prior intercept far off would bias the whole fit through collinearity.
VERIFY_FEATURE_SCALE = (0.05, 4.0, 1.0, 4.0)
ALPHA_CAP = 0.98  # E(a, k) grows without bound as a -> 1; a few misses always happen

# Below this draft confidence (the draft's own top probability) the agent stops the window.
MIN_CONFIDENCE = 0.3


# --- task type ---------------------------------------------------------------------------------

_TASK_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "translate",
        re.compile(
            r"\btranslat\w*|\bin(to)? (english|french|german|spanish|italian|chinese|japanese"
            r"|portuguese|russian)\b",
            re.IGNORECASE,
        ),
    ),
    (
        "summarize",
        re.compile(r"\bsummar\w*|\btl;?dr\b|\bin (a few|one|two|three) (sentences?|words)\b", re.I),
    ),
    (
        "code",
        re.compile(
            r"```|\bdef |\bclass |\bfunction\b|\bpython\b|\bjavascript\b|\brust\b|\bsql\b"
            r"|\bcode\b|\bprogram\b|\bscript\b|\bcompile\w*|\bbug\b|\bregex\b",
            re.IGNORECASE,
        ),
    ),
    (
        "math",
        re.compile(
            r"\d\s*[-+*/^=]\s*\d|\bsolve\b|\bequation\b|\bcalculat\w*|\bintegral\b|\bderivative"
            r"|\bhow (many|much)\b|\bsum of\b|\bprime\b|\bpercent\w*",
            re.IGNORECASE,
        ),
    ),
)


def classify_task(prompt: str) -> str:
    """The task type of a prompt by keyword rules; the first rule that matches wins."""
    for task, pattern in _TASK_RULES:
        if pattern.search(prompt):
            return task
    return DEFAULT_TASK


def resolve_task(task_type: str | None, prompt: str) -> str:
    """The caller's task type when it is one we know, else the classifier's."""
    if task_type in TASK_TYPES:
        return task_type
    return classify_task(prompt)


# --- the model of a round ----------------------------------------------------------------------


def expected_tokens(alpha: float, k: int) -> float:
    """E(a, k): tokens one round commits, the target's own next token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Ewma:
    """An exponentially weighted mean that starts from a prior of a given weight."""

    value: float
    weight: float = 1.0

    def update(self, sample: float, decay: float) -> None:
        self.weight = self.weight * decay + 1.0
        self.value += (sample - self.value) / self.weight


@dataclass
class AcceptanceRate:
    """a as decayed counts: accepted tokens over tried ones (a rejection ends the trials)."""

    accepted: float = PRIOR_ALPHA * PRIOR_ALPHA_WEIGHT
    tried: float = PRIOR_ALPHA_WEIGHT

    @property
    def alpha(self) -> float:
        return min(ALPHA_CAP, self.accepted / self.tried)

    def update(self, k: int, n_accepted: int, decay: float = ALPHA_DECAY) -> None:
        if k <= 0:
            return
        # n accepted, then one rejected unless the whole window went through.
        tried = n_accepted + (0 if n_accepted >= k else 1)
        self.accepted = self.accepted * decay + n_accepted
        self.tried = self.tried * decay + tried


@dataclass
class VerifyCost:
    """t_verify(k, load) = a + b k + c load + d k load, fitted online by decayed ridge regression.

    Solves (X'WX + n S^2) theta = X'Wy + n S^2 theta0: the prior theta0 weighs like n =
    VERIFY_PRIOR_ROUNDS rounds at typical feature sizes S, holds alone until rounds arrive, and
    fades as they do. Coefficients are kept >= 0: time never falls with k or load.
    """

    prior: tuple[float, float, float, float] = PRIOR_VERIFY
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])  # [4, 4]
    xty: list[float] = field(default_factory=lambda: [0.0] * 4)  # [4]
    rounds: float = 0.0

    @staticmethod
    def features(k: int, load: float) -> tuple[float, float, float, float]:
        return (1.0, float(k), load, k * load)

    def update(self, k: int, load: float, verify_ms: float, decay: float = VERIFY_DECAY) -> None:
        x = self.features(k, load)
        for i in range(4):
            self.xty[i] = self.xty[i] * decay + x[i] * verify_ms
            for j in range(4):
                self.xtx[i][j] = self.xtx[i][j] * decay + x[i] * x[j]
        self.rounds = self.rounds * decay + 1.0

    def coefficients(self) -> tuple[float, float, float, float]:
        matrix = [row[:] for row in self.xtx]
        rhs = self.xty[:]
        for i, scale in enumerate(VERIFY_FEATURE_SCALE):
            matrix[i][i] += VERIFY_PRIOR_ROUNDS * scale**2
            rhs[i] += VERIFY_PRIOR_ROUNDS * scale**2 * self.prior[i]
        a, b, c, d = (max(0.0, value) for value in _solve(matrix, rhs))
        return (a, b, c, d)

    def predict(self, k: int, load: float) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), self.features(k, load), strict=True))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; the ridge keeps the matrix regular."""
    n = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * n
    for r in reversed(range(n)):
        tail = sum(rows[r][c] * solution[c] for c in range(r + 1, n))
        solution[r] = (rows[r][n] - tail) / rows[r][r]
    return solution


def verifier_load(loads: Iterable[int]) -> float:
    """The load a new request meets: the mean of the live verifiers' loads (0 if none)."""
    values = list(loads)
    return sum(values) / len(values) if values else 0.0


# --- observations and decisions ----------------------------------------------------------------


@dataclass(frozen=True)
class RoundObservation:
    """What one verified round measured."""

    session_id: str
    device_id: str
    draft_model: str
    task_type: str
    k: int  # tokens drafted
    n_accepted: int
    t_draft_ms: float
    t_uplink_ms: float | None  # None when the device sent no clock
    t_queue_ms: float
    t_verify_ms: float
    verifier_load: float


@dataclass(frozen=True)
class Candidate:
    draft_model: str
    alpha: float
    draft_ms_per_token: float
    k: int
    expected_tokens: float
    round_ms: float
    tokens_per_s: float


@dataclass(frozen=True)
class Decision:
    """One choice with everything it was made from, so replay can explain it."""

    mode: m.Mode
    draft_model: str
    k: int
    min_confidence: float | None
    # inputs
    device_id: str
    task_type: str
    current_draft: str
    rtt_ms: float
    queue_ms: float
    verifier_load: float
    verify_coefficients: tuple[float, float, float, float]  # a, b, c, d of t_verify
    candidates: tuple[Candidate, ...]
    reason: str

    @property
    def policy(self) -> m.Policy:
        return m.Policy(
            mode=self.mode,
            draft_model=self.draft_model,
            k=self.k,
            min_confidence=self.min_confidence,
        )

    def to_json(self) -> dict[str, Any]:
        """The round's `policy` column: the Policy's fields, and under `decision` its inputs."""
        inputs = asdict(self)
        for name in m.Policy.model_fields:
            inputs.pop(name, None)
        inputs["verify_coefficients"] = list(self.verify_coefficients)
        return {**self.policy.model_dump(mode="json"), "decision": inputs}


class AdaptivePolicy:
    """Learns from every round of every session, and decides the next round of one."""

    def __init__(self, k_max: int = K_MAX, min_confidence: float | None = MIN_CONFIDENCE) -> None:
        self.k_max = k_max
        self.min_confidence = min_confidence
        self._alpha: dict[tuple[str, str, str], AcceptanceRate] = {}
        self._draft_ms: dict[tuple[str, str], Ewma] = {}
        self._rtt_ms: dict[str, Ewma] = {}
        self._queue_ms = Ewma(PRIOR_QUEUE_MS)
        self.verify_cost = VerifyCost()
        self._device_drafts: dict[str, tuple[str, ...]] = {}
        self._used_drafts: dict[str, set[str]] = {}
        self._refused: dict[str, set[str]] = {}  # device -> drafts it did not switch to
        self._asked: dict[str, tuple[str, int]] = {}  # session -> (draft asked, rounds since)

    # --- what we learn --------------------------------------------------------------------

    def set_device_drafts(self, device_id: str, drafts: Sequence[str]) -> None:
        """The drafts a device reports installed (its status message)."""
        self._device_drafts[device_id] = tuple(drafts)
        self._refused.pop(device_id, None)

    def observe_rtt(self, device_id: str, rtt_ms: float) -> None:
        """An RTT the device measured to the coordinator (telemetry)."""
        self._rtt(device_id).update(rtt_ms, TIME_DECAY)

    def observe(self, round_: RoundObservation) -> None:
        key = (round_.device_id, round_.draft_model, round_.task_type)
        self._alpha.setdefault(key, AcceptanceRate()).update(round_.k, round_.n_accepted)
        if round_.k > 0:
            self._draft_cost(round_.device_id, round_.draft_model).update(
                round_.t_draft_ms / round_.k, TIME_DECAY
            )
        if round_.t_uplink_ms is not None:
            # One leg measured; the way back crosses the same link.
            self._rtt(round_.device_id).update(2.0 * round_.t_uplink_ms, TIME_DECAY)
        self._queue_ms.update(round_.t_queue_ms, TIME_DECAY)
        self.verify_cost.update(round_.k, round_.verifier_load, round_.t_verify_ms)
        self._used_drafts.setdefault(round_.device_id, set()).add(round_.draft_model)
        self._note_switch(round_)

    def _note_switch(self, round_: RoundObservation) -> None:
        asked = self._asked.get(round_.session_id)
        if asked is None:
            return
        draft, rounds = asked
        if round_.draft_model == draft:
            del self._asked[round_.session_id]
        elif rounds + 1 >= REFUSED_AFTER_ROUNDS:
            self._refused.setdefault(round_.device_id, set()).add(draft)
            del self._asked[round_.session_id]
        else:
            self._asked[round_.session_id] = (draft, rounds + 1)

    def forget_session(self, session_id: str) -> None:
        self._asked.pop(session_id, None)

    def _rtt(self, device_id: str) -> Ewma:
        return self._rtt_ms.setdefault(device_id, Ewma(PRIOR_RTT_MS))

    def _draft_cost(self, device_id: str, draft: str) -> Ewma:
        prior = PRIOR_DRAFT_MS_PER_TOKEN.get(draft, PRIOR_NEURAL_DRAFT_MS_PER_TOKEN)
        return self._draft_ms.setdefault((device_id, draft), Ewma(prior))

    # --- what we decide -------------------------------------------------------------------

    def alpha(self, device_id: str, draft: str, task_type: str) -> float:
        rate = self._alpha.get((device_id, draft, task_type))
        if rate is None:
            # No round of this task yet: what this device and draft do on any task.
            seen = [r for (dev, d, _), r in self._alpha.items() if dev == device_id and d == draft]
            if seen:
                pooled = AcceptanceRate(
                    accepted=sum(r.accepted for r in seen), tried=sum(r.tried for r in seen)
                )
                return pooled.alpha
            return AcceptanceRate().alpha
        return rate.alpha

    def candidate_drafts(self, device_id: str, current_draft: str) -> list[str]:
        installed = self._device_drafts.get(device_id, ())
        used = sorted(self._used_drafts.get(device_id, set()))
        refused = self._refused.get(device_id, set())
        names = dict.fromkeys([current_draft, *installed, *BUILTIN_DRAFTS, *used])
        return [name for name in names if name == current_draft or name not in refused]

    def best_window(
        self, alpha: float, draft_ms_per_token: float, fixed_ms: float, load: float
    ) -> tuple[int, float, float]:
        """(k, E, T) with the highest E / T for k in [K_MIN, k_max]."""
        best: tuple[int, float, float] | None = None
        for k in range(K_MIN, self.k_max + 1):
            tokens = expected_tokens(alpha, k)
            round_ms = k * draft_ms_per_token + fixed_ms + self.verify_cost.predict(k, load)
            if best is None or tokens / round_ms > best[1] / best[2]:
                best = (k, tokens, round_ms)
        assert best is not None
        return best

    def decide(
        self,
        session_id: str,
        device_id: str,
        task_type: str,
        current_draft: str,
        verifier_load: float,
    ) -> Decision:
        rtt_ms = self._rtt(device_id).value
        queue_ms = self._queue_ms.value
        candidates: list[Candidate] = []
        for draft in self.candidate_drafts(device_id, current_draft):
            alpha = self.alpha(device_id, draft, task_type)
            per_token = self._draft_cost(device_id, draft).value
            k, tokens, round_ms = self.best_window(
                alpha, per_token, rtt_ms + queue_ms, verifier_load
            )
            rate = tokens / round_ms * 1000.0 if round_ms > 0 else math.inf
            candidates.append(Candidate(draft, alpha, per_token, k, tokens, round_ms, rate))
        current = candidates[0]  # candidate_drafts puts the current draft first
        best = max(candidates, key=lambda c: c.tokens_per_s)
        if best.draft_model != current.draft_model and (
            best.tokens_per_s > current.tokens_per_s * SWITCH_MARGIN
        ):
            chosen = best
            reason = (
                f"switch to {best.draft_model}: {best.tokens_per_s:.1f} tok/s predicted over "
                f"{current.tokens_per_s:.1f} with {current.draft_model}"
            )
            self._asked[session_id] = (best.draft_model, 0)
        else:
            chosen = current
            reason = f"keep {current.draft_model}: {current.tokens_per_s:.1f} tok/s predicted"
        return Decision(
            mode=m.Mode.DISTRIBUTED,
            draft_model=chosen.draft_model,
            k=chosen.k,
            min_confidence=self.min_confidence,
            device_id=device_id,
            task_type=task_type,
            current_draft=current_draft,
            rtt_ms=rtt_ms,
            queue_ms=queue_ms,
            verifier_load=verifier_load,
            verify_coefficients=self.verify_cost.coefficients(),
            candidates=tuple(candidates),
            reason=reason,
        )
