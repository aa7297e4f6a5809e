"""The rest of a closed wave: what a window saves when no session waits for the batch's room.

The goodput rule's tokens/s values a token at a pass's cost per token. That is right while the
batch is refilled (a session that ends makes room for one that waits). When it is not, as for
sessions that opened together with none since, the batch runs until its last row ends: a pass
costs a fixed part F (paid as long as any row runs) and a part per row. A token gained early on
a row that is not the last to end only makes later passes one row smaller, worth that row's
part, not the pass's cost per token. The wave is shortened only by the row that ends last, and
where many rows would end together it is the slowest of them that counts: a wave of 16 sessions
ran windows of 1 (0.49 tokens accepted a row, 112 ms a pass against plain serving's 85) for the
same 47 passes as plain decoding (README, issue 11: "windows that pay per pass lose the wave").

So, for a batch that nobody refilled lately, each window k is scored on the rest of the wave:
row i, with R_i tokens left and X_i = 1 + its accepted tokens a pass at window k (mean E_i),
takes about R_i / E_i passes, with variance R_i Var(X_i) / E_i^3 (a renewal count). The wave
takes the longest of them: the largest mean, plus the spread times the expected largest of n
standard normals for the n rows that may end last. Its time is F times its passes plus each
row's part of a pass at k times its passes; its goodput the tokens left over that time. At k = 0
every row takes exactly R_i passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from statistics import NormalDist

# A stream that opens beside a stream that has already generated this many tokens refills the
# batch (sessions that open together, their prompts prefilled in the first passes, do not), and
# the batch counts as refilled for this many passes after: the rest of a wave that no session
# joined is then what a window can shorten.
REFILL_MIN_GENERATED = 4
REFILL_HORIZON_PASSES = 64
# A row may end last if its passes' mean, plus this many of its spreads, reaches the longest mean.
CONTENDER_SPREADS = 2.0


# E[max of n standard normals] for n = 1..10, as tabulated (the expected normal order statistics).
LARGEST_NORMAL = (0.0, 0.5642, 0.8463, 1.0294, 1.1630, 1.2672, 1.3522, 1.4236, 1.4850, 1.5388)


@cache
def expected_largest_normal(n: int) -> float:
    """E[max of n standard normals]: the table up to 10, then Blom's approximation (~1% off
    there, 4% at n = 2)."""
    if n <= len(LARGEST_NORMAL):
        return LARGEST_NORMAL[max(n, 1) - 1]
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def window_moments(by_window: Sequence[float], j: int) -> tuple[float, float]:
    """(E, Var) of 1 + the tokens accepted at a window of j, from E(0..j): P(accepted >= l) is
    E(l) - E(l - 1), and E[A^2] the sum over l of (2l - 1) P(A >= l)."""
    mean = by_window[j]
    second = 0.0
    for level in range(1, j + 1):
        second += (2 * level - 1) * (by_window[level] - by_window[level - 1])
    accepted = mean - 1.0
    variance = second - accepted * accepted
    return mean, variance if variance > 0.0 else 0.0


def wave_goodput(
    rows: Sequence[tuple[int, int, Sequence[float], int]],
    windows: Sequence[int],
    cost_ms: dict[int, float],
    row_ms: float,
) -> dict[int, float]:
    """Tokens/s over the rest of a closed wave, by window. `rows`: (count, tokens left, E(j)
    for j = 0..reach, reach) per kind of row; `cost_ms`: a pass's predicted ms at each window
    (drafting included); `row_ms`: what one more row adds to a plain pass."""
    plain_ms = cost_ms[0]
    total = sum(count for count, _, _, _ in rows)
    if total < 1 or plain_ms <= 0.0:
        return {}
    part = row_ms if row_ms > 0.0 else 0.0
    part = part if part < plain_ms / total else plain_ms / total
    fixed = plain_ms - part * total
    tokens = float(sum(count * left for count, left, _, _ in rows))
    longest = max(left for _, left, _, _ in rows)
    out = {0: tokens / (fixed * longest + part * tokens) * 1000.0}
    for k in windows:
        if k <= 0:
            continue
        share = (cost_ms[k] - fixed) / total  # a row's part of a pass at k
        spans: list[tuple[float, float, int]] = []  # (mean passes, their spread, count)
        for count, left, by_window, reach in rows:
            mean, variance = window_moments(by_window, k if k < reach else reach)
            spans.append((left / mean, math.sqrt(left * variance / mean**3), count))
        top = max(mean for mean, _, _ in spans)
        contenders = [s for s in spans if s[0] + CONTENDER_SPREADS * s[1] >= top]
        spread = max(sigma for _, sigma, _ in contenders)
        passes = top + spread * expected_largest_normal(sum(c for _, _, c in contenders))
        ms = fixed * passes + share * sum(count * mean for mean, _, count in spans)
        out[k] = tokens / ms * 1000.0 if ms > 0.0 else math.inf
    return out


class Refills:
    """Whether a verifier's batch is refilled: a stream opened beside one already under way
    (REFILL_MIN_GENERATED tokens) within the last REFILL_HORIZON_PASSES passes."""

    def __init__(self) -> None:
        self._last: int | None = None

    def opened(self, pass_index: int, under_way: bool) -> None:
        """A stream opened at `pass_index`; `under_way`: beside a stream under way."""
        if under_way:
            self._last = pass_index

    def closed(self, pass_index: int) -> bool:
        """No stream refilled the batch lately: its passes run a wave to its end."""
        return self._last is None or pass_index - self._last > REFILL_HORIZON_PASSES
