"""What a device-drafted window costs the host streams that share its verifier.

A verifier runs a round of each of its host streams in every pass. A device's window either
joins that pass, widening every row to its own width, or (where the verifier finds it cheaper,
verifier.worker's `_apart`) gets a pass of its own while the streams wait. Either way each stream
waits: the policy counts that wait, in the streams' tokens, against the device's window.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.runtime.round_model import VerifyCost


def streams_lost(
    cost: VerifyCost, drafted: Sequence[float], load: float, beside: float
) -> list[float]:
    """Tokens that `beside` host streams lose to a device window, for each of `drafted` (the
    tokens the window drafts): the smaller of the widening of their pass (t_verify(n, load) -
    t_verify(0, load)) and a pass of its own (t_verify(n, 1)), over a stream's pass
    (t_verify(0, load)), which commits about a token each."""
    stream_pass = cost.predict(0, load, waits=False)
    if stream_pass <= 0 or beside <= 0:
        return [0.0] * len(drafted)
    widened = cost.predict_windows(drafted, load, waits=False)
    apart = cost.predict_windows(drafted, 1.0, waits=True)
    return [
        beside * max(0.0, min(wide - stream_pass, alone)) / stream_pass
        for wide, alone in zip(widened, apart, strict=True)
    ]
