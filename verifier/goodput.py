"""Goodput control of a host pass: the window of its streams that commits the most tokens/s.

A pass of B rows with T positions each costs cost(B, T) on this verifier (every row is padded to
the longest, so the pass pays for its widest window). A stream's window of k commits E(k) tokens
on average, from the acceptance per draft position its drafter has shown on this task here. The
pass's window k is the one that maximises (sum of E over its rows) / (cost(B, T(k)) + drafting):
SmartSpec's goodput rule, over the whole batch rather than one session, with k = 0 (plain
decoding, no drafter) always a candidate. On a compute-bound CPU verifier a loaded batch picks
k = 0, and a lone session a wide window (DESIGN.md, "What a batch costs on this machine").
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from broker.messages import PassChoice

# The windows a pass considers (beyond its streams' caps they are cut to the cap).
WINDOWS = (0, 1, 2, 3, 4, 6, 8)
# Forgetting of the cost fit: a sample weighs half after this many passes, so the fit follows
# a host whose load drifts (other processes, thermal limits) within a minute or so.
COST_HALF_LIFE_PASSES = 400.0
# How far one pass moves the mean cost of its own shape (rows, positions), and the most one
# sample may differ from it (a pass stalled by the host counts as this many times slower).
SHAPE_WEIGHT = 0.1
SHAPE_CLIP = 1.5
# A batch size's plain pass not timed in this many passes is timed again before a window is
# chosen over it; a sample of any shape not timed in as many passes moves its mean by
# STALE_SHAPE_WEIGHT. A plain cost taken once in a pass that did more (bench e2e at 16 streams:
# 146 ms, where steady plain passes took 90) otherwise stood for the whole run, since the
# windows it favoured never timed it.
PLAIN_REMEASURE_PASSES = 24
STALE_SHAPE_WEIGHT = 0.5
# A window's shape that looks dear is never chosen, so never timed again: one slow pass of it
# (bench e2e at 4 streams: the first pass of 4 rows x 2 positions took 68.6 ms where such passes
# take 45-48, and stood for the rest of the run, so no window of 1 was chosen there again) would
# price it for good. Every DOUBT_EVERY passes, a window's shape not timed in FORGET_AFTER passes
# is forgotten where it is dearer than the shape's other points (or the fit) predict without it;
# the next pass of that window times it again. A shape that truly costs more is then tried once
# every FORGET_AFTER passes or so, a fraction of a pass in ~100.
DOUBT_EVERY = 32
FORGET_AFTER = 4 * PLAIN_REMEASURE_PASSES
# Forgetting of acceptance: per window position, per (drafter, task).
ACCEPT_HALF_LIFE = 200.0
# A stream's own rounds are its best guide (acceptance varies by prompt more than by task: in
# bench e2e at 4 sessions, windows of 2 were chosen throughout a wave on the task's rate from
# other prompts, 1.9 tokens a row predicted, 1.3-1.5 made); its rate at each window position is
# the (drafter, task) rate pulled towards what it accepted itself, the two alike after this
# many of its rounds. The streams whose rounds are kept at most (each goes when its stream
# ends; the bound is for streams that end without a word).
STREAM_PRIOR_WEIGHT = 4.0
MAX_STREAMS_KEPT = 4096
# What a drafter is taken to achieve before this host has seen it on a task: the coordinator's
# estimate when it sends one, else this; worth PRIOR_WEIGHT observations.
PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 4.0
# A copying drafter's draft costs ~0.05 ms a token and a small neural one 1-2 ms on this CPU
# (bench models); until measured, a drafter is taken to cost this.
PRIOR_DRAFT_MS_PER_TOKEN = 1.0
# How far one window's draft time may pull the estimate (a factor either way of it): a neural
# draft's first window on a session also prefills it on the whole prompt (20-30x a token's
# cost), and an estimate taken from it priced the drafter out for the rest of the run, where
# no window was drafted to correct it. Each window still moves it by a tenth.
DRAFT_MS_CLIP = 3.0
DRAFT_MS_FORGET = 0.9
# The least spread of the rows a drafter's passes drafted (their weighted variance over their mean
# square) that splits its cost into a step's and a row's; below it, every row costs the mean.
DRAFT_SPREAD_MIN = 0.02
# A speculative window's goodput is discounted by this fraction of what it adds to the pass's
# cost: the estimates are noisy (a pass's cost varies by 5-10% on a shared host), and a wrong
# window costs the whole padded pass. A window that adds 30% to a 32-row pass must promise 15%
# more than plain decoding (measured on bench e2e: k=1 at 32 rows chosen for a predicted +10%
# came out at +5%). A flat 15% kept lone sessions decoding plainly where a window was nearly
# free. Beside other rows a window also slows the rows that accept little (every row pays the
# padded pass), so the session that finishes last finishes later: at 4 streams a quarter of
# what a window adds, not a half, sped passes up by a fifth and waves of 4 down by 2-8%
# (bench e2e: 0.90-0.95 of plain serving against 0.95-1.00, the slowest session setting each
# wave's end). A lone row's window costs no one else: there the quarter holds (1.52-1.56 of
# plain serving at one session in two runs, against 1.28-1.48 in four with the half).
SPECULATION_MARGIN = 0.5
LONE_SPECULATION_MARGIN = 0.25


def _decay(half_life: float) -> float:
    return float(0.5 ** (1.0 / half_life))


class PassCost:
    """cost(B, T) in ms: what passes of B rows and T positions took here, and a fit between.

    The fit is cost = a + b B + c B T (a the fixed cost of a pass, b a row's, c a position's),
    by exponentially weighted least squares. It cannot follow every shape: a lone row is padded
    to two for consistent decoding, so its positions cost ~1 ms each where a wide batch's cost
    2.5. So the passes seen are also kept by shape (an exponentially weighted mean per (B, T)),
    and a prediction for a B that has been seen follows its own points in T, linearly between
    the two nearest; the fit fills what has not been seen. Seeded with the profile the verifier
    takes when it starts, refined by every pass without a prefill.
    """

    def __init__(self, half_life: float = COST_HALF_LIFE_PASSES) -> None:
        self._forget = _decay(half_life)
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._coefficients = (30.0, 2.0, 2.5)  # the shape of DESIGN.md's table, before any data
        self._seen: dict[int, dict[int, float]] = {}  # rows -> positions -> mean ms
        self._seen_at: dict[tuple[int, int], int] = {}  # (rows, positions) -> its last sample
        self.samples = 0

    @staticmethod
    def _features(rows: int, positions: int) -> tuple[float, float, float]:
        return (1.0, float(rows), float(rows * positions))

    def observe(self, rows: int, positions: int, ms: float, weight: float = 1.0) -> None:
        x0, x1, x2 = self._features(rows, positions)
        # Written out (every pass runs it): x'y and X'X decay and add weight * x_i * (y or x_j),
        # whose first product is the same for a whole row.
        forget, xty, (r0, r1, r2) = self._forget, self._xty, self._xtx
        w0, w1, w2 = weight * x0, weight * x1, weight * x2
        xty[0] = xty[0] * forget + w0 * ms
        xty[1] = xty[1] * forget + w1 * ms
        xty[2] = xty[2] * forget + w2 * ms
        r0[0] = r0[0] * forget + w0 * x0
        r0[1] = r0[1] * forget + w0 * x1
        r0[2] = r0[2] * forget + w0 * x2
        r1[0] = r1[0] * forget + w1 * x0
        r1[1] = r1[1] * forget + w1 * x1
        r1[2] = r1[2] * forget + w1 * x2
        r2[0] = r2[0] * forget + w2 * x0
        r2[1] = r2[1] * forget + w2 * x1
        r2[2] = r2[2] * forget + w2 * x2
        self.samples += 1
        by_positions = self._seen.setdefault(rows, {})
        seen = by_positions.get(positions)
        last = self._seen_at.get((rows, positions))
        self._seen_at[(rows, positions)] = self.samples
        if seen is None:
            # A first sample far off the fit (a pass that waited on a busy host) would stand
            # for its shape until the next one, which a shape that looks dear never gets.
            fit = self.fitted(rows, positions)
            by_positions[positions] = min(max(ms, fit / SHAPE_CLIP), fit * SHAPE_CLIP)
        else:
            ms = min(max(ms, seen / SHAPE_CLIP), seen * SHAPE_CLIP)
            stale = last is not None and self.samples - last > PLAIN_REMEASURE_PASSES
            by_positions[positions] = seen + (STALE_SHAPE_WEIGHT if stale else SHAPE_WEIGHT) * (
                ms - seen
            )
        solved = _solve3(self._xtx, self._xty)
        if solved is not None:
            # Negative terms fit noise; a pass never costs less for more rows or positions.
            a, b, c = solved
            self._coefficients = (max(0.0, a), max(0.0, b), max(1e-3, c))
        if self.samples % DOUBT_EVERY == 0:
            self._forget_dear_shapes()

    def _forget_dear_shapes(self) -> None:
        """Forget each window's shape (more than one position) not timed lately that is dearer
        than what the rest predicts for it (see FORGET_AFTER)."""
        stale = [
            shape
            for shape, last in self._seen_at.items()
            if shape[1] > 1 and self.samples - last > FORGET_AFTER
        ]
        for rows, positions in stale:
            by_positions = self._seen[rows]
            kept = by_positions.pop(positions)
            if kept > self.predict(rows, positions):
                del self._seen_at[(rows, positions)]
            else:
                by_positions[positions] = kept

    def measured(self, rows: int, positions: int, within: int | None = None) -> bool:
        """Whether a pass of this shape has been timed here (the profile's passes count), in
        the last `within` passes when given."""
        last = self._seen_at.get((rows, positions))
        return last is not None and (within is None or self.samples - last <= within)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return self._coefficients

    def fitted(self, rows: int, positions: int) -> float:
        a, b, c = self._coefficients
        return a + b * rows + c * rows * positions

    def predict(self, rows: int, positions: int) -> float:
        seen = self._seen.get(rows)
        if not seen:
            return self.fitted(rows, positions)
        if positions in seen:
            return seen[positions]
        if len(seen) == 1:  # one point of this B: the fit's slope from it
            (t,) = seen
            fit_here, fit_there = self.fitted(rows, positions), self.fitted(rows, t)
            slope = seen[t] + fit_here - fit_there
            # Below the point, a fit steeper than the point (passes that waited on a loaded
            # host pulled it up) went negative: -926 ms, which stopped a verifier. The point
            # scaled by the fit's ratio stays positive; the prediction is never below it.
            scaled = seen[t] * fit_here / fit_there
            return scaled if scaled > slope else slope  # max(slope, scaled)
        # The two nearest points (the lower first where two are as near), in order; of two
        # points, both. A pass predicts a few shapes per window it weighs: no sort when none
        # is needed, and max() of two written out.
        if len(seen) == 2:
            t1, t2 = sorted(seen)
        else:
            t1, t2 = sorted(sorted(seen, key=lambda t: (abs(t - positions), t))[:2])
        slope = (seen[t2] - seen[t1]) / (t2 - t1)
        if positions > t2:
            # Past its widest point, a shape costs at least the fit's price of a position: two
            # noisy points (bench e2e at 14 rows: a plain pass timed slower than the window of
            # 1 after it) made every wider window free, and a window of 4 at 14 rows was
            # predicted at 200 tok/s against plain's 108.
            fit_slope = self._coefficients[2] * rows
            slope = fit_slope if fit_slope > slope else slope
        at = seen[t1] + (slope if slope > 0.0 else 0.0) * (positions - t1)
        return 1e-3 if at < 1e-3 else at


def _solve3(matrix: list[list[float]], rhs: list[float]) -> tuple[float, float, float] | None:
    """The 3x3 system by Cramer's rule; None when it is singular (too few distinct samples)."""
    (m00, m01, m02), (m10, m11, m12), (m20, m21, m22) = matrix
    r0, r1, r2 = rhs
    d = _det3(m00, m01, m02, m10, m11, m12, m20, m21, m22)
    scale = max(map(abs, (m00, m01, m02, m10, m11, m12, m20, m21, m22))) or 1.0
    if abs(d) <= 1e-9 * scale**3:
        return None
    # Each column replaced by the right-hand side in turn (written out: every pass solves it).
    return (
        _det3(r0, m01, m02, r1, m11, m12, r2, m21, m22) / d,
        _det3(m00, r0, m02, m10, r1, m12, m20, r2, m22) / d,
        _det3(m00, m01, r0, m10, m11, r1, m20, m21, r2) / d,
    )


def _det3(
    m00: float,
    m01: float,
    m02: float,
    m10: float,
    m11: float,
    m12: float,
    m20: float,
    m21: float,
    m22: float,
) -> float:
    """The determinant of a 3x3 matrix given row by row, expanded along its first row."""
    return (
        m00 * (m11 * m22 - m12 * m21)
        - m01 * (m10 * m22 - m12 * m20)
        + m02 * (m10 * m21 - m11 * m20)
    )


@dataclass
class _Position:
    reached: float = 0.0  # windows that allowed a token here and had all before it accepted
    accepted: float = 0.0  # of those, the ones whose token here was drafted and accepted


@dataclass
class PositionAcceptance:
    """P(token i is drafted and accepted | tokens 1..i-1 were), for i = 1..MAX, decayed."""

    positions: list[_Position] = field(default_factory=list)
    # prior -> E(0..j) from one pass over the rates (expected_by_window), until the next
    # observe: a pass scores each kind of stream at every window, and its kinds share a few
    # (drafter, task) statistics that change only when a round of theirs is observed.
    _expected: dict[float, list[float]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def observe(self, window: int, drafted: int, accepted: int, forget: float) -> None:
        """A round with a window of `window`, `drafted` tokens proposed, `accepted` kept."""
        self._expected.clear()
        while len(self.positions) < window:
            self.positions.append(_Position())
        for i in range(min(window, accepted + 1)):
            position = self.positions[i]
            position.reached = position.reached * forget + 1.0
            position.accepted = position.accepted * forget + (1.0 if i < accepted else 0.0)
        del drafted  # a short proposal reads as a rejection at its end: both stop the round

    def rates(self, k: int, prior: float) -> list[float]:
        """The chance of each of the first k tokens given the ones before, each seen rate
        pulled towards a prior worth PRIOR_WEIGHT rounds: the first position's is the prior
        given, a deeper one's the position before's. Deep positions are seen only when wide
        windows were chosen, and a copying drafter that got its first tokens right tends to get
        the next ones right too; a fixed prior there made wide windows look worse than they
        are, and they were then never tried."""
        out: list[float] = []
        unseen = _Position()
        pull = prior
        for i in range(k):
            seen = self.positions[i] if i < len(self.positions) else unseen
            pull = (seen.accepted + pull * PRIOR_WEIGHT) / (seen.reached + PRIOR_WEIGHT)
            out.append(pull)
        return out

    def expected_from(self, rates: Sequence[float]) -> list[float]:
        """E(j) for j = 0..len(rates): each position's rate here pulled towards `rates`
        (the (drafter, task) rate at that position), worth STREAM_PRIOR_WEIGHT rounds.

        A position deeper than any window this stream was given has no rounds of its own; it
        takes the rate of the deepest one it had, worth as many rounds as reached that one,
        pulled towards the task's rate there as a position of its own is. Scored on the task's
        rate alone, a stream held to windows it always filled was never offered a wider one
        (`bench e2e` at one session: a summary copying its source, windows of 3 accepted whole
        in five rounds running, kept to 3, where its task's wide windows from other prompts
        held at half; the fixed drafter's windows of 8 on it took 7 rounds to the adaptive
        arm's 9), the same as `rates` carries a task's rate down to its unseen positions."""
        positions = self.positions
        out: list[float] = []
        deepest, reached = 0.0, 0.0  # the deepest own position's rate, and its rounds
        for i, rate in enumerate(rates):
            if i < len(positions):
                position = positions[i]
                own = (position.accepted + rate * STREAM_PRIOR_WEIGHT) / (
                    position.reached + STREAM_PRIOR_WEIGHT
                )
                deepest, reached = own, position.reached
            else:
                own = (deepest * reached + rate * STREAM_PRIOR_WEIGHT) / (
                    reached + STREAM_PRIOR_WEIGHT
                )
            out.append(own)
        return _expected_by_window(out)

    def expected_by_window(self, k: int, prior: float) -> list[float]:
        """E(j) for j = 0..k (at least; more when a wider window was asked since the last
        observe). A window's rates are the first ones of any wider window's, so one pass gives
        every E(j), each the same sum expected_tokens(j) makes."""
        cached = self._expected.get(prior)
        if cached is not None and len(cached) > k:
            return cached
        values = self._expected[prior] = _expected_by_window(self.rates(k, prior))
        return values

    def expected_tokens(self, k: int, prior: float) -> float:
        """E(k) = 1 + sum over i of the chance that tokens 1..i are all accepted."""
        return self.expected_by_window(k, prior)[k]


def _device_tokens(windows: Iterable[int]) -> float:
    """What device-drafted rows with these windows commit, as the pass rule scores them: about
    1 + a window's half each (their acceptance is unknown here)."""
    return sum([1.0 + 0.5 * k for k in windows])


def _expected_by_window(rates: Sequence[float]) -> list[float]:
    """E(j) for j = 0..len(rates): 1 + the chances that tokens 1..i are all accepted, i <= j,
    from each position's rate given the ones before."""
    values = [1.0]
    total, survive = 1.0, 1.0
    for rate in rates:
        survive *= rate
        total += survive
        values.append(total)
    return values


class DraftCost:
    """What one drafter's windows cost this host, per window token, for n rows drafted together
    in a pass: a + b n. A feature head steps every row of a pass in one call (16 rows in 1.9 ms
    on this CPU, one row in 1.2), so its cost per row falls with the rows; copying and a draft
    model with a cache of its own per session cost the same per row at any n (a = 0).

    Fitted by exponentially weighted least squares over the passes' (n, ms per token), from a
    prior of PRIOR_DRAFT_MS_PER_TOKEN for a lone row. While every sample has the same n, the
    fit cannot split a from b and takes a = 0 (each row as dear as the mean: what a drafter
    seen on lone sessions is assumed to cost in a batch until it has drafted one)."""

    def __init__(self) -> None:
        # Weighted sums of 1, n, n^2, y, n y; the prior is a lone row at the prior cost, worth
        # what the samples of a steady run weigh together (1 / (1 - DRAFT_MS_FORGET)), so a
        # first window moves the estimate by a tenth.
        w, y = 1.0 / (1.0 - DRAFT_MS_FORGET), PRIOR_DRAFT_MS_PER_TOKEN
        self._s = [w, w, w, w * y, w * y]
        self._a, self._b = 0.0, PRIOR_DRAFT_MS_PER_TOKEN

    @property
    def terms(self) -> tuple[float, float]:
        return self._a, self._b

    def predict(self, rows: int) -> float:
        """ms per window token for `rows` rows drafted together."""
        return self._a + self._b * rows

    def observe(self, rows: int, per_token_ms: float) -> None:
        """A pass drafted `rows` rows of this drafter for `per_token_ms` per window token."""
        if rows <= 0:
            return
        old = self.predict(rows)
        y = min(max(per_token_ms, old / DRAFT_MS_CLIP), old * DRAFT_MS_CLIP)
        n, f = float(rows), DRAFT_MS_FORGET
        s = self._s
        s[0] = s[0] * f + 1.0
        s[1] = s[1] * f + n
        s[2] = s[2] * f + n * n
        s[3] = s[3] * f + y
        s[4] = s[4] * f + n * y
        # det / (s0 s2) is the weighted variance of n over its mean square: the n seen must
        # differ in earnest (the prior's lone row fades) for a and b to be told apart.
        det = s[0] * s[2] - s[1] * s[1]
        if det > DRAFT_SPREAD_MIN * s[0] * s[2]:
            a = (s[2] * s[3] - s[1] * s[4]) / det
            b = (s[0] * s[4] - s[1] * s[3]) / det
            if a >= 0.0 and b >= 0.0:
                self._a, self._b = a, b
                return
            if b < 0.0:  # more rows never cost less in all: a flat cost per pass
                self._a, self._b = s[3] / s[0], 0.0
                return
        # One n so far (or a fit that went negative at n = 0): per row, as the mean says.
        self._a, self._b = 0.0, s[4] / s[2] if s[2] > 0.0 else PRIOR_DRAFT_MS_PER_TOKEN


class StreamRow(NamedTuple):
    """What the pass knows of one stream it is about to run a round of. Immutable, and a tuple:
    a pass counts its kinds of stream by the rows themselves (hashed and compared in C)."""

    draft: str | None  # None: a plain stream (no drafter)
    task_type: str
    cap: int  # the most tokens it may draft this round (cloud_k, cut to fit max_new)
    prior: float  # the coordinator's acceptance estimate, or PRIOR_ACCEPT
    # The stream (its session), whose own rounds then weigh in; None: the (drafter, task)
    # rate alone, and rows alike are scored as one kind.
    stream: str | None = None


class GoodputControl:
    """The verifier's cost model and acceptance statistics, and the pass rule over them."""

    def __init__(self, windows: Sequence[int] = WINDOWS) -> None:
        self.cost = PassCost()
        self.windows = tuple(sorted(set(windows)))
        self._accept: dict[tuple[str, str], PositionAcceptance] = {}
        # stream -> the drafter of its own rounds, and what they accepted
        self._stream_accept: OrderedDict[str, tuple[str, PositionAcceptance]] = OrderedDict()
        self._drafting: dict[str, DraftCost] = {}
        self._accept_forget = _decay(ACCEPT_HALF_LIFE)
        self._unseen = PositionAcceptance()  # what a (draft, task) not seen yet is scored on
        self._names = {k: str(k) for k in self.windows}  # goodput's keys

    # -- learning ---------------------------------------------------------------------------

    def observe_pass(self, rows: int, positions: int, ms: float, weight: float = 1.0) -> None:
        self.cost.observe(rows, positions, ms, weight)

    def observe_round(
        self,
        draft: str,
        task_type: str,
        window: int,
        drafted: int,
        accepted: int,
        stream: str | None = None,
    ) -> None:
        if window <= 0:
            return
        stats = self._accept.setdefault((draft, task_type), PositionAcceptance())
        stats.observe(window, drafted, accepted, self._accept_forget)
        if stream is None:
            return
        kept = self._stream_accept.get(stream)
        if kept is None or kept[0] != draft:
            # A stream's record is of one drafter: what another accepted on it says little of
            # this one (bench e2e: a lone session's lookup windows, none accepted, kept the
            # draft model the coordinator moved it to at k = 0 for 40 rounds).
            own = PositionAcceptance()
            self._stream_accept[stream] = (draft, own)
            if len(self._stream_accept) > MAX_STREAMS_KEPT:
                self._stream_accept.popitem(last=False)
        else:
            own = kept[1]
        self._stream_accept.move_to_end(stream)
        own.observe(window, drafted, accepted, self._accept_forget)

    def forget_stream(self, stream: str) -> None:
        """A stream that ended: its own rounds no longer count."""
        self._stream_accept.pop(stream, None)

    def observe_draft_ms(self, draft: str, tokens: int, ms: float, rows: int = 1) -> None:
        """`rows` rows of a pass drafted with `draft` at a window of `tokens`, in `ms` all
        together."""
        if tokens <= 0 or rows <= 0:
            return
        cost = self._drafting.get(draft)
        if cost is None:
            cost = self._drafting[draft] = DraftCost()
        cost.observe(rows, ms / tokens)

    def expected_tokens(self, row: StreamRow, k: int) -> float:
        if row.draft is None or k <= 0:
            return 1.0
        reach = min(k, row.cap)
        return self._expected_by_window(row.draft, row.task_type, reach, row.prior, row.stream)[
            reach
        ]

    def _expected_by_window(
        self, draft: str, task_type: str, reach: int, prior: float, stream: str | None
    ) -> list[float]:
        """E(j) for j = 0..reach (at least) of a drafter on a task, and of one stream when its
        own rounds are known here."""
        stats = self._stats(draft, task_type)
        kept = None if stream is None else self._stream_accept.get(stream)
        # A stream is kept once it has a round with a window, of the drafter it last drafted.
        if kept is None or kept[0] != draft:
            return stats.expected_by_window(reach, prior)
        return kept[1].expected_from(stats.rates(reach, prior))

    def _stats(self, draft: str, task_type: str) -> PositionAcceptance:
        """The acceptance seen for (draft, task), or none seen (never stored: a round's
        observe_round makes its own)."""
        return self._accept.get((draft, task_type)) or self._unseen

    def _plain_stale(self, rows: int) -> bool:
        """Whether plain passes of `rows` rows (more than one) were not timed lately, so that a
        window is chosen over them only after one plain pass times them again."""
        return rows > 1 and not self.cost.measured(rows, 1, within=PLAIN_REMEASURE_PASSES)

    def retimes_plain(self, choice: PassChoice) -> bool:
        """Whether a plain choice only times plain passes of its batch size again, where a
        window is predicted to commit more: one pass does that, and the next is chosen on it
        (run on, it was four plain passes of every 24 at 4 streams in bench e2e, where windows
        of 2 were chosen at 1.2-1.46x a plain pass's tokens/s)."""
        plain = choice.goodput.get("0")
        if choice.k != 0 or plain is None:
            return False
        ahead = any(rate > plain for window, rate in choice.goodput.items() if window != "0")
        return ahead and self._plain_stale(choice.rows)

    def _draft_terms(self, draft: str) -> tuple[float, float]:
        """(a, b) of the drafter's DraftCost: ms per window token a step, and a row."""
        cost = self._drafting.get(draft)
        return (0.0, PRIOR_DRAFT_MS_PER_TOKEN) if cost is None else cost.terms

    def draft_ms(self, draft: str, rows: int = 1) -> float:
        """ms per window token of `rows` rows drafted together with `draft`."""
        per_step, per_row = self._draft_terms(draft)
        return per_step + per_row * rows

    def timed_drafts(self) -> dict[str, float]:
        """The estimate of every drafter timed here (ms per window token of a lone row), for
        the status."""
        return {draft: cost.predict(1) for draft, cost in self._drafting.items()}

    # -- the rule ---------------------------------------------------------------------------

    def apart(
        self, streams: Sequence[StreamRow], widths: Sequence[int], together: PassChoice
    ) -> bool:
        """Whether device-drafted windows of `widths` tokens and the `streams` commit more tokens
        per second in two passes (the devices' alone, then the streams' as they would choose it
        alone) than in the one pass `together` chose for all of them. Every row of a pass is
        padded to its widest window, so one device window of 8 made a pass of 31 plain streams
        score 9 positions each (25 s a pass on a loaded host, where plain took 0.6 s).

        The streams' windows in a pass widened for a device's are a bet like any window, and
        take the same margin as in `choose`: what the one pass costs beyond the two discounts
        what it promises. Without it, a wave's first session drafting on its device (k = 4)
        widened the 15 fresh streams beside it to 5 positions, where alone they ran plain:
        300-350 ms for 31 tokens, against ~100 ms for the streams' plain pass and ~55 for the
        device's (bench e2e at 16 sessions, two waves of three). The worker's rule
        (`VerifierWorker._apart`), and the simulator's."""
        if not widths or together.cost_ms <= 0 or str(together.k) not in together.goodput:
            return False  # no device window, or a choice that fell back without a prediction
        alone = self.choose(streams, [])
        device_ms = self.cost.predict(len(widths), max(widths) + 1)
        tokens_apart = alone.goodput[str(alone.k)] * alone.cost_ms + _device_tokens(widths) * 1000.0
        apart_ms = alone.cost_ms + device_ms
        if apart_ms <= 0:
            return False
        extra = together.cost_ms / apart_ms - 1.0
        worth = together.goodput[str(together.k)] / (1.0 + SPECULATION_MARGIN * max(0.0, extra))
        return tokens_apart / apart_ms > worth

    def choose(self, streams: Sequence[StreamRow], fixed: Iterable[int]) -> PassChoice:
        """The window of this pass's streams. `fixed`: the windows (drafted tokens) of the
        device-drafted rows that share the pass, which the pass must score whatever it picks."""
        fixed = list(fixed)
        rows = len(streams) + len(fixed)
        widest_fixed = max(fixed, default=0)
        fixed_tokens = _device_tokens(fixed)
        # The streams of a pass mostly share a drafter, a task and a cap: each kind is scored
        # once per window (this runs between two passes, while the target waits).
        kinds = Counter(streams)
        top_cap = max([cap for draft, _, cap, _, _ in kinds if draft is not None], default=0)
        windows = [k for k in self.windows if k <= top_cap or k <= 0]
        widest = windows[-1] if windows else 0  # self.windows ascends
        # Per kind: its count, the most E(j) it reaches (a plain stream's are all 1, and so
        # is a cap below 0's, which drafts nothing), E(j) for every j up to it (one pass over
        # its rates, kept by its statistics until they change); per drafted kind, its rows'
        # drafting cost per window token and its cap, and per drafter the cost of a step
        # whatever its rows (DraftCost's a) and the widest cap it steps to. Here and below,
        # `a if a > b else b` is max(a, b) (and `<` min), written out: a pass runs this rule
        # on every window.
        scored: list[tuple[int, int, list[float]]] = []
        drafting_ms: list[tuple[float, int]] = []
        step_ms: dict[str, tuple[float, int]] = {}
        for (draft, task, cap, prior, stream), count in kinds.items():
            if draft is None:
                scored.append((count, 0, [1.0]))
            else:
                reach = cap if cap < widest else widest
                reach = reach if reach > 0 else 0
                by_window = self._expected_by_window(draft, task, reach, prior, stream)
                scored.append((count, reach, by_window))
                per_step, per_row = self._draft_terms(draft)
                drafting_ms.append((count * per_row, cap))
                if per_step > 0.0:
                    _, top = step_ms.get(draft, (0.0, 0))
                    step_ms[draft] = (per_step, cap if cap > top else top)
        goodput: dict[str, float] = {}
        cost_at: dict[int, float] = {}
        slowest: dict[int, float] = {}  # the least E(min(k, cap)) of a stream in the pass
        names, predict = self._names, self.cost.predict
        for k in windows:
            # E(min(k, cap)) of each kind (1 at k <= 0), summed in the kinds' order as sum()
            # over the rows' kinds would.
            j = k if k > 0 else 0
            expected = [by_window[j if j < reach else reach] for _, reach, by_window in scored]
            slowest[k] = min(expected, default=1.0)
            tokens = fixed_tokens + sum(
                [count * e for (count, _, _), e in zip(scored, expected, strict=True)]
            )
            drafting = sum([count_ms * (k if k < cap else cap) for count_ms, cap in drafting_ms])
            if step_ms:
                drafting += sum([a * (k if k < top else top) for a, top in step_ms.values()])
            ms = predict(rows, (widest_fixed if widest_fixed > k else k) + 1) + drafting
            cost_at[k] = ms
            goodput[names[k]] = tokens / ms * 1000.0 if ms > 0 else math.inf
        plain = goodput["0"]
        # The best window by its goodput, discounted by the certainty it needs: the more it
        # adds to the pass, the more a wrong estimate costs (a lone row's window adds ~2%).
        # Ties go to the smaller window (the first, in the ascending windows).
        plain_ms = cost_at[0]
        margin = SPECULATION_MARGIN if rows > 1 else LONE_SPECULATION_MARGIN
        best: int | None = None
        best_worth = 0.0
        for k in windows:
            if k > 0 and len(streams) > 1 and slowest[k] * plain_ms < cost_at[k]:
                # A stream would commit fewer tokens a second than it would plainly: no
                # session pays for another's window. In a batch that ends together (a wave),
                # the one that accepts least ends it, and a window every row pays for only
                # slowed it (bench e2e at 4 sessions, six runs: waves with windows 0.947-0.996
                # of plain serving, the same runs' plain waves 0.968-1.038, where the windows'
                # tokens came as predicted, 1.54 a row against 1.57, but a chat row's at 1.10).
                continue
            extra = cost_at[k] / plain_ms - 1.0
            worth = goodput[names[k]] / (1.0 + margin * (extra if extra > 0.0 else 0.0))
            if best is None or worth > best_worth or (worth == best_worth and k < best):
                best, best_worth = k, worth
        assert best is not None  # windows holds 0 (goodput["0"] above)
        if best > 0 and best_worth <= plain:
            best = 0
        reason = f"k={best}: {goodput[str(best)]:.1f} tok/s predicted for {rows} rows" + (
            "" if best == 0 else f" (plain {plain:.1f})"
        )
        if best > 0 and widest_fixed == 0 and self._plain_stale(rows):
            # Plain decoding at this batch size was not timed here lately: its cost is the
            # fit's or an old sample's, and a fit of speculative passes alone prices it wrongly
            # (bench e2e at 32 streams: plain predicted at 0.7-1.2 s a pass, where plain
            # serving's take 0.36 s, so windows that cost twice a plain pass were chosen
            # throughout). One plain pass measures it.
            reason = (
                f"k=0: plain passes of {rows} rows not timed in the last "
                f"{PLAIN_REMEASURE_PASSES} passes (predicted best: {reason})"
            )
            best = 0
        return PassChoice(
            k=best, rows=rows, goodput=goodput, cost_ms=cost_at[best], reason=reason[:256]
        )
