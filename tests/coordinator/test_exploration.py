"""Host drafters tried once: an untried drafter on the verifier hosts gets one cloud stream of a
session the policy keeps in cloud mode, and is rated on its own rounds from then on."""

from __future__ import annotations

from broker import messages as m
from coordinator.runtime.decisions import opening_candidate
from coordinator.runtime.exploration import HostExploration, host_offer
from coordinator.runtime.policy import AdaptivePolicy
from tests.coordinator.host_rounds import DEVICE
from tests.coordinator.host_rounds import host_round as cloud_round

HOST = ("hybrid", "hybrid+eagle-h1", "hybrid+eagle-h1-tflite", "draft-l1-tflite")


def decide(
    policy: AdaptivePolicy, session: str, draft: str = "hybrid", new_stream: bool = True
) -> tuple[str, str]:
    """The drafter and reason of a decision that keeps the session in cloud mode; with
    `new_stream`, no stream of it runs, so the decision opens one."""
    decision = policy.decide(
        session, DEVICE, "chat", draft, 0.0, m.Mode.CLOUD, HOST, plain=True, new_stream=new_stream
    )
    assert decision.mode is m.Mode.CLOUD, decision.reason
    return decision.draft_model, decision.reason


def test_the_host_offers_each_drafter_once_and_no_tflite_twin_of_an_onnx_one() -> None:
    assert host_offer([*HOST, "hybrid"]) == ["hybrid", "hybrid+eagle-h1", "draft-l1-tflite"]


def test_the_host_offers_no_drafter_alone_beside_its_hybrid() -> None:
    offered = ["hybrid", "eagle-h1", "hybrid+eagle-h1", "draft-l2", "draft-l1", "hybrid+draft-l1"]
    assert host_offer(offered) == ["hybrid", "hybrid+eagle-h1", "draft-l2", "hybrid+draft-l1"]


def test_an_untried_host_drafter_gets_one_stream_then_is_rated_on_its_rounds() -> None:
    policy = AdaptivePolicy()
    policy.observe_verifiers((20.0, 1.5, 1.0), {"hybrid": 0.2})
    for i in range(30):  # hybrid, drafted in cloud rounds: it accepts well when it proposes
        policy.observe(cloud_round("hybrid", f"warm-{i}", 2, 2))
    # A decision within a stream tries nothing: an untried drafter is offered where a stream
    # opens, not where a running one would have to be ended for it.
    assert decide(policy, "s0", new_stream=False)[0] == "hybrid"
    # Rated on hybrid's acceptance at 2.5 ms a token, the head's hybrid is below hybrid...
    draft, reason = decide(policy, "s1")
    assert draft == "hybrid+eagle-h1" and reason.startswith("explore hybrid+eagle-h1")
    # ...and another session does not try the same drafter while s1 does: it tries the next.
    assert decide(policy, "s2")[0] == "draft-l1-tflite"
    assert decide(policy, "s3")[1].startswith("keep hybrid")  # nothing left untried
    for _ in range(8):  # s1's stream with the head's hybrid: it accepted nothing
        policy.observe(cloud_round("hybrid+eagle-h1", "s1", 4, 0))
    # s1's next stream is rated as usual, and the head's hybrid on its rounds (it lost).
    draft, reason = decide(policy, "s1", "hybrid+eagle-h1", new_stream=False)
    assert draft == "hybrid" and not reason.startswith("explore")
    assert policy.exploration.exploring == {"draft-l1-tflite": "s2"}
    assert "hybrid+eagle-h1" in policy.exploration.tried


def test_a_drafter_whose_session_ended_mid_try_is_tried_by_another() -> None:
    exploration = HostExploration()
    policy = AdaptivePolicy()
    candidates = policy.decide("s0", DEVICE, "chat", "hybrid", 0.0, m.Mode.CLOUD, HOST).candidates
    cloud = [c for c in candidates if c.mode is m.Mode.CLOUD]
    first = exploration.pick("s1", cloud)
    assert first is not None
    exploration.forget_session("s1")
    again = exploration.pick("s2", cloud)
    assert again is not None and again.draft_model == first.draft_model
    # A session's try ends at its next decision, which tries nothing; the one after may, if it
    # opens a stream.
    assert exploration.pick("s2", cloud, opens=True) is None
    assert first.draft_model in exploration.tried
    assert exploration.pick("s2", cloud, opens=False) is None
    assert exploration.pick("s2", cloud, opens=True) is not None


def test_a_loaded_verifier_keeps_sessions_on_the_host_and_a_kept_stream_explores_nothing() -> None:
    """Where no window pays (31 streams beside on a CPU verifier), the session stays on the host
    in cloud mode, worth plain decoding's tokens/s: its verifier runs its passes plainly and
    drafts only where a window pays. A stream kept going tries no drafter."""
    policy = AdaptivePolicy()
    policy.observe_verifiers((20.0, 1.5, 2.5), {})
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 31.0, m.Mode.PLAIN, HOST, plain=True)
    assert decision.mode is m.Mode.CLOUD, decision.reason
    plain = next(c for c in decision.candidates if c.mode is m.Mode.PLAIN)
    cloud = [c for c in decision.candidates if c.mode is m.Mode.CLOUD]
    assert max(c.tokens_per_s for c in cloud) < plain.tokens_per_s  # no window pays here
    assert f"plain passes {plain.tokens_per_s:.1f}" in decision.reason
    assert policy.exploration.exploring == {}


def test_a_session_opening_in_cloud_mode_opens_its_stream_with_an_untried_drafter() -> None:
    """An adaptive session opens where it is rated best, with no margin asked. Opened on the
    host, its stream starts at round 0 (the coordinator decides with `new_stream`): the opening
    tries the untried drafter, as the decision after a device's round 0 would."""
    policy = AdaptivePolicy()
    policy.observe_verifiers((20.0, 1.5, 1.0), {"hybrid": 0.2})
    for i in range(30):
        policy.observe(cloud_round("hybrid", f"warm-{i}", 2, 2))
    decision = policy.decide(
        "old", DEVICE, "chat", "hybrid", 0.0, host_drafts=HOST, plain=True, opening=True
    )
    assert opening_candidate(decision) == max(decision.candidates, key=lambda c: c.tokens_per_s)
    assert opening_candidate(decision).mode is m.Mode.CLOUD  # type: ignore[union-attr]
    assert policy.exploration.exploring == {}  # an opening that opens no stream tries nothing
    decision = policy.decide(
        "new",
        DEVICE,
        "chat",
        "hybrid",
        0.0,
        host_drafts=HOST,
        plain=True,
        opening=True,
        new_stream=True,
    )
    opened = opening_candidate(decision)
    assert opened is not None and opened.mode is m.Mode.CLOUD
    assert opened.draft_model == "hybrid+eagle-h1"
    assert decision.reason.startswith("explore hybrid+eagle-h1")
    assert policy.exploration.exploring == {"hybrid+eagle-h1": "new"}


def test_a_drafter_offered_in_the_hybrid_too_is_tried_in_the_hybrid_only() -> None:
    policy = AdaptivePolicy()
    host = ("hybrid", "eagle-h1", "hybrid+eagle-h1")
    candidates = policy.decide("s0", DEVICE, "chat", "hybrid", 0.0, m.Mode.CLOUD, host).candidates
    cloud = [c for c in candidates if c.mode is m.Mode.CLOUD]
    # Rated above the hybrid or not, the head alone is never the one tried.
    boosted = [c._replace(tokens_per_s=1e6) if c.draft_model == "eagle-h1" else c for c in cloud]
    exploration = HostExploration(tried={"hybrid"})
    picked = exploration.pick("s1", boosted)
    assert picked is not None and picked.draft_model == "hybrid+eagle-h1"
    assert exploration.pick("s2", boosted) is None
