"""When sessions are due back at a verifier, which decides whether its batch window is waited."""

from __future__ import annotations

import pytest

from verifier.worker import ReturnTimes


def paced(*sessions: tuple[str, float, float]) -> ReturnTimes:
    """Sessions that came back `gap` after a first result, and got a second result at `at`."""
    times = ReturnTimes()
    for session_id, gap, at in sessions:
        times.answered(session_id, 0.0)
        times.arrived(session_id, gap)
        times.answered(session_id, at)
    return times


@pytest.mark.parametrize(
    ("start", "end", "excluding", "due"),
    [
        (10.0, 12.0, set(), True),  # a is due at 10 + 1 = 11
        (10.0, 10.5, set(), False),  # not yet
        (11.5, 13.0, set(), False),  # a is late: gone, or served elsewhere
        (10.0, 12.0, {"a"}, False),  # a is in the batch already
        (20.0, 26.0, {"a"}, True),  # b is due at 20 + 5 = 25
    ],
)
def test_due_within_the_window(start: float, end: float, excluding: set[str], due: bool) -> None:
    times = paced(("a", 1.0, 10.0), ("b", 5.0, 20.0))
    assert times.due(start, end, excluding) is due


def test_a_session_with_a_request_pending_is_not_due() -> None:
    times = paced(("a", 1.0, 10.0))
    times.arrived("a", 10.8)  # its next request is here: nothing to wait for
    assert not times.due(10.0, 12.0, set())


def test_a_session_answered_once_has_no_pace_yet() -> None:
    times = ReturnTimes()
    times.answered("new", 1.0)
    assert not times.due(0.0, 100.0, set())


def test_the_least_recently_answered_sessions_are_forgotten_past_the_bound() -> None:
    times = ReturnTimes(kept=2)
    for session_id, at in (("a", 10.0), ("b", 11.0), ("c", 12.0)):
        times.answered(session_id, at - 1.0)
        times.arrived(session_id, at - 0.5)
        times.answered(session_id, at)
    assert not times.due(10.0, 10.6, set())  # a (due at 10.5) was forgotten
    assert times.due(11.0, 11.6, set()) and times.due(12.0, 12.6, set())
