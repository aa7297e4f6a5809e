"""The closes that devices of other coordinators' shards send, kept for a takeover.

A coordinator of a shared fleet drops what a device of another shard sends: that shard's owner
answers it. A device sends a `SessionClose` once, so a close that reached an owner SIGKILLed
before the takeover was lost, and the takeover brought the session back active (bench fleet: the
agent waited a minute for its answer). Each coordinator therefore keeps the closes of other
shards' devices for a while, and a takeover closes the sessions it has just rebuilt whose
devices closed them meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from broker import messages as m

# A takeover comes a few lock steps after its owner's death: kept this long, at most this many.
KEEP_S = 60.0
MAX_KEPT = 100_000


class ForeignCloses:
    """Closes by session id: (device id, the close, when it came), oldest first."""

    def __init__(self, keep_s: float = KEEP_S, most: int = MAX_KEPT) -> None:
        self.keep_s = keep_s
        self.most = most
        self._closes: dict[str, tuple[str, m.SessionClose, float]] = {}

    def __len__(self) -> int:
        return len(self._closes)

    def keep(self, device_id: str, payload: bytes) -> None:
        """Keep `payload` if it is a close (anything else on the session channel is sent again
        by its device until answered, or refused by the shard's owner)."""
        try:
            message = m.decode(payload)
        except m.BusError:
            return
        if not isinstance(message, m.SessionClose):
            return
        now = time.monotonic()
        closes = self._closes
        while closes and next(iter(closes.values()))[2] < now - self.keep_s:
            del closes[next(iter(closes))]
        if len(closes) < self.most:
            closes.pop(message.session_id, None)
            closes[message.session_id] = (device_id, message, now)

    def take(self, taken: Callable[[str], bool]) -> dict[str, tuple[str, m.SessionClose]]:
        """The closes of the devices `taken(device_id)`, by session id; no longer kept."""
        found = {
            session_id: (device_id, close)
            for session_id, (device_id, close, _) in self._closes.items()
            if taken(device_id)
        }
        for session_id in found:
            del self._closes[session_id]
        return found
