"""The rest of a closed wave (verifier/wave.py): its estimate against a simulated wave, and the
pass rule that uses it."""

from __future__ import annotations

import itertools
import random

import pytest

from verifier.goodput import GoodputControl, StreamRow
from verifier.wave import (
    REFILL_HORIZON_PASSES,
    Refills,
    expected_largest_normal,
    wave_goodput,
    window_moments,
)


def test_a_windows_moments_are_those_of_its_accepted_tokens() -> None:
    """E(0..j) from per-position rates, against the distribution of 1 + accepted written out."""
    rates = [0.8, 0.6, 0.3]
    by_window = [1.0]
    survive = 1.0
    for rate in rates:
        survive *= rate
        by_window.append(by_window[-1] + survive)
    # P(exactly a accepted) for a = 0..3
    reach = [1.0, 0.8, 0.48, 0.144]
    exact = [reach[a] - (reach[a + 1] if a < 3 else 0.0) for a in range(4)]
    mean = sum((1 + a) * p for a, p in enumerate(exact))
    variance = sum((1 + a - mean) ** 2 * p for a, p in enumerate(exact))
    assert window_moments(by_window, 3) == pytest.approx((mean, variance))
    assert window_moments(by_window, 0) == (1.0, 0.0)


def test_the_largest_of_n_normals() -> None:
    """The table and Blom's approximation against a draw: within 3%."""
    rng = random.Random(5)
    for n in (2, 4, 10, 11, 16, 32):
        draws = [max(rng.gauss(0, 1) for _ in range(n)) for _ in range(20000)]
        assert expected_largest_normal(n) == pytest.approx(sum(draws) / len(draws), rel=0.03)
    assert expected_largest_normal(1) == 0.0


def _simulated_wave(
    lefts: list[int], rate: float, k: int, fixed: float, part: float, seed: int
) -> float:
    """Tokens/s of a closed wave run to its end, every pass at window k (each drafted token
    accepted with `rate` given the ones before), a pass costing fixed + part x rows."""
    rng = random.Random(seed)
    left = list(lefts)
    ms = 0.0
    while any(n > 0 for n in left):
        rows = [i for i, n in enumerate(left) if n > 0]
        ms += fixed + part * len(rows)
        for i in rows:
            accepted = 0
            while accepted < k and rng.random() < rate:
                accepted += 1
            left[i] = max(0, left[i] - 1 - accepted)
    return sum(lefts) / ms * 1000.0


@pytest.mark.parametrize(
    ("rows", "left", "rate", "k"),
    [(16, 48, 0.5, 1), (16, 48, 0.6, 3), (4, 48, 0.6, 2), (2, 20, 0.7, 4), (8, 30, 0.3, 1)],
)
def test_the_estimate_follows_a_simulated_wave(rows: int, left: int, rate: float, k: int) -> None:
    """Against waves run pass by pass with random acceptance: within 5% at every window,
    where tokens/s per pass is off by more for many rows (it ignores the slowest row)."""
    fixed, part_plain, part_k = 40.0, 3.0, 3.0 + 2.5 * k
    by_window = [1.0]
    for j in range(1, k + 1):
        by_window.append(by_window[-1] + rate**j)
    kinds = [(rows, left, by_window, k)]
    cost = {0: fixed + part_plain * rows, k: fixed + part_k * rows}
    estimate = wave_goodput(kinds, [0, k], cost, part_plain)
    runs = [_simulated_wave([left] * rows, rate, k, fixed, part_k, seed) for seed in range(40)]
    simulated = sum(runs) / len(runs)
    assert estimate[k] == pytest.approx(simulated, rel=0.05)
    plain = _simulated_wave([left] * rows, 0.0, 0, fixed, part_plain, 0)
    assert estimate[0] == pytest.approx(plain, rel=1e-9)
    per_pass = rows * by_window[k] / cost[k] * 1000.0
    if rows >= 8:
        assert per_pass > simulated * 1.02  # what the per-pass rule overrates


def test_unequal_rows_end_with_the_longest() -> None:
    """Plain decoding of rows with different lengths left: the longest sets the passes, each
    row pays its part while it runs."""
    kinds = [(1, 10, [1.0], 0), (1, 30, [1.0], 0)]
    estimate = wave_goodput(kinds, [0], {0: 46.0}, 3.0)
    assert estimate[0] == pytest.approx(40 / (40.0 * 30 + 3.0 * 40) * 1000.0)


def _control() -> GoodputControl:
    """Plain passes cost 60 ms + 1.5 a row, every position beyond the first 0.8 a row; windows
    of one accept 0.4 of their tokens, and cost 0.05 ms a row to draft (a copying drafter)."""
    control = GoodputControl()
    for _ in range(30):
        for rows, positions in itertools.product((1, 2, 4, 8, 15, 16), (1, 2, 3)):
            control.observe_pass(rows, positions, 60.0 + rows * (1.5 + 0.8 * (positions - 1)))
    for _ in range(100):
        for accepted in (1, 1, 0, 0, 0):
            control.observe_round("hybrid", "chat", 1, 1, accepted)
    for rows in (1, 2, 16) * 50:
        control.observe_draft_ms("hybrid", 1, 0.05 * rows, rows=rows)
    return control


def test_a_closed_wave_of_many_rows_decodes_plainly_where_a_pass_would_speculate() -> None:
    """16 rows with 8 tokens left each: a window of one pays per pass, where the wave ends with
    the slowest of the 16; in a pair it still pays."""
    control = _control()
    rows = [StreamRow("hybrid", "chat", 1, 0.5, f"s{i}", 8) for i in range(16)]
    open_batch = control.choose(rows, [])
    closed = control.choose(rows, [], wave=True)
    assert open_batch.k == 1, open_batch.reason
    assert closed.k == 0, closed.reason
    assert closed.reason.endswith("over the rest of the wave")
    assert closed.goodput["1"] < open_batch.goodput["1"]
    pair = control.choose(rows[:2], [], wave=True)
    assert pair.k == 1, pair.reason


def test_the_wave_is_not_scored_without_what_it_needs() -> None:
    """Rows whose tokens left are unknown, or beside device-drafted rows: tokens/s per pass."""
    control = _control()
    unknown = [StreamRow("hybrid", "chat", 1, 0.5, f"s{i}") for i in range(16)]
    assert control.choose(unknown, [], wave=True) == control.choose(unknown, [])
    known = [StreamRow("hybrid", "chat", 1, 0.5, f"s{i}", 8) for i in range(16)]
    assert control.choose(known, [1], wave=True) == control.choose(known, [1])


def test_a_new_session_beside_one_under_way_refills_the_batch() -> None:
    refills = Refills()
    assert refills.closed(0)
    refills.opened(3, under_way=False)  # a wave's sessions opening together
    assert refills.closed(10)
    refills.opened(10, under_way=True)
    assert not refills.closed(10 + REFILL_HORIZON_PASSES)
    assert refills.closed(11 + REFILL_HORIZON_PASSES)
