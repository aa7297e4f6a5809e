"""The closes a coordinator keeps for the day it takes over other coordinators' shards."""

from __future__ import annotations

import time

import pytest

from broker import messages as m
from coordinator.runtime.foreign_closes import ForeignCloses


def close(session_id: str) -> bytes:
    return m.encode(m.SessionClose(session_id=session_id, reason="user"))


def test_only_closes_are_kept_and_a_takeover_takes_those_of_its_devices() -> None:
    kept = ForeignCloses()
    kept.keep("pi-1", close("s1"))
    kept.keep("pi-2", close("s2"))
    opened = m.SessionOpen(session_id="s3", prompt="hi", prompt_ids=(1, 2), draft_model="lookup")
    kept.keep("pi-3", m.encode(opened))  # its device sends it again until it is answered
    kept.keep("pi-3", b"{not json")  # the shard's owner refuses it
    assert len(kept) == 2
    taken = kept.take(lambda device_id: device_id == "pi-2")
    assert {s: (d, c.reason) for s, (d, c) in taken.items()} == {"s2": ("pi-2", "user")}
    assert len(kept) == 1 and kept.take(lambda device_id: True).keys() == {"s1"}
    assert len(kept) == 0


def test_old_closes_are_forgotten_and_the_number_kept_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    kept = ForeignCloses(keep_s=60.0, most=2)
    kept.keep("pi-1", close("s1"))
    now[0] += 30
    kept.keep("pi-2", close("s2"))
    kept.keep("pi-3", close("s3"))  # two kept already: not kept
    assert kept.take(lambda device_id: False) == {} and len(kept) == 2
    now[0] += 31  # s1 is 61 s old: forgotten when the next close comes
    kept.keep("pi-4", close("s4"))
    assert sorted(kept.take(lambda device_id: True)) == ["s2", "s4"]
