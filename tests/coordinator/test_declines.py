"""A lone stream's drafter that its verifier keeps running plainly is rated at what it made,
and another host drafter that promises more takes its place."""

from __future__ import annotations

from broker import messages as m
from coordinator.runtime.declines import DECLINED_ROUNDS, LONE_LOAD, Declines
from coordinator.runtime.policy import AdaptivePolicy
from tests.coordinator.host_rounds import DEVICE
from tests.coordinator.host_rounds import host_round as hosted_round

HOST = ("hybrid+draft-l1", "hybrid+eagle-h1")


def warmed() -> AdaptivePolicy:
    """draft-l1's hybrid the task's best host drafter on other sessions' rounds, the head's
    hybrid a little behind: a lone session goes to the first."""
    policy = AdaptivePolicy()
    policy.observe_verifiers((20.0, 1.5, 1.0), {"hybrid+draft-l1": 1.0, "hybrid+eagle-h1": 1.0})
    for i in range(30):
        policy.observe(hosted_round("hybrid+draft-l1", f"warm-l1-{i}", 4, 3))
        policy.observe(hosted_round("hybrid+eagle-h1", f"warm-h1-{i}", 4, 2))
    return policy


def test_a_lone_streams_drafter_run_plainly_round_after_round_gives_way() -> None:
    policy = warmed()
    first = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, m.Mode.CLOUD, HOST, plain=True)
    assert first.draft_model == "hybrid+draft-l1", first.reason
    # Its verifier runs the stream at k = 0 (this prompt defeats the drafter): the coordinator
    # learns nothing of its acceptance from those rounds, and keeps it at first.
    for _ in range(DECLINED_ROUNDS - 1):
        policy.observe(hosted_round("hybrid+draft-l1", "s1", 0, 0, plain=True))
    kept = policy.decide(
        "s1", DEVICE, "chat", "hybrid+draft-l1", 0.0, m.Mode.CLOUD, HOST, plain=True
    )
    assert kept.draft_model == "hybrid+draft-l1" and "ran plain" not in kept.reason
    policy.observe(hosted_round("hybrid+draft-l1", "s1", 0, 0, plain=True))
    moved = policy.decide(
        "s1", DEVICE, "chat", "hybrid+draft-l1", 0.0, m.Mode.CLOUD, HOST, plain=True
    )
    assert moved.mode is m.Mode.CLOUD
    assert moved.draft_model == "hybrid+eagle-h1", moved.reason
    assert f"its last {DECLINED_ROUNDS} rounds alone ran plain" in moved.reason
    declined = next(
        c for c in moved.candidates if c.mode is m.Mode.CLOUD and c.draft_model == "hybrid+draft-l1"
    )
    plain = next(c for c in moved.candidates if c.mode is m.Mode.PLAIN)
    assert declined.tokens_per_s == plain.tokens_per_s
    # Other sessions' decisions are untouched; a session forgotten starts afresh.
    other = policy.decide("s2", DEVICE, "chat", "hybrid", 0.0, m.Mode.CLOUD, HOST, plain=True)
    assert other.draft_model == "hybrid+draft-l1"
    policy.forget_session("s1")
    assert "s1" not in policy.declines.runs


def test_only_a_lone_streams_plain_rounds_in_a_row_count() -> None:
    declines = Declines()
    modes = {"s": (m.Mode.CLOUD, 3)}
    plain = hosted_round("d", "s", 0, 0, plain=True)
    for _ in range(DECLINED_ROUNDS):
        declines.observe(plain, modes)
    assert declines.runs["s"] == ("d", DECLINED_ROUNDS)
    declines.observe(hosted_round("d", "s", 2, 1), modes)  # a window ran: the run starts over
    assert declines.runs["s"] == ("d", 0)
    declines.observe(hosted_round("d", "s", 0, 0), modes)  # an empty proposal counts
    assert declines.runs["s"] == ("d", 1)
    declines.observe(hosted_round("other", "s", 0, 0, plain=True), modes)  # another drafter
    assert declines.runs["s"] == ("other", 1)
    # Beside other streams a plain pass says nothing of the drafter; nor does a session the
    # policy put in plain or distributed mode.
    declines.observe(hosted_round("other", "s", 0, 0, load=LONE_LOAD, plain=True), modes)
    assert "s" not in declines.runs
    declines.observe(plain, {"s": (m.Mode.PLAIN, 1)})
    assert "s" not in declines.runs
