"""The closes that devices of other coordinators' shards send, kept for a takeover.

A coordinator of a shared fleet drops what a device of another shard sends: that shard's owner
answers it. A device sends a `SessionClose` once, so a close that reached an owner SIGKILLed
before the takeover was lost, and the takeover brought the session back active (bench fleet: the
agent waited a minute for its answer). Each coordinator therefore keeps the closes of other
shards' devices for a while, and a takeover closes the sessions it has just rebuilt whose
devices closed them meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from broker import messages as m

if TYPE_CHECKING:
    from coordinator.runtime.session_state import LiveSession
    from coordinator.runtime.sessions import SessionBook

log = logging.getLogger(__name__)

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

    async def close_rebuilt(
        self, book: SessionBook, rebuilt: list[LiveSession], taken: Callable[[str], bool]
    ) -> list[LiveSession]:
        """At a takeover of the devices `taken(device_id)`: close the sessions just rebuilt
        whose devices closed them while another coordinator held their shard (the close never
        reached an owner that was alive). Returns the rest, to be announced."""
        kept = self.take(taken)
        closed = set()
        for live in rebuilt:
            device_id, close = kept.get(live.id, ("", None))
            if close is None or device_id != live.device_id:
                continue
            try:
                await book.on_session_close(device_id, close)
            except Exception:  # the takeover goes on; the session is announced as it stands
                log.exception("could not close session %s at the takeover", live.id)
                continue
            closed.add(live.id)
        if closed:
            log.info(
                "closed %d sessions whose devices closed them while another coordinator held "
                "their shards",
                len(closed),
            )
        return [live for live in rebuilt if live.id not in closed]
