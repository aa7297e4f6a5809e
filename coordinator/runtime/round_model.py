"""The model of a round the adaptive policy rates windows with: tokens committed E, time
T and the drafted tokens n(k), from the measured acceptance, proposal length and
verify cost (the formulas are in the policy module's docstring)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from broker import messages as m

K_MIN = 1  # k = 0 would stop drafting, and with it every measurement of a


K_MAX = 16


# Rounds the coordinator runs for one cloud request before the agent asks again: what bounds the
# work for a device that vanished, and what spreads one RTT over the rounds of a request.
CLOUD_STREAM_ROUNDS = 64


# Exponential forgetting: each new observation weighs as much as the last ~1/(1 - decay).
ALPHA_DECAY = 0.9


VERIFY_DECAY = 0.98


# Priors, used until measurements replace them. An unknown draft gets a middling a and the cost
# of a small neural draft on a phone-class CPU; the copying drafters cost almost nothing.
PRIOR_ALPHA = 0.5


PRIOR_ALPHA_WEIGHT = 2.0  # in tried tokens


# t_verify = a + b k + c load + d k load + e waits, in ms: a rough guess for a CPU verifier of the
# 135M target, not a measurement; measured rounds replace it within a few rounds.
PRIOR_VERIFY = (25.0, 2.0, 5.0, 2.0, 0.0)


VERIFY_PRIOR_ROUNDS = 4.0  # how many rounds' worth of belief the prior holds


# Typical sizes of k, load, k * load and waits; the intercept is held only lightly (0.05), since
# every round measures it and a prior intercept far off would bias the whole fit through
# collinearity.
VERIFY_FEATURE_SCALE = (0.05, 4.0, 1.0, 4.0, 1.0)


# The prior's weight on each coefficient: n S^2 of VerifyCost's solve.
_RIDGE = tuple(VERIFY_PRIOR_ROUNDS * scale**2 for scale in VERIFY_FEATURE_SCALE)


ALPHA_CAP = 0.98  # E(a, k) grows without bound as a -> 1; a few misses always happen


PRIOR_FILL_WEIGHT = 1.0  # in rounds: a drafter is taken to fill its window until seen not to


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
    """t_verify = a + b k + c load + d k load + e waits, fitted online by decayed ridge regression.

    `waits` is 1 for a round that waited on a device (distributed) and 0 for one streamed back to
    back (cloud): the verifier of the first sat idle and cold (caches, clocks, and on a shared
    host the devices' own work) and pays for it, and e is what the measured rounds say it pays.
    Both modes teach the other coefficients. Solves (X'WX + n S^2) theta = X'Wy + n S^2 theta0:
    the prior theta0 weighs like n = VERIFY_PRIOR_ROUNDS rounds at typical feature sizes S,
    holds alone until rounds arrive, and fades as they do; so e, unmeasured for a while, drifts
    back to 0, and a mode judged on old rounds gets tried again. Coefficients are kept >= 0: time
    never falls with k or load, nor by waiting (what noise says otherwise is noise).
    """

    prior: tuple[float, ...] = PRIOR_VERIFY  # [5]
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 5 for _ in range(5)])  # [5, 5]
    xty: list[float] = field(default_factory=lambda: [0.0] * 5)  # [5]
    rounds: float = 0.0
    # The verifiers' own cost model, when they report one (VerifierStatus.pass_cost): a pass of
    # B rows of T positions costs a' + b' B + c' B T ms, and a round at `load` is a row beside
    # `load` others, of k + 1 positions. It stands for the fit's a..d, which extrapolated from
    # rounds at loads 1-4 to a lone session at load 0 with an intercept near 0 (bench e2e: a
    # plain round predicted at 0.2 ms where they took 24, so a lone session decoded plainly for
    # its whole answer); e is then what the rounds that waited on a device took beyond it.
    reported: tuple[float, float, float] | None = None
    waits_excess: Ewma = field(default_factory=lambda: Ewma(0.0, 0.0))
    # The solution, kept until the next update: a decision predicts hundreds of windows.
    _solved: tuple[float, ...] | None = field(default=None, repr=False)

    @staticmethod
    def features(k: float, load: float, waits: bool = True) -> tuple[float, ...]:
        return (1.0, float(k), load, k * load, 1.0 if waits else 0.0)

    def update(
        self,
        k: int,
        load: float,
        verify_ms: float,
        decay: float = VERIFY_DECAY,
        waits: bool = True,
    ) -> None:
        # features(k, load, waits), inline
        x0, x1, x2, x3, x4 = 1.0, float(k), load, k * load, 1.0 if waits else 0.0
        # Written out: this runs on every round the coordinator hears, and loops over the 5 x 5
        # entries cost more than the arithmetic. X'X is symmetric and x_i x_j is x_j x_i bit for
        # bit, so each pair is computed once and written to both places.
        y = self.xty
        y[0] = y[0] * decay + x0 * verify_ms
        y[1] = y[1] * decay + x1 * verify_ms
        y[2] = y[2] * decay + x2 * verify_ms
        y[3] = y[3] * decay + x3 * verify_ms
        y[4] = y[4] * decay + x4 * verify_ms
        r0, r1, r2, r3, r4 = self.xtx
        r0[0] = r0[0] * decay + x0 * x0
        r0[1] = r1[0] = r0[1] * decay + x0 * x1
        r0[2] = r2[0] = r0[2] * decay + x0 * x2
        r0[3] = r3[0] = r0[3] * decay + x0 * x3
        r0[4] = r4[0] = r0[4] * decay + x0 * x4
        r1[1] = r1[1] * decay + x1 * x1
        r1[2] = r2[1] = r1[2] * decay + x1 * x2
        r1[3] = r3[1] = r1[3] * decay + x1 * x3
        r1[4] = r4[1] = r1[4] * decay + x1 * x4
        r2[2] = r2[2] * decay + x2 * x2
        r2[3] = r3[2] = r2[3] * decay + x2 * x3
        r2[4] = r4[2] = r2[4] * decay + x2 * x4
        r3[3] = r3[3] * decay + x3 * x3
        r3[4] = r4[3] = r3[4] * decay + x3 * x4
        r4[4] = r4[4] * decay + x4 * x4
        self.rounds = self.rounds * decay + 1.0
        self._solved = None
        reported = self.reported
        if reported is not None and waits:
            rows = 1.0 + load
            pass_ms = reported[0] + reported[1] * rows + reported[2] * rows * (k + 1)
            self.waits_excess.update(verify_ms - pass_ms, decay)

    def set_reported(self, pass_cost: tuple[float, float, float] | None) -> None:
        """The verifiers' pass cost (a', b', c'), or None to go back to the fit."""
        if pass_cost != self.reported:
            self.reported = pass_cost
            self._solved = None

    def coefficients(self) -> tuple[float, ...]:
        """(a, b, c, d, e)."""
        if self._solved is not None:
            return self._solved
        if self.reported is not None:
            # a' + b' (load + 1) + c' (load + 1) (k + 1), gathered by 1, k, load and k load.
            a1, b1, c1 = self.reported
            excess = self.waits_excess.value
            self._solved = (a1 + b1 + c1, c1, b1 + c1, c1, excess if excess > 0.0 else 0.0)
            return self._solved
        matrix = [row[:] for row in self.xtx]
        rhs = self.xty[:]
        for i, ridge in enumerate(_RIDGE):
            matrix[i][i] += ridge
            rhs[i] += ridge * self.prior[i]
        a, b, c, d, e = (max(0.0, value) for value in _solve(matrix, rhs))
        self._solved = (a, b, c, d, e)
        return self._solved

    def predict(self, k: float, load: float, waits: bool = True) -> float:
        return self.predict_windows((k,), load, waits)[0]

    def predict_windows(self, ks: Sequence[float], load: float, waits: bool = True) -> list[float]:
        """t_verify for each window size in `ks` at one load: a + b k + c load + d k load + e
        waits, never below 0, with the fit solved once for all of them."""
        a, b, c, d, e = self.coefficients()
        fixed = a + c * load + (e if waits else 0.0)
        per_token = b + d * load
        # max(0.0, t) written out (a decision predicts hundreds of windows); NaN gives 0.0 too.
        out = []
        for k in ks:
            t = fixed + per_token * k
            out.append(t if t > 0.0 else 0.0)
        return out


@dataclass
class ProposalLength:
    """How far a drafter fills its window: per position i, the decayed count of rounds whose
    window allowed an i-th token after i - 1 drafted ones (`allowed`), and of those that drafted
    it (`drafted`). Positions past a window are not counted: the cap stopped them, not the
    drafter. The prior is a drafter that fills its window, held like one round."""

    allowed: list[float] = field(default_factory=lambda: [0.0] * (K_MAX + 1))  # [K_MAX + 1]
    drafted: list[float] = field(default_factory=lambda: [0.0] * (K_MAX + 1))  # [K_MAX + 1]
    # (k, S(1..i) for i = 1..k, n(i) for i = 1..k), kept until the next update: a decision
    # rates this drafter's windows in both modes, and most drafters of a device are never run.
    _curve: tuple[int, list[float], list[float]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def update(self, window: int, n_drafted: int, decay: float = ALPHA_DECAY) -> None:
        window = min(K_MAX, max(window, n_drafted))
        if window <= 0:
            return
        self._curve = None
        # Every position decays; positions 1..reached were allowed a token and count it, and of
        # those 1..n_drafted drafted one (value * decay + 1.0, as decaying, then adding, would).
        reached = min(window, n_drafted + 1)
        allowed, drafted = self.allowed, self.drafted
        for i in range(1, K_MAX + 1):
            if i <= reached:
                allowed[i] = allowed[i] * decay + 1.0
                drafted[i] = drafted[i] * decay + 1.0 if i <= n_drafted else drafted[i] * decay
            else:
                allowed[i] *= decay
                drafted[i] *= decay

    def go_on(self, i: int) -> float:
        """P(an i-th token is proposed | i - 1 were and the window allows one more)."""
        return (self.drafted[i] + PRIOR_FILL_WEIGHT) / (self.allowed[i] + PRIOR_FILL_WEIGHT)

    def survival(self, k: int) -> list[float]:
        """S(1..i) for i = 1..k: the chance that the drafter proposes at least i tokens."""
        return list(self.curve(k)[0])

    def curve(self, k: int) -> tuple[list[float], list[float]]:
        """(survival(k), drafted_by_window of it), kept until the next update; callers
        read them and must not change them."""
        if self._curve is None or self._curve[0] != k:
            # go_on(min(i, K_MAX)) and drafted_by_window written into one loop: a drafter's
            # curve is rebuilt after each of its rounds, for the next decision.
            values: list[float] = []
            by_window: list[float] = []
            reach, drafted_sum = 1.0, 0.0
            allowed, drafted = self.allowed, self.drafted
            for i in range(1, k + 1):
                j = i if i < K_MAX else K_MAX
                reach *= (drafted[j] + PRIOR_FILL_WEIGHT) / (allowed[j] + PRIOR_FILL_WEIGHT)
                values.append(reach)
                drafted_sum += reach
                by_window.append(drafted_sum)
            self._curve = (k, values, by_window)
        return self._curve[1], self._curve[2]


def expected_tokens_capped(alpha: float, survival: Sequence[float]) -> float:
    """E for a window the drafter may not fill: 1 + sum_i S(1..i) a^i (the target's own token,
    plus each drafted position, proposed and accepted along with every one before it)."""
    by_window = expected_tokens_by_window(alpha, survival)
    return by_window[-1] if by_window else 1.0


def expected_tokens_by_window(alpha: float, survival: Sequence[float]) -> list[float]:
    """E of every window k = 1..len(survival) (expected_tokens_capped of each prefix of the
    survival), in one pass: what the policy rates each window with."""
    values: list[float] = []
    tokens = 1.0
    accepted = 1.0
    for reach in survival:
        accepted *= alpha
        tokens += reach * accepted
        values.append(tokens)
    return values


def best_window(
    cost: VerifyCost,
    alpha: float,
    survival: Sequence[float],
    drafted: Sequence[float],
    draft_ms_per_token: float,
    fixed_ms: float,
    load: float,
    mode: m.Mode,
    beside: float,
) -> tuple[int, float, float, float, float]:
    """(k, E, T, n(k), L) of the window k in [K_MIN, len(survival)] with the highest (E - L) / T
    (the first such k): E is expected_tokens_by_window's, n(k) the drafted tokens given
    (`drafted`, drafted_by_window of the survival), T window_ms's with VerifyCost.predict_windows'
    t_verify, and L what `beside` host streams lose to a device window (batch_cost.streams_lost;
    0 in a host mode, which waits on no device). Each window in one pass: a decision rates every
    window of every candidate, and building each term's list for all of them cost twice the
    arithmetic. Every term is the same float expression, in the same order, as the function
    named for it computes, so the result is theirs bit for bit (tests hold it to them)."""
    a, b, c, d, e = cost.coefficients()
    waits = mode not in m.HOST_MODES
    # VerifyCost.predict_windows(drafted, load, waits): fixed + per_token k, never below 0.
    verify_fixed = a + c * load + (e if waits else 0.0)
    per_verify = b + d * load
    # window_ms: drafting on the host is slowed by the sessions it drafts for.
    per_draft = draft_ms_per_token * (1.0 + load) if mode is m.Mode.CLOUD else draft_ms_per_token
    # streams_lost's terms: a stream's pass (predict(0, load, waits=False)), the widened pass
    # (predict_windows(drafted, load, waits=False)) and a pass apart (at load 1, waiting).
    stream_fixed = a + c * load + 0.0
    stream_pass = stream_fixed + per_verify * 0
    stream_pass = stream_pass if stream_pass > 0.0 else 0.0
    apart_fixed = a + c * 1.0 + e
    apart_per = b + d * 1.0
    losing = beside > 0 and waits and stream_pass > 0
    best: tuple[int, float, float, float, float] | None = None
    best_rate = 0.0
    tokens = accepted = 1.0
    k_min = K_MIN
    for k, reach, n in zip(range(1, len(survival) + 1), survival, drafted, strict=True):
        accepted *= alpha
        tokens += reach * accepted
        if k < k_min:
            continue
        per_verify_n = per_verify * n  # the widened pass's too
        verify = verify_fixed + per_verify_n
        total = n * per_draft + fixed_ms + (verify if verify > 0.0 else 0.0)
        lost = 0.0
        if losing:
            wide = stream_fixed + per_verify_n
            alone = apart_fixed + apart_per * n
            alone = alone if alone > 0.0 else 0.0
            held = (wide if wide > 0.0 else 0.0) - stream_pass
            held = alone if alone < held else held  # min(held, alone), as min() picks
            lost = beside * (held if held > 0.0 else 0.0) / stream_pass
        rate = (tokens - lost) / total
        if best is None or rate > best_rate:
            best, best_rate = (k, tokens, total, n, lost), rate
    if best is None:
        raise ValueError(f"no window of at least {K_MIN} to rate")
    return best


def drafted_by_window(survival: Sequence[float]) -> list[float]:
    """n(k) of every window k = 1..len(survival): the tokens a drafter is expected to propose
    when allowed k, sum_i S(1..i)."""
    values: list[float] = []
    drafted = 0.0
    for reach in survival:
        drafted += reach
        values.append(drafted)
    return values


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; the ridge keeps the matrix regular."""
    n = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = col  # the first row of the largest |value| in this column, as max() picks it
        for r in range(col + 1, n):
            if abs(rows[r][col]) > abs(rows[pivot][col]):
                pivot = r
        rows[col], rows[pivot] = rows[pivot], rows[col]
        top = rows[col]
        for r in range(col + 1, n):
            row = rows[r]
            factor = row[col] / top[col]
            for c in range(col, n + 1):
                row[c] -= factor * top[c]
    solution = [0.0] * n
    for r in reversed(range(n)):
        tail = sum(rows[r][c] * solution[c] for c in range(r + 1, n))
        solution[r] = (rows[r][n] - tail) / rows[r][r]
    return solution


def verifier_load(loads: Iterable[int]) -> float:
    """The load a new request meets: the mean of the live verifiers' loads (0 if none)."""
    values = list(loads)
    return sum(values) / len(values) if values else 0.0


def round_ms(
    mode: m.Mode,
    k: int,
    draft_ms_per_token: float,
    rtt_ms: float,
    queue_ms: float,
    verify_ms: float,
    load: float,
) -> float:
    """T(k) of one round in a mode.

    distributed: k t_draft(device) + RTT + queue + t_verify.
    cloud: k t_draft(host) (1 + load) + RTT / CLOUD_STREAM_ROUNDS + queue + t_verify; the host
    drafts for every session of the batch before the batch's pass, and the stream pays the RTT
    once per request.
    """
    fixed_ms = rtt_ms / CLOUD_STREAM_ROUNDS if mode is m.Mode.CLOUD else rtt_ms
    return window_ms(mode, (k,), draft_ms_per_token, fixed_ms + queue_ms, (verify_ms,), load)[0]


def window_ms(
    mode: m.Mode,
    drafted: Sequence[float],
    draft_ms_per_token: float,
    fixed_ms: float,
    verify_ms: Sequence[float],
    load: float,
) -> list[float]:
    """T of rounds that draft `drafted` tokens each and verify in `verify_ms`: their drafting
    (on the host, slowed by the sessions it drafts for: times 1 + load), what a round costs
    beyond drafting and verifying (`fixed_ms`: RTT and queue, or the stream's share of the RTT),
    and the verification."""
    per_token = draft_ms_per_token * (1.0 + load) if mode is m.Mode.CLOUD else draft_ms_per_token
    return [n * per_token + fixed_ms + v for n, v in zip(drafted, verify_ms, strict=True)]
