"""What one verified round measured: the adaptive policy's input from every round it hears."""

from __future__ import annotations

from typing import NamedTuple

from broker import messages as m


class RoundObservation(NamedTuple):
    """What one verified round measured. A record, immutable: built for every round the
    coordinator hears (and the simulator's), where a frozen dataclass took three times as long
    to build."""

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
    mode: m.Mode = m.Mode.DISTRIBUTED  # cloud: t_draft_ms is the verifier host's
    # The window the round was asked to fill (its cap): how far drafters fill theirs is learned
    # from it; 0 for a round that drafted by no window of ours (a target-only round).
    window: int = 0
    # The verifier prefilled the context (a session's first round): its time is no t_verify(k).
    prefill: bool = False
    # A distributed round's turn beyond compute: the time from the previous round's draft
    # reaching the coordinator to this one's, less that round's verification and this round's
    # drafting. It holds everything RTT + queue stand for, and what they miss (persisting, both
    # bus hops to the verifier, the agent's own turn). None when not measured.
    overhead_ms: float | None = None
