"""The policy prices rounds with the verifiers' own costs: their pass cost model and what their
drafters cost a token on the host (VerifierStatus.pass_cost and draft_ms)."""

from __future__ import annotations

import pytest

from broker import messages as m
from coordinator.runtime.decisions import Decision
from coordinator.runtime.policy import (
    PRIOR_HOST_DRAFT_MS_PER_TOKEN,
    PRIOR_NEURAL_DRAFT_MS_PER_TOKEN,
    AdaptivePolicy,
    RoundObservation,
)
from coordinator.runtime.round_model import VerifyCost

DEVICE = "phone-1"
PASS_COST = (20.0, 1.5, 1.0)  # a' + b' B + c' B T: a lone plain pass 22.5 ms


def law(k: int, load: float) -> float:
    rows = load + 1.0
    return PASS_COST[0] + PASS_COST[1] * rows + PASS_COST[2] * rows * (k + 1)


def observation(
    k: int, load: float, verify_ms: float, mode: m.Mode, session: str, t_draft_ms: float = 0.4
) -> RoundObservation:
    return RoundObservation(
        session_id=session,
        device_id=DEVICE,
        draft_model="hybrid",
        task_type="chat",
        k=k,
        n_accepted=min(k, 2),
        t_draft_ms=t_draft_ms,
        t_uplink_ms=5.0,
        t_queue_ms=0.5,
        t_verify_ms=verify_ms,
        verifier_load=load,
        mode=mode,
        window=k,
    )


def test_the_reported_cost_is_the_verifiers_law_and_waiting_rounds_learn_their_excess() -> None:
    cost = VerifyCost()
    cost.set_reported(PASS_COST)
    for k, load in [(0, 0.0), (4, 0.0), (2, 3.0), (8, 15.0)]:
        assert cost.predict(k, load, waits=False) == pytest.approx(law(k, load))
        assert cost.predict(k, load, waits=True) == pytest.approx(law(k, load))  # none seen yet
    for i in range(30):  # rounds that waited on a device took 6 ms beyond the law
        k, load = i % 5, float(i % 3)
        cost.update(k, load, law(k, load) + 6.0, waits=True)
        cost.update(k, load, law(k, load), waits=False)
    assert cost.predict(3, 2.0, waits=True) == pytest.approx(law(3, 2.0) + 6.0)
    assert cost.predict(3, 2.0, waits=False) == pytest.approx(law(3, 2.0))
    cost.set_reported(None)  # no verifier reports one: the fit of the rounds again
    assert cost.predict(0, 0.0) != pytest.approx(law(0, 0.0))


def test_a_lone_session_is_not_sent_plain_on_a_fit_extrapolated_to_load_0() -> None:
    """Rounds seen at load 1 and more (the session's own stream counted) left the fit's
    intercept near 0; a lone session at load 0 was then rated plain at ~0 ms a round. With the
    verifier's law a plain round costs its pass, and a window that accepts pays."""
    policy = AdaptivePolicy()
    for i in range(60):
        load = 1.0 + i % 4
        verify_ms = 24.0 + 70.0 * (load - 1.0)  # a wave's slow first passes at loads 2-4
        policy.observe(observation(i % 3, load, verify_ms, m.Mode.CLOUD, f"s{i}"))

    def plain_round_ms(session: str) -> tuple[float, Decision]:
        decision = policy.decide(
            session, DEVICE, "chat", "hybrid", 0.0, m.Mode.CLOUD, ("hybrid",), plain=True
        )
        return next(c.round_ms for c in decision.candidates if c.mode is m.Mode.PLAIN), decision

    fitted, _ = plain_round_ms("before")
    assert fitted < 10.0  # the fit's own extrapolation: what sent lone sessions plain
    policy.observe_verifiers(PASS_COST, {})
    reported, decision = plain_round_ms("after")
    assert reported == pytest.approx(law(0, 0.0), rel=0.2)
    assert decision.mode is m.Mode.CLOUD, decision.reason


def test_host_drafters_cost_what_the_verifiers_report() -> None:
    policy = AdaptivePolicy()
    # A first cloud round whose window also prefilled the draft: 30 ms a token on the round.
    policy.observe(observation(4, 0.0, 30.0, m.Mode.CLOUD, "s0", t_draft_ms=120.0))
    policy.observe_verifiers(PASS_COST, {"hybrid+eagle-h1": 1.2, "hybrid": 0.1})
    host = ("hybrid", "hybrid+eagle-h1", "draft-l1")
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, m.Mode.CLOUD, host)
    cost = {(c.mode, c.draft_model): c.draft_ms_per_token for c in decision.candidates}
    assert cost[(m.Mode.CLOUD, "hybrid+eagle-h1")] == 1.2
    assert cost[(m.Mode.CLOUD, "hybrid")] == 0.1  # the verifier's, not the prefilled round's
    # Not timed by any verifier yet: a server CPU's prior, not a phone's.
    assert cost[(m.Mode.CLOUD, "draft-l1")] == PRIOR_HOST_DRAFT_MS_PER_TOKEN
    assert PRIOR_HOST_DRAFT_MS_PER_TOKEN < PRIOR_NEURAL_DRAFT_MS_PER_TOKEN
    assert cost[(m.Mode.DISTRIBUTED, "hybrid")] == 0.2  # the device's prior, untouched
