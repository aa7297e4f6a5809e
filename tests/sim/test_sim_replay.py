"""Replays of measured benchmarks, and the parts of calibration they lean on: the run's own pass
cost, each run's host speed, the broker as a pure delay, a cut link."""

from __future__ import annotations

import math
import random

import pytest

from sim.calibrate import (
    RecordedRound,
    RecordedSession,
    fit_host_speed,
    fit_prefill_scale,
    fit_run_cost,
    plain_passes,
    plain_prefill_speed,
    run_keys,
)
from sim.engine import Broker, Device, Fleet, Link, Server, prefills_ms
from sim.inputs import LinkSpec, PositionRates, SimInputError
from sim.validate import Comparison, _bus_wave, _Work, mean_of, replay_adaptive, replay_e2e
from tests.sim.conftest import PASS_MS, flat_profile, make_calibration


def test_a_broker_without_a_limit_is_a_pure_delay_whatever_the_order_of_hops() -> None:
    broker = Broker(hop_ms=0.5, max_messages_per_s=None)
    assert broker.hop(100.0) == 100.5  # a message hopped ahead of time...
    assert broker.hop(1.0) == 1.5  # ...holds back none hopped after it for an earlier time
    limited = Broker(hop_ms=0.0, max_messages_per_s=1000.0)
    assert limited.hop(0.0) == 1.0
    assert limited.hop(0.0) == 2.0  # behind a throughput limit they queue


def test_a_cut_link_delivers_when_it_is_back_and_reconnected() -> None:
    link = Link(LinkSpec(profile="loopback"), random.Random(0))
    link.cut(at_ms=100.0, for_ms=1500.0, resume_ms=200.0)
    assert link.delay(50.0, upstream=True) == 50.0
    assert link.delay(120.0, upstream=True) == 1800.0
    assert link.delay(2000.0, upstream=False) == 2000.0
    # With the client's back-off, it is back at its first try after the link is.
    link.cut(at_ms=3000.0, for_ms=1500.0, backoff_s=(0.2, 5.0))
    back = link.delay(3100.0, upstream=True)
    assert 4500.0 <= back <= 4500.0 + 5000.0  # a try comes at most RECONNECT_MAX_S after


def test_the_run_cost_fit_recovers_a_linear_cost_from_its_passes() -> None:
    a, b, c = 20.0, 3.0, 1.5
    passes = [
        (None, rows, t, a + b * rows + c * rows * (t - 1))
        for rows in (1, 2, 4, 8, 16)
        for t in (1, 2, 5)
        for _ in range(3)
    ]
    fitted = fit_run_cost(passes)
    assert fitted is not None
    assert fitted == pytest.approx((a, b, c), rel=1e-6)
    assert fit_run_cost(passes[:5]) is None  # too few passes to trust: the profile stays


def test_each_run_gets_its_host_speed_from_its_own_passes() -> None:
    profile = flat_profile()
    passes = [("e2e hybrid x4", 4, 2, PASS_MS * 1.5)] * 5 + [("e2e adaptive x4", 4, 2, PASS_MS)] * 5
    passes += [("e2e adaptive x16", 16, 2, PASS_MS)] * 4  # under 5 passes: no figure
    assert fit_host_speed(profile, passes) == {"e2e hybrid x4": 1.5, "e2e adaptive x4": 1.0}


def test_a_runs_speed_is_its_passes_time_over_the_models_with_stalls_left_out() -> None:
    """What a run's passes took in all, against what the model prices them at: the figure
    throughput follows (a median of ratios would let the most common shape decide). A pass
    over twice the run's typical ratio stalled, and is left out."""
    profile = flat_profile()
    passes = [("e2e adaptive x32", 32, 1, PASS_MS)] * 6 + [
        ("e2e adaptive x32", 4, 1, PASS_MS * 1.6)
    ]
    passes += [("e2e adaptive x32", 32, 1, PASS_MS * 9.0)]  # the host descheduled the target
    speed = fit_host_speed(profile, passes)["e2e adaptive x32"]
    assert speed == pytest.approx((6 + 1.6) / 7)


def _round(session: str, index: int, ms: float, drafted: int = 0) -> RecordedRound:
    return RecordedRound(
        session_id=session, round_index=index, mode="distributed", draft_model="hybrid",
        drafted=drafted, n_accepted=0, window=drafted, t_draft_ms=0.0, t_verify_ms=ms,
    )  # fmt: skip


def test_prefills_are_priced_as_the_runs_passes_that_prefilled_paid_them() -> None:
    """Three sessions prefilled in one pass of the run at speed 2 cost 1.5 times the profile's
    prefills beyond the pass itself: the scale is 1.5. Later rounds' passes do not count."""
    profile = flat_profile().model_copy(
        update={"prefill_fixed_ms": 10.0, "prefill_ms_per_token": 1.0}
    )
    speed = {"e2e adaptive x16": 2.0}
    sessions = [RecordedSession(f"s{i}", "chat", 40, 10, 10, True) for i in range(9)]
    prefills = 3 * (10.0 + 40.0)
    rounds = []
    for wave in range(3):  # three passes that prefilled, each with its own time
        ms = 2.0 * (PASS_MS + 1.5 * prefills) + wave * 1e-3
        rounds += [_round(f"s{3 * wave + i}", 0, ms, drafted=4) for i in range(3)]
    rounds += [_round("s0", 1, 2.0 * PASS_MS), _round("s1", 1, 2.0 * PASS_MS)]
    document = {"sessions": [{"session_id": f"s{i}", "run": "adaptive x16"} for i in range(9)]}
    scale = fit_prefill_scale(rounds, sessions, [document], profile, speed)
    assert scale == pytest.approx(1.5, rel=1e-4)
    # Two such passes are too few to trust; a run without a speed is not priced.
    assert fit_prefill_scale(rounds[:6], sessions, [document], profile, speed) is None
    assert fit_prefill_scale(rounds, sessions, [document], profile, {}) is None


def test_a_pass_that_prefills_several_prompts_pays_each_ones_own_prefill() -> None:
    """Prompts prefilled in one pass run one after another, each its own length: 20 and 40
    positions cost a prefill of 20 and one of 40 (padded to the longest, as once priced, they
    would cost two of 40). The calibration scales the profile against the same sum: a pass that
    paid 1.5 times it, at speed 1, gives 1.5."""
    profile = flat_profile().model_copy(
        update={"prefill_fixed_ms": 10.0, "prefill_ms_per_token": 1.0}
    )
    assert prefills_ms(profile, [20, 40]) == (10.0 + 20.0) + (10.0 + 40.0)
    assert prefills_ms(profile, []) == 0.0
    sessions = [RecordedSession(f"s{i}", "chat", 20 + 20 * (i % 2), 10, 10, True) for i in range(6)]
    rounds = []
    for wave in range(3):
        ms = PASS_MS + 1.5 * ((10.0 + 20.0) + (10.0 + 40.0)) + wave * 1e-3
        rounds += [_round(f"s{2 * wave + i}", 0, ms, drafted=4) for i in range(2)]
    document = {"sessions": [{"session_id": f"s{i}", "run": "adaptive x4"} for i in range(6)]}
    speed = {"e2e adaptive x4": 1.0}
    assert fit_prefill_scale(rounds, sessions, [document], profile, speed) == pytest.approx(
        1.5, rel=1e-4
    )


def test_plain_servings_prefills_get_their_own_speed_from_the_json() -> None:
    profile = flat_profile().model_copy(
        update={"prefill_fixed_ms": 10.0, "prefill_ms_per_token": 1.0}
    )
    sessions = [
        {"run": "plain serving x4", "prompt_len": 40, "prefill_ms": ms} for ms in (55.0, 60.0, 75.0)
    ]
    sessions += [{"run": "plain serving x1", "prompt_len": 40}]  # written before they were
    assert plain_prefill_speed([{"sessions": sessions}], profile) == {
        "e2e plain serving x4 prefill": pytest.approx(60.0 / 50.0)
    }


def test_replays_under_several_seeds_are_averaged_with_their_range() -> None:
    def replay(rate: float, p99: float) -> list[Comparison]:
        return [Comparison("e2e", "hybrid x1", 10.0, rate, (1.0, 2.0), (3.0, p99))]

    (merged,) = mean_of([replay(9.0, 10.0), replay(12.0, 20.0), replay(12.0, 30.0)])
    assert merged.simulated_tokens_per_s == pytest.approx(11.0)
    assert merged.simulated_range == (9.0, 12.0)
    assert merged.simulated_wait_ms == pytest.approx((3.0, 20.0))
    assert merged.error == pytest.approx(0.1)
    other = [Comparison("e2e", "hybrid x4", 10.0, 9.0, (1.0, 2.0), (3.0, 4.0))]
    with pytest.raises(ValueError, match="different configurations"):
        mean_of([replay(9.0, 10.0), other])


def test_plain_serving_is_replayed_with_its_own_prefill_speed() -> None:
    """A plain-serving wave's prefills at the speed its JSON measured for them, not at its
    decode passes' speed."""
    profile = flat_profile().model_copy(update={"prefill_fixed_ms": 100.0})
    runs = [{"label": "plain serving x1", "arm": "plain", "sessions": 1,
             "throughput_tokens_per_s": 50.0}]  # fmt: skip
    document = {"settings": {"sessions": [1], "drafter": "hybrid", "agents": 1}, "runs": runs,
                "sessions": _sessions(1, 10, run="plain serving x1")}  # fmt: skip
    decode_ms = 9 * PASS_MS
    for prefill_speed, prefill_ms in ((None, 100.0), (3.0, 300.0)):
        host_speed = {"e2e plain serving x1": 1.0}
        if prefill_speed is not None:
            host_speed["e2e plain serving x1 prefill"] = prefill_speed
        calibration = make_calibration(verifiers={"cpu": profile}, host_speed=host_speed)
        (plain,) = replay_e2e(calibration, document)
        assert plain.simulated_tokens_per_s == pytest.approx(10 / (decode_ms + prefill_ms) * 1e3)


def test_a_session_without_its_prompt_length_takes_its_prompts_from_another_arm() -> None:
    """Plain serving's sessions carried no prompt length before bench e2e timed its prefills:
    the same prompt's length in a bus arm prices its prefill, not a default."""
    profile = flat_profile().model_copy(update={"prefill_ms_per_token": 1.0})
    calibration = make_calibration(verifiers={"cpu": profile})
    runs = [
        {"label": "plain serving x1", "arm": "plain", "sessions": 1, "throughput_tokens_per_s": 1},
        {"label": "hybrid x1", "arm": "fixed", "sessions": 1, "throughput_tokens_per_s": 1},
    ]
    sessions = [
        {"run": "plain serving x1", "task": "chat", "prompt_id": "chat-01", "tokens": 10},
        {"run": "hybrid x1", "task": "chat", "prompt_id": "chat-01", "prompt_len": 70,
         "tokens": 10, "k": 4, "wait_ms": [20.0]},
    ]  # fmt: skip
    document = {"settings": {"sessions": [1], "drafter": "hybrid", "agents": 1}, "runs": runs,
                "sessions": sessions}  # fmt: skip
    plain = replay_e2e(calibration, document)[0]
    assert plain.simulated_tokens_per_s == pytest.approx(10 / (9 * PASS_MS + 70.0) * 1e3)


def test_plain_serving_passes_and_run_keys_come_from_the_json() -> None:
    document = {
        "runs": [
            {"arm": "plain", "label": "plain serving x4", "batch_sizes": [4, 3], "pass_ms": [9, 8]}
        ],
        "sessions": [{"session_id": "ab-cd", "run": "hybrid x4"}],
    }
    assert plain_passes([document]) == [
        ("e2e plain serving x4", 4, 1, 9.0),
        ("e2e plain serving x4", 3, 1, 8.0),
    ]
    assert run_keys(document) == {"abcd": "e2e hybrid x4"}
    adaptive = {"benchmark": "adaptive", "sessions": [{"session_id": "ef", "phase": "4g",
                                                      "config": "adaptive"}]}  # fmt: skip
    assert run_keys(adaptive) == {"ef": "adaptive 4g adaptive"}


def _sessions(n: int, tokens: int, **fields: object) -> list[dict[str, object]]:
    return [{"task": "chat", "prompt_len": 30, "tokens": tokens, **fields} for _ in range(n)]


def test_an_e2e_replay_compares_every_arm_of_every_level() -> None:
    calibration = make_calibration()
    runs = []
    sessions: list[dict[str, object]] = []
    for level in (1, 2):
        for arm, label in (
            ("plain", "plain serving"),
            ("fixed", "hybrid"),
            ("adaptive", "adaptive"),
        ):
            name = f"{label} x{level}"
            runs.append({"label": name, "arm": arm, "sessions": level,
                         "throughput_tokens_per_s": 50.0})  # fmt: skip
            sessions += _sessions(2, 10, run=name, k=4, wait_ms=[20.0, 30.0])
    document = {"settings": {"sessions": [1, 2], "drafter": "hybrid", "agents": 2},
                "runs": runs, "sessions": sessions}  # fmt: skip
    comparisons = replay_e2e(calibration, document)
    assert [c.label for c in comparisons] == [r["label"] for r in runs]
    # Plain serving, hand-counted: 2 waves x 9 decode passes of PASS_MS (prefills are free).
    plain = comparisons[0]
    assert plain.simulated_tokens_per_s == pytest.approx(20 / (2 * 9 * PASS_MS) * 1e3)
    assert all(c.simulated_tokens_per_s > 0 for c in comparisons)
    assert all(math.isfinite(c.error) for c in comparisons)
    # A run with steady arrivals is not replayed as waves: refused, naming the field.
    document["settings"] = {**document["settings"], "arrivals": "steady"}
    with pytest.raises(SimInputError, match=r"settings\.arrivals"):
        replay_e2e(calibration, document)


def test_an_adaptive_replay_compares_every_configuration_in_every_phase() -> None:
    calibration = make_calibration()
    phases = ["lan", "4g", "blip"]
    configs = ["adaptive", "distributed:hybrid:4", "cloud:hybrid:4"]
    runs = [
        {"phase": p, "config": c, "tokens_per_s": 40.0, "wall_s": 1.0, "tokens": 40}
        for p in phases
        for c in configs
    ]
    sessions = [
        {"phase": p, "config": c, **s} for p in phases for c in configs for s in _sessions(2, 12)
    ]
    document = {
        "benchmark": "adaptive",
        "settings": {"phases": phases, "blip_s": 1.5, "blip_after_s": 0.0},
        "runs": runs,
        "sessions": sessions,
    }
    comparisons = replay_adaptive(calibration, document)
    assert [c.label for c in comparisons] == [f"{r['phase']} {r['config']}" for r in runs]
    by = {c.label: c.simulated_tokens_per_s for c in comparisons}
    # A distributed session pays its link's RTT every round: slower on 4G than on the LAN, and
    # slower still when its link is cut for 1.5 s at the start of the run.
    assert by["4g distributed:hybrid:4"] < by["lan distributed:hybrid:4"]
    assert by["blip distributed:hybrid:4"] < by["4g distributed:hybrid:4"]
    assert by["blip distributed:hybrid:4"] < 24 / 1.5
    # Where the run says when its agent got through again, the replay's link is out that long,
    # with no back-off of its own drawn: no session of the phase ends before it, and a stream's
    # tokens (computed meanwhile) all arrive soon after.
    for run in runs:
        if run["phase"] == "blip":
            run["link_back_s"] = 4.0
    back = {
        seed: {
            c.label: c.simulated_tokens_per_s for c in replay_adaptive(calibration, document, seed)
        }
        for seed in (0, 1)
    }
    assert back[0]["lan cloud:hybrid:4"] == by["lan cloud:hybrid:4"]  # the phases before, as before
    for rates in back.values():
        for config in configs:
            assert 24 / 6.0 < rates[f"blip {config}"] <= 24 / 4.0


def test_the_emulated_links_cost_is_what_rounds_waited_beyond_their_parts() -> None:
    from sim.calibrate import RecordedRound, fit_emulated_link

    rounds = [
        RecordedRound(
            "ab", i, "distributed", "hybrid", 2, 1, 4, 0.5, t_verify_ms=30.0, t_queue_ms=5.0
        )
        for i in range(12)
    ]
    # On 4G (30 ms each way) with a 10 ms service: a 140 ms wait leaves 140 - 30 - 5 - 60 - 10.
    document = {
        "benchmark": "adaptive",
        "sessions": [{"session_id": "ab", "phase": "4g", "wait_ms": [500.0] + [140.0] * 11}],
    }
    assert fit_emulated_link(rounds, [document], service_ms=10.0) == pytest.approx(35.0)
    assert fit_emulated_link(rounds[:5], [document], service_ms=10.0) is None


@pytest.mark.parametrize(
    ("trace", "rounds"),
    [
        (((4, 4), (4, 4)), 2),  # 5 tokens a round: 10 in 2
        (((4, 0),) * 10, 10),  # none accepted: a token a round
        (((2, 1),), 3),  # 2 tokens, then drawn (all accepted here): 5, and 3 to the end
    ],
)
def test_a_fixed_windows_session_replays_its_measured_rounds(
    trace: tuple[tuple[int, int], ...], rounds: int
) -> None:
    """A greedy session with a fixed window drafts and is accepted alike at any load, so a
    replayed one follows its measured rounds (`Session.trace`) rather than drawing them: drawn,
    the slowest of a wave of 32 took more rounds than any measured one (bench e2e's fixed
    drafter at 32 sessions replayed 11-14% slow)."""
    calibration = make_calibration()
    # Drawn rounds here accept everything they draft, so the round past the trace makes 5.
    calibration.acceptance["hybrid"]["*"] = PositionRates(fill=[1.0], accept=[1.0])
    host_cpu = Server()
    fleet = Fleet(calibration, ["cpu"], seed=0, host_cpu=host_cpu)
    device = Device(
        "bench-agent-0", "bench", Link(LinkSpec(profile="loopback"), fleet.rng), {}, host_cpu
    )
    work = [_Work("chat", 30, 10, None, trace)]
    _, waits = _bus_wave(fleet, [device], "fixed", "hybrid", 4, work)
    assert len(waits) == rounds  # a wait per round at the agent
