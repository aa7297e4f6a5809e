"""The adaptive policy: its model of a round, what it learns, and which way its choices move."""

from __future__ import annotations

import json

import pytest

from broker import messages as m
from coordinator.policy import (
    K_MAX,
    AcceptanceRate,
    AdaptivePolicy,
    RoundObservation,
    VerifyCost,
    classify_task,
    expected_tokens,
    resolve_task,
    verifier_load,
)

DEVICE = "pi-1"


def _round(
    *,
    draft: str = "lookup",
    task: str = "chat",
    k: int = 4,
    n_accepted: int = 2,
    t_draft_ms: float = 0.4,
    t_uplink_ms: float | None = 5.0,
    t_queue_ms: float = 1.0,
    t_verify_ms: float | None = None,  # None: the prior's own law
    load: float = 0.0,
    device: str = DEVICE,
    session: str = "s1",
) -> RoundObservation:
    return RoundObservation(
        session_id=session,
        device_id=device,
        draft_model=draft,
        task_type=task,
        k=k,
        n_accepted=n_accepted,
        t_draft_ms=t_draft_ms,
        t_uplink_ms=t_uplink_ms,
        t_queue_ms=t_queue_ms,
        t_verify_ms=VerifyCost().predict(k, load) if t_verify_ms is None else t_verify_ms,
        verifier_load=load,
    )


def _trained(n_accepted: int, rtt_ms: float = 20.0, rounds: int = 40) -> AdaptivePolicy:
    """A policy that has seen lookup accept n tokens then miss, round after round (a = n/(n+1)).

    n_accepted >= 16 means every token of every window was accepted.
    """
    policy = AdaptivePolicy()
    k = 16
    for i in range(rounds):
        policy.observe(
            _round(k=k, n_accepted=min(k, n_accepted), t_uplink_ms=rtt_ms / 2, session=f"s{i}")
        )
    return policy


def _k(policy: AdaptivePolicy, load: float = 0.0) -> int:
    """The window the policy finds best for the session's current draft."""
    decision = policy.decide("s1", DEVICE, "chat", "lookup", load)
    current = decision.candidates[0]
    assert current.draft_model == "lookup"
    return current.k


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [
        (0.0, 4, 1.0),
        (0.5, 1, 1.5),
        (0.5, 3, 1.875),
        (0.8, 0, 1.0),
        (1.0, 5, 6.0),
    ],
)
def test_expected_tokens_is_the_geometric_sum(alpha: float, k: int, expected: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("rounds", "alpha"),
    [
        ([(4, 4)] * 30, 0.98),  # everything accepted: capped below 1
        ([(4, 0)] * 30, 0.0),  # nothing accepted
        ([(4, 1)] * 30, 0.5),  # one accepted, one rejected, each round
        ([(4, 3)] * 30, 0.75),
        ([(0, 0)] * 30, 0.5),  # empty drafts tell nothing: the prior stays
    ],
)
def test_acceptance_rate_counts_accepted_over_tried(
    rounds: list[tuple[int, int]], alpha: float
) -> None:
    rate = AcceptanceRate()
    for k, n in rounds:
        rate.update(k, n)
    assert rate.alpha == pytest.approx(alpha, abs=0.01)


def test_verify_cost_learns_a_linear_law_and_starts_from_the_prior() -> None:
    cost = VerifyCost(prior=(25.0, 2.0, 5.0, 2.0))
    assert cost.predict(4, 0.0) == pytest.approx(33.0)
    truth = (10.0, 3.0, 4.0, 1.5)
    for step in range(400):
        k, load = 1 + step % 9, float(step % 5)
        verify_ms = sum(c * x for c, x in zip(truth, VerifyCost.features(k, load), strict=True))
        cost.update(k, load, verify_ms, decay=0.999)
    # Coefficients trade off along collinear features; what must hold is the prediction.
    for k, load in [(1, 0.0), (4, 2.0), (9, 4.0), (6, 1.0)]:
        want = sum(c * x for c, x in zip(truth, VerifyCost.features(k, load), strict=True))
        assert cost.predict(k, load) == pytest.approx(want, rel=0.03)


@pytest.mark.parametrize(("low", "high"), [(0, 1), (1, 3), (3, 9)])  # n accepted: a = n/(n+1)
def test_higher_acceptance_gives_a_longer_window(low: int, high: int) -> None:
    assert _k(_trained(low)) < _k(_trained(high))


@pytest.mark.parametrize(("low", "high"), [(5.0, 80.0), (20.0, 150.0), (80.0, 400.0)])
def test_higher_rtt_gives_a_longer_window(low: float, high: float) -> None:
    assert _k(_trained(2, rtt_ms=low)) < _k(_trained(2, rtt_ms=high))


@pytest.mark.parametrize(("low", "high"), [(0.0, 2.0), (2.0, 8.0), (0.0, 16.0)])
def test_higher_verifier_load_gives_a_shorter_window(low: float, high: float) -> None:
    policy = _trained(4)
    assert _k(policy, load=low) > _k(policy, load=high)


def test_window_never_leaves_its_bounds() -> None:
    assert _k(_trained(16, rtt_ms=5000.0)) == K_MAX
    assert _k(_trained(0), load=100.0) == 1


def test_load_measured_in_rounds_steers_the_window() -> None:
    """Rounds whose verify time grows with k * load teach the fit to shorten k under load."""
    policy = _trained(4)
    for step in range(200):
        k, load = 1 + step % 8, float(step % 6)
        verify_ms = 20.0 + 1.0 * k + 10.0 * k * load
        policy.observe(_round(k=k, n_accepted=min(k, 4), t_verify_ms=verify_ms, load=load))
    assert policy.verify_cost.predict(8, 5.0) == pytest.approx(20 + 8 + 400, rel=0.05)
    assert _k(policy, load=5.0) < _k(policy, load=0.0)


@pytest.mark.parametrize(
    ("prompt", "task"),
    [
        ("Translate 'good morning' into French.", "translate"),
        ("How do you say thank you in Spanish?", "translate"),
        ("Summarize this article in three sentences: ...", "summarize"),
        ("TL;DR of the meeting notes below", "summarize"),
        ("Write a Python function that reverses a list.", "code"),
        ("Why does this SQL query return duplicates?", "code"),
        ("What is 17 * 23?", "math"),
        ("Solve the equation x^2 - 4 = 0.", "math"),
        ("How many apples are left if I eat three of ten?", "math"),
        ("Tell me about the history of Rome.", "chat"),
        ("Hi! How are you today?", "chat"),
    ],
)
def test_classifier_names_the_task(prompt: str, task: str) -> None:
    assert classify_task(prompt) == task


@pytest.mark.parametrize(
    ("given", "task"),
    [("code", "code"), ("", "translate"), ("poetry", "translate"), ("math", "math")],
)
def test_unknown_task_types_are_classified(given: str, task: str) -> None:
    assert resolve_task(given, "Translate this into German: hello") == task


def test_alpha_is_kept_per_task_and_pooled_for_a_new_task() -> None:
    policy = AdaptivePolicy()
    for _ in range(30):
        policy.observe(_round(task="code", k=4, n_accepted=4))
        policy.observe(_round(task="chat", k=4, n_accepted=0))
    code, chat = policy.alpha(DEVICE, "lookup", "code"), policy.alpha(DEVICE, "lookup", "chat")
    assert code > 0.9 and chat < 0.1
    assert chat < policy.alpha(DEVICE, "lookup", "math") < code
    assert policy.alpha("other-device", "lookup", "code") == pytest.approx(0.5)


def test_switches_to_a_draft_that_pays_and_remembers_one_the_device_lacks() -> None:
    policy = AdaptivePolicy()
    policy.set_device_drafts(DEVICE, ["draft-l2"])
    for i in range(30):
        policy.observe(_round(draft="lookup", k=4, n_accepted=0, session=f"a{i}"))
        policy.observe(_round(draft="draft-l2", k=4, n_accepted=4, t_draft_ms=8.0, session=f"b{i}"))
    decision = policy.decide("s9", DEVICE, "chat", "lookup", 0.0)
    assert decision.draft_model == "draft-l2"
    assert decision.reason.startswith("switch")
    # The device keeps drafting with lookup: after a few rounds, the policy stops asking.
    for _ in range(3):
        policy.observe(_round(draft="lookup", k=4, n_accepted=0, session="s9"))
    decision = policy.decide("s9", DEVICE, "chat", "lookup", 0.0)
    assert decision.draft_model != "draft-l2"
    assert "draft-l2" not in {c.draft_model for c in decision.candidates}


def test_a_marginal_gain_does_not_switch_drafts() -> None:
    policy = AdaptivePolicy()
    policy.set_device_drafts(DEVICE, [])
    for i in range(30):
        for draft in ("lookup", "ngram", "hybrid"):
            policy.observe(_round(draft=draft, k=4, n_accepted=2, session=f"{draft}{i}"))
    decision = policy.decide("s1", DEVICE, "chat", "ngram", 0.0)
    assert decision.draft_model == "ngram"
    assert {c.draft_model for c in decision.candidates} == {"lookup", "ngram", "hybrid"}


def test_decision_is_recorded_with_its_inputs_and_reads_back_as_a_policy() -> None:
    policy = _trained(2, rtt_ms=60.0)
    policy.observe_rtt(DEVICE, 60.0)
    decision = policy.decide("s1", DEVICE, "chat", "lookup", 1.5)
    record = json.loads(json.dumps(decision.to_json()))
    restored = m.Policy.model_validate(record)
    assert restored == decision.policy
    assert restored.mode is m.Mode.DISTRIBUTED and restored.min_confidence is not None
    inputs = record["decision"]
    assert inputs["verifier_load"] == 1.5 and inputs["task_type"] == "chat"
    assert inputs["rtt_ms"] == pytest.approx(60.0, rel=0.05)
    assert {c["draft_model"] for c in inputs["candidates"]} >= {"lookup", "ngram", "hybrid"}
    chosen = next(c for c in inputs["candidates"] if c["draft_model"] == decision.draft_model)
    assert chosen["k"] == decision.k


@pytest.mark.parametrize(("loads", "mean"), [([], 0.0), ([3], 3.0), ([0, 2, 4], 2.0)])
def test_verifier_load_is_the_mean_over_live_verifiers(loads: list[int], mean: float) -> None:
    assert verifier_load(loads) == mean
