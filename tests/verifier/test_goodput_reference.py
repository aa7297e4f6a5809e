"""Goodput control's pass rule against the rule written out plainly: every kind of stream scored
at every window from its acceptance per position, nothing kept between passes. The rule keeps
E(j) per (drafter, task) until a round of theirs is observed; its choices, predictions and
reasons must be these, bit for bit, and a change in acceptance must reach the next choice. The
cost fit, written out, must give the plain loops' sums and Cramer's rule's solution bit for
bit."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from broker.messages import PassChoice
from verifier.goodput import (
    LONE_SPECULATION_MARGIN,
    PLAIN_REMEASURE_PASSES,
    PRIOR_DRAFT_MS_PER_TOKEN,
    PRIOR_WEIGHT,
    SPECULATION_MARGIN,
    GoodputControl,
    PassCost,
    PositionAcceptance,
    StreamRow,
    _solve3,
)

DRAFTS = ("hybrid", "ngram", "draft-l1")
TASKS = ("chat", "code", "math")
PRIORS = (0.5, 0.3, 0.8)


def reference_expected(stats: PositionAcceptance | None, k: int, prior: float) -> float:
    """E(k) = 1 + sum_i prod_{j <= i} rate_j, each rate pulled towards the one before it."""
    positions = stats.positions if stats is not None else []
    rates: list[float] = []
    for i in range(k):
        reached, accepted = (
            (positions[i].reached, positions[i].accepted) if i < len(positions) else (0.0, 0.0)
        )
        pull = prior if i == 0 else rates[-1]
        rates.append((accepted + pull * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT))
    total, survive = 1.0, 1.0
    for rate in rates:
        survive *= rate
        total += survive
    return total


def reference_choose(
    control: GoodputControl, streams: Sequence[StreamRow], fixed: list[int]
) -> PassChoice:
    rows = len(streams) + len(fixed)
    widest_fixed = max(fixed, default=0)
    fixed_tokens = sum(1.0 + 0.5 * k for k in fixed)
    top_cap = max((s.cap for s in streams if s.draft is not None), default=0)
    kinds = Counter(streams)

    def terms(draft: str) -> tuple[float, float]:
        cost = control._drafting.get(draft)
        return (0.0, PRIOR_DRAFT_MS_PER_TOKEN) if cost is None else cost.terms

    def expected(kind: StreamRow, k: int) -> float:
        if kind.draft is None or k <= 0:
            return 1.0
        stats = control._accept.get((kind.draft, kind.task_type))
        return reference_expected(stats, min(k, kind.cap), kind.prior)

    goodput: dict[str, float] = {}
    cost_at: dict[int, float] = {}
    for k in control.windows:
        if k > top_cap and k > 0:
            continue
        tokens = fixed_tokens + sum(count * expected(kind, k) for kind, count in kinds.items())
        # Each drafter's rows at b a row, then a step's cost a per step of its widest window
        # (DraftCost), in the order the kinds came.
        drafting = sum(
            count * terms(kind.draft)[1] * min(k, kind.cap)
            for kind, count in kinds.items()
            if kind.draft is not None
        )
        widest: dict[str, int] = {}
        for kind in kinds:
            if kind.draft is not None and terms(kind.draft)[0] > 0.0:
                widest[kind.draft] = max(widest.get(kind.draft, 0), kind.cap)
        if widest:
            drafting += sum(terms(draft)[0] * min(k, cap) for draft, cap in widest.items())
        ms = control.cost.predict(rows, max(k, widest_fixed) + 1) + drafting
        cost_at[k] = ms
        goodput[str(k)] = tokens / ms * 1000.0 if ms > 0 else math.inf
    plain = goodput["0"]

    def worth(k: int) -> float:
        extra = max(0.0, cost_at[k] / cost_at[0] - 1.0)
        margin = SPECULATION_MARGIN if rows > 1 else LONE_SPECULATION_MARGIN
        return goodput[str(k)] / (1.0 + margin * extra)

    def slows_a_stream(k: int) -> bool:
        """Some stream of several would commit fewer tokens a second than plainly."""
        least = min(expected(kind, k) for kind in kinds)
        return k > 0 and len(streams) > 1 and least * cost_at[0] < cost_at[k]

    allowed = [int(k) for k in goodput if not slows_a_stream(int(k))]
    best = max(allowed, key=lambda k: (worth(k), -k))
    if best > 0 and worth(best) <= plain:
        best = 0
    reason = f"k={best}: {goodput[str(best)]:.1f} tok/s predicted for {rows} rows" + (
        "" if best == 0 else f" (plain {plain:.1f})"
    )
    lately = control.cost.measured(rows, 1, within=PLAIN_REMEASURE_PASSES)
    if best > 0 and rows > 1 and widest_fixed == 0 and not lately:
        reason = (
            f"k=0: plain passes of {rows} rows not timed in the last {PLAIN_REMEASURE_PASSES} "
            f"passes (predicted best: {reason})"
        )
        best = 0
    return PassChoice(
        k=best, rows=rows, goodput=goodput, cost_ms=cost_at[best], reason=reason[:256]
    )


def random_streams(rng: random.Random) -> list[StreamRow]:
    streams = []
    for _ in range(rng.randint(1, 32)):
        plain = rng.random() < 0.15
        streams.append(
            StreamRow(
                None if plain else rng.choice(DRAFTS),
                rng.choice(TASKS),
                rng.choice((0, 1, 2, 3, 5, 8, 8, 8)),
                rng.choice(PRIORS),
            )
        )
    return streams


@pytest.mark.parametrize("seed", range(4))
def test_the_pass_rule_chooses_as_the_plain_rule_over_many_random_passes(seed: int) -> None:
    rng = random.Random(seed)
    control = GoodputControl()
    differences = 0
    for step in range(200):
        streams = random_streams(rng)
        fixed = [rng.randint(0, 8) for _ in range(rng.choice((0, 0, 1, 3)))]
        # A pass is chosen twice between observations (the kept E(j) are used the second time).
        for _ in range(2):
            assert control.choose(streams, fixed) == reference_choose(control, streams, fixed)
        for row in streams:
            if row.draft is not None and rng.random() < 0.5:
                window = rng.randint(1, 8)
                drafted = rng.randint(0, window)
                accepted = rng.randint(0, drafted)
                control.observe_round(row.draft, row.task_type, window, drafted, accepted)
                differences += 1
        rows = len(streams) + len(fixed)
        control.observe_pass(rows, rng.randint(1, 9), rng.uniform(20.0, 800.0))
        if step % 50 == 0:
            # Rows drafted together: a drafter's cost splits into a step's and a row's.
            rows_drafted = rng.randint(1, 16)
            ms = rng.uniform(0.1, 9.0) * rows_drafted
            control.observe_draft_ms(rng.choice(DRAFTS), rng.randint(1, 8), ms, rows=rows_drafted)
        for draft in DRAFTS:
            for task in TASKS:
                for k in range(9):
                    row = StreamRow(draft, task, 8, PRIORS[k % 3])
                    stats = control._accept.get((draft, task))
                    assert control.expected_tokens(row, k) == reference_expected(
                        stats, k, row.prior
                    )
    assert differences > 0


def test_acceptance_observed_after_a_choice_changes_the_next_choice() -> None:
    control = GoodputControl()
    for rows, positions, ms in ((8, 9, 61.0), (1, 1, 40.0), (1, 9, 41.0), (8, 1, 60.0)):
        for _ in range(20):
            control.observe_pass(rows, positions, ms)
    streams = [StreamRow("hybrid", "code", 8, 0.5)] * 8
    # Every drafted token rejected: the windows' E(j) are kept, and plain decoding wins.
    for _ in range(300):
        control.observe_round("hybrid", "code", 8, 8, 0)
    rejected = control.choose(streams, [])
    assert rejected.k == 0
    # Then every one accepted: the kept E(j) must give way, and a window wins.
    for _ in range(300):
        control.observe_round("hybrid", "code", 8, 8, 8)
    accepted = control.choose(streams, [])
    assert accepted.k > 0
    assert accepted.goodput["8"] > 3 * rejected.goodput["8"]
    assert accepted == reference_choose(control, streams, [])


def reference_solve3(
    matrix: list[list[float]], rhs: list[float]
) -> tuple[float, float, float] | None:
    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(matrix)
    scale = max(abs(v) for row in matrix for v in row) or 1.0
    if abs(d) <= 1e-9 * scale**3:
        return None
    out = []
    for col in range(3):
        replaced = [[rhs[r] if c == col else matrix[r][c] for c in range(3)] for r in range(3)]
        out.append(det(replaced) / d)
    return out[0], out[1], out[2]


@pytest.mark.parametrize("seed", range(3))
def test_the_cost_fit_sums_and_solves_as_the_plain_loops(seed: int) -> None:
    rng = random.Random(seed)
    cost = PassCost()
    xtx = [[0.0] * 3 for _ in range(3)]
    xty = [0.0] * 3
    forget = cost._forget
    for _ in range(400):
        rows, positions = rng.randint(1, 32), rng.randint(1, 9)
        ms, weight = rng.uniform(20.0, 900.0), rng.choice((1.0, 0.5, rng.uniform(0.1, 3.0)))
        cost.observe(rows, positions, ms, weight)
        x = (1.0, float(rows), float(rows * positions))
        for i in range(3):
            xty[i] = xty[i] * forget + weight * x[i] * ms
            for j in range(3):
                xtx[i][j] = xtx[i][j] * forget + weight * x[i] * x[j]
        assert cost._xtx == xtx and cost._xty == xty
        assert _solve3(xtx, xty) == reference_solve3(xtx, xty)
    singular = [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]]
    assert _solve3(singular, [1.0, 2.0, 3.0]) is None is reference_solve3(singular, [1.0, 2.0, 3.0])
    for _ in range(300):
        matrix = [
            [rng.choice((rng.uniform(-50, 50), 2.0, 0.0)) for _ in range(3)] for _ in range(3)
        ]
        rhs = [rng.uniform(-100, 100) for _ in range(3)]
        assert _solve3(matrix, rhs) == reference_solve3(matrix, rhs)


def reference_predict(cost: PassCost, rows: int, positions: int) -> float:
    seen = cost._seen.get(rows)
    if not seen:
        return cost.fitted(rows, positions)
    if positions in seen:
        return seen[positions]
    nearest = sorted(seen, key=lambda t: (abs(t - positions), t))[:2]
    if len(nearest) == 1:
        t = nearest[0]
        slope = seen[t] + cost.fitted(rows, positions) - cost.fitted(rows, t)
        return max(slope, seen[t] * cost.fitted(rows, positions) / cost.fitted(rows, t))
    (t1, t2) = sorted(nearest)
    slope = (seen[t2] - seen[t1]) / (t2 - t1)
    if positions > t2:
        slope = max(slope, cost.coefficients[2] * rows)
    slope = max(0.0, slope)
    return max(seen[t1] + slope * (positions - t1), 1e-3)


@pytest.mark.parametrize("seed", range(3))
def test_the_cost_is_predicted_as_the_plain_nearest_points_rule(seed: int) -> None:
    rng = random.Random(seed)
    cost = PassCost()
    for _ in range(300):
        rows = rng.randint(1, 8)
        cost.observe(rows, rng.randint(1, 9), rng.choice((rng.uniform(5.0, 900.0), 0.5)))
        for shape_rows in range(1, 10):
            for positions in range(1, 12):
                expected = reference_predict(cost, shape_rows, positions)
                assert cost.predict(shape_rows, positions) == expected
