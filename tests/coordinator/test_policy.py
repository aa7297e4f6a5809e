"""The adaptive policy: its model of a round, what it learns, and which way its choices move."""

from __future__ import annotations

import itertools
import json

import pytest

from broker import messages as m
from coordinator.runtime.batch_cost import streams_lost
from coordinator.runtime.decisions import MODE_DWELL_ROUNDS, Candidate, choose_mode
from coordinator.runtime.policy import SWITCH_MARGIN, AdaptivePolicy, RoundObservation
from coordinator.runtime.round_model import (
    CLOUD_STREAM_ROUNDS,
    K_MAX,
    AcceptanceRate,
    ProposalLength,
    VerifyCost,
    expected_tokens,
    expected_tokens_capped,
    round_ms,
    verifier_load,
    window_ms,
)
from coordinator.runtime.task_types import classify_task, resolve_task

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
    mode: m.Mode = m.Mode.DISTRIBUTED,
    prefill: bool = False,
    window: int | None = None,  # None: the k drafted
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
        mode=mode,
        window=k if window is None else window,
        prefill=prefill,
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
    cost = VerifyCost(prior=(25.0, 2.0, 5.0, 2.0, 0.0))
    assert cost.predict(4, 0.0) == pytest.approx(33.0)
    truth = (10.0, 3.0, 4.0, 1.5, 0.0)
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
    # A device that never ran lookup: what the fleet sees of it on the task, else on every
    # task (30 windows of 4 accepted and 30 missed at once: 4 of 5 tried, decayed), else the
    # prior.
    assert policy.alpha("other-device", "lookup", "code") == pytest.approx(code)
    fleet = policy.wants.fleet_draft_alpha["lookup"]
    assert policy.alpha("other-device", "lookup", "math") == pytest.approx(fleet.alpha)
    assert 0.7 < fleet.alpha < 0.85
    assert policy.alpha("other-device", "ngram", "math") == pytest.approx(0.5)


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


# --- the mode -------------------------------------------------------------------------------


def _candidate(mode: m.Mode, rate: float) -> Candidate:
    return Candidate("hybrid", 0.5, 0.2, 4, 2.0, 2000.0 / rate, rate, mode)


D, C = m.Mode.DISTRIBUTED, m.Mode.CLOUD


@pytest.mark.parametrize(
    ("current", "rates", "rounds_in_mode", "chosen"),
    [
        (D, {D: 10.0, C: 11.9}, 5, D),  # less than the margin: stay
        (D, {D: 10.0, C: 12.1}, 5, C),  # past the margin: switch
        (D, {D: 10.0, C: 30.0}, MODE_DWELL_ROUNDS - 1, D),  # just switched: dwell first
        (C, {D: 30.0, C: 10.0}, MODE_DWELL_ROUNDS, D),
        (C, {D: 10.0}, 0, D),  # no verifier drafts any more: leave at once
        (D, {D: 10.0}, 0, D),  # nothing else to choose
    ],
)
def test_mode_changes_only_past_the_margin_and_the_dwell(
    current: m.Mode, rates: dict[m.Mode, float], rounds_in_mode: int, chosen: m.Mode
) -> None:
    best = {mode: _candidate(mode, rate) for mode, rate in rates.items()}
    mode, reason = choose_mode(current, best, rounds_in_mode)
    assert mode is chosen
    assert reason


@pytest.mark.parametrize(
    ("mode", "k", "draft_ms", "rtt_ms", "load", "expected"),
    [
        (D, 4, 1.0, 60.0, 0.0, 4.0 + 60.0 + 2.0 + 30.0),
        (C, 4, 1.0, 60.0, 0.0, 4.0 + 60.0 / CLOUD_STREAM_ROUNDS + 2.0 + 30.0),
        (C, 4, 1.0, 60.0, 2.0, 12.0 + 60.0 / CLOUD_STREAM_ROUNDS + 2.0 + 30.0),
        (D, 4, 1.0, 60.0, 2.0, 4.0 + 60.0 + 2.0 + 30.0),  # the device drafts alone
    ],
)
def test_round_time_of_each_mode(
    mode: m.Mode, k: int, draft_ms: float, rtt_ms: float, load: float, expected: float
) -> None:
    assert round_ms(mode, k, draft_ms, rtt_ms, 2.0, 30.0, load) == pytest.approx(expected)


def _cloud_policy(rtt_ms: float, host_ms_per_token: float = 0.2) -> AdaptivePolicy:
    policy = AdaptivePolicy()
    policy.set_device_drafts(DEVICE, [])
    for i in range(20):
        policy.observe(
            _round(draft="hybrid", k=4, n_accepted=2, t_uplink_ms=rtt_ms / 2, session=f"d{i}")
        )
        policy.observe(
            _round(
                draft="hybrid",
                k=4,
                n_accepted=2,
                t_draft_ms=4 * host_ms_per_token,
                t_uplink_ms=None,
                session=f"c{i}",
                mode=C,
            )
        )
    return policy


@pytest.mark.parametrize(
    ("rtt_ms", "host_ms_per_token", "mode"),
    [
        (150.0, 0.2, C),  # a congested link: drafting next to the target pays
        (60.0, 0.2, C),
        (0.5, 5.0, D),  # a LAN, and a host that drafts slowly: the device drafts
    ],
)
def test_rtt_and_host_draft_cost_pick_the_mode(
    rtt_ms: float, host_ms_per_token: float, mode: m.Mode
) -> None:
    policy = _cloud_policy(rtt_ms, host_ms_per_token)
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, D, ("hybrid", "lookup"))
    assert decision.mode is mode
    assert {c.mode for c in decision.candidates} == {D, C}
    record = json.loads(json.dumps(decision.to_json()))
    assert record["mode"] == mode.value
    assert record["decision"]["current_mode"] == "distributed"
    assert "mode" in record["decision"]["reason"]


def test_without_host_drafts_the_policy_never_chooses_cloud() -> None:
    policy = _cloud_policy(150.0)
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, D, ())
    assert decision.mode is D
    assert all(c.mode is D for c in decision.candidates)


def test_cloud_rounds_teach_the_host_cost_and_share_alpha_with_the_device() -> None:
    policy = AdaptivePolicy()
    for i in range(20):
        policy.observe(
            _round(draft="hybrid", k=4, n_accepted=4, t_draft_ms=40.0, session=f"c{i}", mode=C)
        )
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, C, ("hybrid",))
    by_mode = {c.mode: c for c in decision.candidates if c.draft_model == "hybrid"}
    assert by_mode[C].draft_ms_per_token == pytest.approx(10.0, rel=0.05)
    assert by_mode[D].draft_ms_per_token == pytest.approx(0.2)  # the device's prior, untouched
    assert by_mode[C].alpha == by_mode[D].alpha > 0.9


def test_cloud_windows_shrink_as_the_verifier_load_grows() -> None:
    policy = _cloud_policy(150.0, host_ms_per_token=2.0)
    windows = [
        policy.decide(f"s{load}", DEVICE, "chat", "hybrid", load, C, ("hybrid",)).k
        for load in (0.0, 4.0, 16.0)
    ]
    assert windows == sorted(windows, reverse=True) and windows[0] > windows[-1]


def test_a_session_does_not_flap_between_modes() -> None:
    """The RTT swings across the break-even point at every round: the mode changes, then dwells."""
    policy = _cloud_policy(10.0, host_ms_per_token=4.0)
    mode = D
    modes = []
    for step in range(12):
        for _ in range(30):  # the RTT estimate settles on the new link
            policy.observe_rtt(DEVICE, 60.0 if step % 2 == 0 else 0.1)
        decision = policy.decide("flappy", DEVICE, "chat", "hybrid", 0.0, mode, ("hybrid",))
        mode = decision.mode
        modes.append(mode)
    changes = [i for i in range(1, len(modes)) if modes[i] is not modes[i - 1]]
    assert modes[0] is C and changes  # it does follow the link
    assert all(b - a >= MODE_DWELL_ROUNDS for a, b in itertools.pairwise(changes))


def test_a_drafter_that_proposes_nothing_expects_little() -> None:
    """lookup without a match drafts no token: such a round commits the target's token alone."""
    policy = AdaptivePolicy()
    policy.set_device_drafts(DEVICE, [])
    for i in range(10):
        policy.observe(_round(draft="lookup", k=0, n_accepted=0, window=4, session=f"s{i}"))
        policy.observe(_round(draft="ngram", k=0, n_accepted=0, window=0, session=f"t{i}"))
    decision = policy.decide("s1", DEVICE, "chat", "lookup", 0.0)
    by_draft = {c.draft_model: c for c in decision.candidates}
    assert by_draft["lookup"].drafted < 0.6 and by_draft["lookup"].expected_tokens < 1.2
    # k = 0 asked for (a target-only round): nothing was tried, the prior still holds.
    assert by_draft["ngram"].drafted == by_draft["ngram"].k


@pytest.mark.parametrize(("alpha", "k"), [(0.0, 4), (0.5, 1), (0.5, 3), (0.9, 8)])
def test_a_filled_window_expects_the_geometric_sum(alpha: float, k: int) -> None:
    assert expected_tokens_capped(alpha, [1.0] * k) == pytest.approx(expected_tokens(alpha, k))


@pytest.mark.parametrize(
    ("survival", "expected"),
    [([], 1.0), ([1.0, 0.5], 1.0 + 1.0 + 0.5), ([0.0, 0.0], 1.0), ([0.5], 1.5)],
)
def test_a_window_not_filled_expects_what_is_proposed(
    survival: list[float], expected: float
) -> None:
    assert expected_tokens_capped(1.0, survival) == pytest.approx(expected)


def test_positions_past_the_window_are_not_counted_as_stops() -> None:
    capped = ProposalLength()
    for _ in range(20):
        capped.update(window=2, n_drafted=2)  # it filled every window it was given
    assert capped.go_on(1) == capped.go_on(2) == 1.0
    assert capped.go_on(3) == 1.0  # never allowed: still the prior
    short = ProposalLength()
    for _ in range(20):
        short.update(window=8, n_drafted=2)  # it stopped at 2 with room for more
    assert short.go_on(2) == 1.0 and short.go_on(3) < 0.15
    assert max(short.survival(8)[2:]) < 0.15


@pytest.mark.parametrize("mode", [m.Mode.DISTRIBUTED, m.Mode.CLOUD])
@pytest.mark.parametrize("load", [0.0, 3.0])
def test_the_window_chosen_is_the_best_by_the_tested_formulas(mode: m.Mode, load: float) -> None:
    """best_window rates each window with the functions the tests above check: E
    (expected_tokens_capped), n(k), t_verify (VerifyCost.predict) and T (window_ms, round_ms's
    own formula)."""
    policy = AdaptivePolicy()
    fill = ProposalLength()
    for _ in range(10):
        fill.update(window=8, n_drafted=3)  # a drafter that stops itself after ~3 tokens
    alpha, per_token, fixed_ms = 0.7, 2.0, 12.0
    k, tokens, total, drafted = policy.best_window(alpha, per_token, fixed_ms, load, mode, fill)
    survival = fill.survival(policy.k_max)
    rates = {}
    for window in range(1, policy.k_max + 1):
        e = expected_tokens_capped(alpha, survival[:window])
        n = sum(survival[:window])
        verify = policy.verify_cost.predict(n, load, waits=mode is m.Mode.DISTRIBUTED)
        rates[window] = e / window_ms(mode, [n], per_token, fixed_ms, [verify], load)[0]
    assert k == max(rates, key=rates.__getitem__)
    assert tokens / total == pytest.approx(rates[k])
    assert drafted == pytest.approx(sum(survival[:k]))


def test_a_drafter_that_stops_itself_keeps_a_wide_window_under_load() -> None:
    """Its window is a cap: a wider one costs nothing when it is not filled, and pays when a
    long match fills it; a draft that always fills its window gets a shorter one under load."""
    policy = AdaptivePolicy()
    for i in range(40):
        long_match = i % 5 == 0
        policy.observe(
            _round(
                draft="hybrid",
                k=8 if long_match else 1,
                n_accepted=8 if long_match else 1,
                window=8,
                load=4.0,
                session=f"h{i}",
            )
        )
        policy.observe(_round(draft="draft-l2", k=8, n_accepted=4, load=4.0, session=f"n{i}"))
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 4.0)
    by_draft = {c.draft_model: c for c in decision.candidates}
    assert by_draft["hybrid"].k >= 8 and by_draft["hybrid"].drafted < by_draft["hybrid"].k / 2
    assert by_draft["draft-l2"].drafted == pytest.approx(by_draft["draft-l2"].k, rel=0.05)


def test_a_draft_never_run_on_the_device_starts_from_what_its_others_see() -> None:
    policy = AdaptivePolicy()
    for i in range(30):
        policy.observe(_round(draft="hybrid", k=4, n_accepted=0, session=f"s{i}"))
    assert policy.alpha(DEVICE, "lookup", "chat") < 0.1  # not the hopeful prior of 0.5
    assert policy.alpha("another-device", "lookup", "chat") == pytest.approx(0.5)


def test_rounds_that_wait_on_a_device_learn_their_own_verify_time() -> None:
    """Rounds that wait on the device find the verifier slower than streamed ones; on a short
    RTT that alone may decide the mode."""
    policy = AdaptivePolicy()
    policy.set_device_drafts(DEVICE, [])
    for i in range(30):
        policy.observe(_round(draft="hybrid", t_verify_ms=80.0, t_uplink_ms=1.0, session=f"d{i}"))
        policy.observe(
            _round(draft="hybrid", t_verify_ms=35.0, t_uplink_ms=None, session=f"c{i}", mode=C)
        )
    assert policy.verify_cost.predict(4, 0.0, waits=True) == pytest.approx(80.0, rel=0.1)
    assert policy.verify_cost.predict(4, 0.0, waits=False) == pytest.approx(35.0, abs=10.0)
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, D, ("hybrid",))
    assert decision.mode is C
    assert decision.to_json()["decision"]["verify_coefficients"][4] > 30.0  # what waiting costs


def test_the_cost_of_waiting_fades_when_no_streamed_round_measures_it() -> None:
    """A mode judged on old rounds is judged again: without streamed rounds, e drifts to 0."""
    cost = VerifyCost()
    for _ in range(30):
        cost.update(4, 0.0, 20.0, waits=False)  # streamed rounds, when the host was quiet
        cost.update(4, 0.0, 160.0, waits=True)
    assert cost.coefficients()[4] > 80.0
    for _ in range(300):
        cost.update(4, 0.0, 60.0, waits=True)  # the host got busy; nothing streamed since
    assert cost.coefficients()[4] < 20.0


def test_waiting_never_makes_a_round_cheaper() -> None:
    cost = VerifyCost()
    for _ in range(30):
        cost.update(4, 0.0, 200.0, waits=False)  # streamed rounds that met a busy host
        cost.update(4, 0.0, 60.0, waits=True)
    assert cost.coefficients()[4] == 0.0


def test_a_round_whose_pass_prefilled_does_not_teach_the_verify_time() -> None:
    policy = AdaptivePolicy()
    before = policy.verify_cost.predict(4, 0.0)
    policy.observe(_round(k=4, n_accepted=0, t_verify_ms=400.0, prefill=True))
    assert policy.verify_cost.predict(4, 0.0) == pytest.approx(before)


# --- heat and power ------------------------------------------------------------------------


def _telemetry(**fields: object) -> m.Telemetry:
    return m.Telemetry(device_id=DEVICE, at=1.0, **fields)  # type: ignore[arg-type]


def test_a_hot_device_drafts_no_more_while_a_host_mode_is_on_offer() -> None:
    policy = _cloud_policy(0.5, 5.0)  # a LAN and a slow host: drafting on the device pays
    assert policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, D, ("hybrid",)).mode is D
    policy.observe_telemetry(DEVICE, _telemetry(thermal_c=84.0))
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, D, ("hybrid",))
    assert decision.mode is C  # at once: no dwell, no margin
    assert decision.device_limit == "device too hot: 84 °C (limit 80)"
    assert decision.reason.startswith("device too hot: 84 °C (limit 80): drafting moves off")
    record = json.loads(json.dumps(decision.to_json()))
    assert record["decision"]["device_limit"] == decision.device_limit
    # Just under the limit is not cool enough; 5 °C under it is.
    policy.observe_telemetry(DEVICE, _telemetry(thermal_c=77.0))
    assert policy.device_limit(DEVICE) is not None
    policy.observe_telemetry(DEVICE, _telemetry(thermal_c=74.0))
    assert policy.device_limit(DEVICE) is None
    assert policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, C, ("hybrid",)).device_limit is None


def test_a_device_low_on_battery_with_no_host_mode_gets_its_cheapest_drafter() -> None:
    policy = AdaptivePolicy()
    policy.set_device_drafts(DEVICE, ["draft-l1"])
    for i in range(20):  # the neural draft accepts far more, and costs 8 ms a token
        policy.observe(_round(draft="draft-l1", k=4, n_accepted=4, t_draft_ms=8.0, session=f"n{i}"))
        policy.observe(_round(draft="lookup", k=4, n_accepted=0, session=f"l{i}"))
    assert policy.decide("s1", DEVICE, "chat", "draft-l1", 0.0).draft_model == "draft-l1"

    policy.observe_telemetry(
        DEVICE, _telemetry(battery_percent=12.0, charging=False, battery_floor_percent=15.0)
    )
    decision = policy.decide("s1", DEVICE, "chat", "draft-l1", 0.0)
    assert decision.mode is D and decision.draft_model != "draft-l1"
    assert all(c.draft_model != "draft-l1" for c in decision.candidates)
    assert decision.reason.startswith(
        "device battery low and not charging: battery 12% (floor 15%): drafting moves to "
        f"{decision.draft_model}"
    )
    # Plugged in, the limit is gone; the device's own floor (15%) replaced the default (20%).
    policy.observe_telemetry(DEVICE, _telemetry(battery_percent=12.0, charging=True))
    assert policy.device_limit(DEVICE) is None
    policy.observe_telemetry(DEVICE, _telemetry(battery_percent=18.0, charging=False))
    assert policy.device_limit(DEVICE) is None


def test_power_saver_keeps_drafting_off_the_device_and_telemetry_without_readings_is_no_state() -> (
    None
):
    policy = _cloud_policy(0.5, 5.0)
    policy.observe_telemetry(DEVICE, _telemetry(cpu_percent=10.0))
    assert policy._condition == {}
    policy.observe_telemetry(DEVICE, _telemetry(power_saver=True))
    decision = policy.decide("s1", DEVICE, "chat", "hybrid", 0.0, D, (), plain=True)
    assert decision.mode is m.Mode.PLAIN
    assert decision.device_limit == "device power saver on"


# --- memory and drafts on demand -------------------------------------------------------------


def _a_paying_draft(policy: AdaptivePolicy) -> None:
    """draft-l2 is installed and accepts far more than lookup: the policy asks for it."""
    policy.set_device_drafts(DEVICE, ["draft-l2"])
    for i in range(30):
        policy.observe(_round(draft="lookup", k=4, n_accepted=0, session=f"a{i}"))
        policy.observe(_round(draft="draft-l2", k=4, n_accepted=4, t_draft_ms=8.0, session=f"b{i}"))
    assert policy.decide("s0", DEVICE, "chat", "lookup", 0.0).draft_model == "draft-l2"


def test_a_draft_that_does_not_fit_the_devices_memory_is_not_asked_for() -> None:
    policy = AdaptivePolicy()
    _a_paying_draft(policy)
    over = _telemetry(memory_available_mb=100.0, drafts_over_memory=("draft-l2",))
    policy.observe_telemetry(DEVICE, over)
    decision = policy.decide("s1", DEVICE, "chat", "lookup", 0.0)
    assert decision.draft_model != "draft-l2"
    assert "draft-l2" not in {c.draft_model for c in decision.candidates}
    assert decision.reason.endswith(
        "; memory: draft-l2 do not fit the 100 MB free on the device: not asked for"
    )
    # Memory freed: the next telemetry says nothing is over, and the draft is asked for again.
    policy.observe_telemetry(DEVICE, _telemetry(memory_available_mb=900.0))
    assert policy.memory_note(DEVICE) is None
    assert policy.decide("s2", DEVICE, "chat", "lookup", 0.0).draft_model == "draft-l2"


def test_a_draft_whose_fetch_failed_is_left_out_until_its_backoff_ends() -> None:
    policy = AdaptivePolicy()
    _a_paying_draft(policy)
    policy.set_fetch_failure(DEVICE, "draft-l2", "signature: signature does not verify")
    decision = policy.decide("s1", DEVICE, "chat", "lookup", 0.0)
    assert "draft-l2" not in {c.draft_model for c in decision.candidates}
    assert policy.decide("s1", DEVICE, "chat", "draft-l2", 0.0).draft_model == "draft-l2"
    policy.set_fetch_failure(DEVICE, "draft-l2", None)
    assert policy.decide("s2", DEVICE, "chat", "lookup", 0.0).draft_model == "draft-l2"


def test_streams_lost_is_the_cheaper_of_widening_their_pass_and_a_pass_apart() -> None:
    cost = VerifyCost()  # the prior: t = 25 + 2 k + 5 load + 2 k load
    assert streams_lost(cost, [1.0, 4.0], 16.0, 0.0) == [0.0, 0.0]
    stream_pass = cost.predict(0, 16.0, waits=False)
    lost = streams_lost(cost, [1.0, 4.0], 16.0, 15.0)
    for drafted, loss in zip([1.0, 4.0], lost, strict=True):
        widened = cost.predict(drafted, 16.0, waits=False) - stream_pass
        apart = cost.predict(drafted, 1.0, waits=True)
        assert loss == pytest.approx(15.0 * min(widened, apart) / stream_pass)
    # One stream beside: joining its pass costs less than a pass apart.
    one = streams_lost(cost, [4.0], 1.0, 1.0)[0]
    alone_pass = cost.predict(0, 1.0, False)
    assert one == pytest.approx((cost.predict(4, 1.0, False) - alone_pass) / alone_pass)
    assert cost.predict(4, 1.0, False) - alone_pass < cost.predict(4, 1.0, True)
    assert streams_lost(cost, [4.0], 16.0, 30.0)[0] == pytest.approx(2 * lost[1])


def test_a_device_window_beside_a_busy_batch_of_streams_goes_to_the_host() -> None:
    """Alone on its verifier, a LAN device drafts (test_rtt_and_host_draft_cost_pick_the_mode);
    beside 15 host streams the same window would hold them all up, and the session is hosted.
    The loss is on the record."""
    policy = _cloud_policy(0.5, 5.0)
    alone = policy.decide("s1", DEVICE, "chat", "hybrid", 16.0, D, ("hybrid",), plain=True)
    assert alone.mode is D and alone.streams_beside == 0.0
    assert all(c.streams_lost == 0.0 for c in alone.candidates)
    busy = policy.decide(
        "s2", DEVICE, "chat", "hybrid", 16.0, D, ("hybrid",), plain=True, beside=15.0
    )
    assert busy.mode in m.HOST_MODES
    distributed = [c for c in busy.candidates if c.mode is D]
    assert distributed and all(c.streams_lost > 0 for c in distributed)
    for c in distributed:
        assert c.tokens_per_s == pytest.approx(
            max(0.0, c.expected_tokens - c.streams_lost) / c.round_ms * 1000.0
        )
    record = json.loads(json.dumps(busy.to_json()))
    assert record["decision"]["streams_beside"] == 15.0
    assert record["decision"]["candidates"][0]["streams_lost"] > 0


def test_where_the_host_can_draft_a_hosted_session_is_cloud_worth_at_least_plain_decoding() -> None:
    """Beside 31 streams on a CPU verifier no window pays, and plain decoding promises more than
    any cloud window. Its verifier chooses each pass's window, k = 0 among them, so the session
    goes to the host in cloud mode, rated at plain decoding's tokens/s, with the drafter whose
    windows promise most: a session in plain mode moves there, and one in cloud mode stays.
    Without host drafters plain mode is what the host offers."""
    policy = AdaptivePolicy()
    policy.observe_verifiers((20.0, 1.5, 2.5), {})
    for current in (m.Mode.PLAIN, C):
        decision = policy.decide(
            f"s-{current.value}",
            DEVICE,
            "chat",
            "hybrid",
            31.0,
            current,
            ("hybrid", "lookup"),
            plain=True,
        )
        plain = next(c for c in decision.candidates if c.mode is m.Mode.PLAIN)
        cloud = [c for c in decision.candidates if c.mode is C]
        assert max(c.tokens_per_s for c in cloud) < plain.tokens_per_s, decision.reason
        assert decision.mode is C, decision.reason
        # The drafter is chosen on its windows (the current one kept within the switch margin).
        chosen = next(c for c in cloud if c.draft_model == decision.draft_model)
        best_window = max(c.tokens_per_s for c in cloud)
        assert chosen.tokens_per_s * SWITCH_MARGIN >= best_window and decision.k == chosen.k >= 1
        assert f"plain passes {plain.tokens_per_s:.1f}" in decision.reason
    without = policy.decide("s-none", DEVICE, "chat", "hybrid", 31.0, m.Mode.PLAIN, (), plain=True)
    assert without.mode is m.Mode.PLAIN, without.reason
