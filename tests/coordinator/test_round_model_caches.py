"""What the round model keeps between updates: a drafter's fill curve until its next round, and
X'X computed once per symmetric pair; and the windows rated in one pass. Each must equal the
plain computation, and an update must reach the next decision."""

from __future__ import annotations

import random

import pytest

from broker import messages as m
from coordinator.runtime.batch_cost import streams_lost
from coordinator.runtime.policy import AdaptivePolicy, RoundObservation
from coordinator.runtime.round_model import (
    K_MAX,
    K_MIN,
    VERIFY_FEATURE_SCALE,
    VERIFY_PRIOR_ROUNDS,
    ProposalLength,
    VerifyCost,
    _solve,
    best_window,
    drafted_by_window,
    expected_tokens_by_window,
    window_ms,
)


def reference_survival(fill: ProposalLength, k: int) -> list[float]:
    values, reach = [], 1.0
    for i in range(1, k + 1):
        reach *= (fill.drafted[min(i, K_MAX)] + 1.0) / (fill.allowed[min(i, K_MAX)] + 1.0)
        values.append(reach)
    return values


@pytest.mark.parametrize("seed", range(3))
def test_the_fill_curve_is_the_plain_one_after_every_update(seed: int) -> None:
    rng = random.Random(seed)
    fill = ProposalLength()
    for _ in range(300):
        window = rng.randint(0, 16)
        fill.update(window, rng.randint(0, window))
        k = rng.choice((4, 8, 16, 20))
        survival, drafted = fill.curve(k)
        assert survival == reference_survival(fill, k)
        assert drafted == drafted_by_window(reference_survival(fill, k))
        assert fill.survival(k) == survival


def reference_fill_update(fill: ProposalLength, window: int, n_drafted: int) -> None:
    window = min(K_MAX, max(window, n_drafted))
    if window <= 0:
        return
    fill.allowed[1:] = [value * 0.9 for value in fill.allowed[1:]]
    fill.drafted[1:] = [value * 0.9 for value in fill.drafted[1:]]
    for i in range(1, min(window, n_drafted + 1) + 1):
        fill.allowed[i] += 1.0
        if i <= n_drafted:
            fill.drafted[i] += 1.0


@pytest.mark.parametrize("seed", range(3))
def test_the_fill_counts_update_as_the_plain_loop_would(seed: int) -> None:
    rng = random.Random(seed)
    kept, plain = ProposalLength(), ProposalLength()
    for _ in range(500):
        window = rng.randint(-1, 20)
        n_drafted = rng.randint(0, max(0, window) + rng.choice((0, 0, 3)))
        kept.update(window, n_drafted)
        reference_fill_update(plain, window, n_drafted)
        assert kept.allowed == plain.allowed and kept.drafted == plain.drafted


def test_a_drafter_seen_stopping_short_changes_the_next_decision() -> None:
    policy = AdaptivePolicy()

    def observe(k: int) -> None:
        policy.observe(
            RoundObservation(
                session_id="s",
                device_id="phone",
                draft_model="lookup",
                task_type="chat",
                k=k,
                n_accepted=k,
                t_draft_ms=0.05 * k,
                t_uplink_ms=10.0,
                t_queue_ms=1.0,
                t_verify_ms=30.0,
                verifier_load=1.0,
                window=8,
            )
        )

    def lookup_drafted() -> float:
        decision = policy.decide("s", "phone", "chat", "lookup", 1.0)
        return next(c for c in decision.candidates if c.draft_model == "lookup").drafted

    observe(8)
    full = lookup_drafted()
    assert lookup_drafted() == full  # kept: nothing observed in between
    for _ in range(10):
        observe(0)  # the drafter proposed nothing: its curve must drop
    assert lookup_drafted() < full / 2


def reference_update(cost: VerifyCost, k: int, load: float, ms: float, waits: bool) -> None:
    x = cost.features(k, load, waits)
    for i in range(5):
        cost.xty[i] = cost.xty[i] * 0.98 + x[i] * ms
        for j in range(5):
            cost.xtx[i][j] = cost.xtx[i][j] * 0.98 + x[i] * x[j]
    cost.rounds = cost.rounds * 0.98 + 1.0
    cost._solved = None


def test_verify_cost_updates_as_the_full_matrix_would() -> None:
    rng = random.Random(5)
    kept, plain = VerifyCost(), VerifyCost()
    for _ in range(500):
        k, load = rng.randint(0, 16), rng.uniform(0.0, 40.0)
        ms, waits = rng.uniform(10.0, 900.0), rng.random() < 0.5
        kept.update(k, load, ms, waits=waits)
        reference_update(plain, k, load, ms, waits)
        assert kept.xtx == plain.xtx and kept.xty == plain.xty
        assert kept.coefficients() == plain.coefficients()


def reference_solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
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


def test_the_coefficients_are_the_ridge_solution_bit_for_bit() -> None:
    rng = random.Random(9)
    cost = VerifyCost()
    for _ in range(200):
        cost.update(rng.randint(0, 16), rng.uniform(0.0, 40.0), rng.uniform(10.0, 900.0))
        matrix = [row[:] for row in cost.xtx]
        rhs = cost.xty[:]
        for i, scale in enumerate(VERIFY_FEATURE_SCALE):
            matrix[i][i] += VERIFY_PRIOR_ROUNDS * scale**2
            rhs[i] += VERIFY_PRIOR_ROUNDS * scale**2 * cost.prior[i]
        expected = tuple(max(0.0, value) for value in reference_solve(matrix, rhs))
        assert cost.coefficients() == expected


@pytest.mark.parametrize("seed", range(3))
def test_the_solver_gives_gaussian_eliminations_answer_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.choice((3, 5))
        # Ties in a column (equal |values|) pick the first row, as max() does.
        matrix = [
            [rng.choice((rng.uniform(-50, 50), 2.0, -2.0)) for _ in range(n)] for _ in range(n)
        ]
        rhs = [rng.uniform(-100, 100) for _ in range(n)]
        try:
            expected = reference_solve([row[:] for row in matrix], rhs[:])
        except ZeroDivisionError:
            continue
        assert _solve(matrix, rhs) == expected


def reference_best_window(
    cost: VerifyCost,
    alpha: float,
    fill: ProposalLength,
    per_token: float,
    fixed_ms: float,
    load: float,
    mode: m.Mode,
    beside: float,
) -> tuple[int, float, float, float, float]:
    """Each term as its own function computes it, for every window, then the best."""
    survival, drafted = fill.curve(K_MAX)
    waits = mode not in m.HOST_MODES
    verify = cost.predict_windows(drafted, load, waits)
    lost = (
        streams_lost(cost, drafted, load, beside) if beside > 0 and waits else [0.0] * len(drafted)
    )
    rows = zip(
        expected_tokens_by_window(alpha, survival),
        drafted,
        window_ms(mode, drafted, per_token, fixed_ms, verify, load),
        lost,
        strict=True,
    )
    rated = [
        ((tokens - loss) / total, (k, tokens, total, n, loss))
        for k, (tokens, n, total, loss) in enumerate(rows, start=1)
        if k >= K_MIN
    ]
    return max(rated, key=lambda pair: pair[0])[1]


@pytest.mark.parametrize("seed", range(4))
def test_the_windows_rated_in_one_pass_are_the_plain_functions_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    costs = [VerifyCost(), VerifyCost(prior=(0.0, 0.0, 0.0, 0.0, 0.0))]  # no stream pass at all
    fills = [ProposalLength(), ProposalLength()]
    for step in range(400):
        cost = rng.choice(costs)
        if rng.random() < 0.5:
            k = rng.randint(0, 16)
            cost.update(
                k, rng.uniform(0.0, 30.0), rng.uniform(5.0, 900.0), waits=rng.random() < 0.5
            )
        fill = rng.choice(fills)
        window = rng.randint(1, 16)
        fill.update(window, rng.randint(0, window))
        alpha = rng.choice((0.0, 0.3, 0.7, 0.98, rng.random()))
        mode = rng.choice((m.Mode.DISTRIBUTED, m.Mode.CLOUD))
        per_token, fixed_ms = rng.uniform(0.0, 9.0), rng.uniform(0.0, 300.0)
        load = rng.choice((0.0, 1.0, rng.uniform(0.0, 40.0)))
        beside = rng.choice((0.0, -1.0, rng.uniform(0.0, 30.0)))
        survival, drafted = fill.curve(K_MAX)
        expected = reference_best_window(cost, alpha, fill, per_token, fixed_ms, load, mode, beside)
        got = best_window(cost, alpha, survival, drafted, per_token, fixed_ms, load, mode, beside)
        assert got == expected, step
