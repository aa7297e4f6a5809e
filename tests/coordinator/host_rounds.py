"""A round of a session on the verifier host, as the adaptive policy observes it."""

from __future__ import annotations

from broker import messages as m
from coordinator.runtime.policy import RoundObservation

DEVICE = "phone-1"


def host_round(
    draft: str, session: str, k: int, accepted: int, load: float = 0.0, plain: bool = False
) -> RoundObservation:
    """A cloud round that drafted `k` (the verifier's window at least 1), or with `plain` one
    the verifier ran at k = 0; `load`: the streams beside it on its verifier."""
    return RoundObservation(
        session_id=session,
        device_id=DEVICE,
        draft_model=draft,
        task_type="chat",
        k=k,
        n_accepted=accepted,
        t_draft_ms=0.2 * k,
        t_uplink_ms=None,
        t_queue_ms=0.0,
        t_verify_ms=26.0,
        verifier_load=load,
        mode=m.Mode.PLAIN if plain else m.Mode.CLOUD,
        window=0 if plain else max(k, 1),
    )
