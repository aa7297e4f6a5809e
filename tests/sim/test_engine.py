"""The discrete-event core against what can be counted by hand, and its seeded reproducibility."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from broker import messages as m
from coordinator.runtime.round_model import CLOUD_STREAM_ROUNDS
from sim.engine import Acceptance, Device, Fleet, Link, Session, Verifier, _Row
from sim.inputs import Calibration, LinkSpec, PositionRates, VerifierProfile
from sim.validate import LOOPBACK
from tests.sim.conftest import PASS_MS, make_calibration
from verifier.worker import HEARTBEAT_S


def _one_session(calibration: Calibration, policy: m.Policy, length: int, seed: int = 0) -> Session:
    fleet = Fleet(calibration, ["cpu"], seed=seed)
    device = Device("d0", "bench", Link(LOOPBACK, fleet.rng), {"hybrid": 0.0})
    ended: list[Session] = []
    session = Session(
        id="s0",
        device=device,
        task="chat",
        prompt_tokens=30,
        length=length,
        adaptive=False,
        policy=policy,
        opened_at=0.0,
        on_end=ended.append,
    )
    fleet.open_session(session)
    fleet.loop.run()
    assert ended == [session]
    return session


def test_a_plain_session_takes_one_pass_per_token(calibration: Calibration) -> None:
    session = _one_session(calibration, m.Policy(mode=m.Mode.PLAIN, draft_model="hybrid", k=0), 40)
    assert session.generated == 40
    assert session.ended_at == pytest.approx(40 * PASS_MS)
    assert session.token_gaps_ms() == pytest.approx([PASS_MS] * 39)
    assert session.rounds_by_mode == {"plain": 40}


def test_a_distributed_session_commits_what_acceptance_says(calibration: Calibration) -> None:
    # fill 1, accept 0.5 per position: E = 1 + .5 + .25 + .125 + .0625 tokens per round of k = 4,
    # each round one 20 ms pass and 1 ms of service.
    policy = m.Policy(mode=m.Mode.DISTRIBUTED, draft_model="hybrid", k=4)
    session = _one_session(calibration, policy, 4000)
    rounds = session.rounds_by_mode["distributed"]
    assert session.generated / rounds == pytest.approx(1.9375, rel=0.05)
    assert session.ended_at == pytest.approx(rounds * (PASS_MS + 1.0))


def test_the_same_seed_gives_the_same_run() -> None:
    calibration = make_calibration(verifiers={"cpu": _noisy()})
    policy = m.Policy(mode=m.Mode.DISTRIBUTED, draft_model="hybrid", k=4)
    first = _one_session(calibration, policy, 300, seed=7)
    again = _one_session(calibration, policy, 300, seed=7)
    other = _one_session(calibration, policy, 300, seed=8)
    assert first.commits == again.commits
    assert first.commits != other.commits


def _noisy():  # type: ignore[no-untyped-def]
    from tests.sim.conftest import flat_profile

    return flat_profile(cv=0.1)


@pytest.mark.parametrize(
    ("fill", "accept", "window", "mean_drafted", "mean_accepted"),
    [
        (1.0, 1.0, 4, 4.0, 4.0),  # fills every window, all accepted
        (1.0, 0.0, 4, 4.0, 0.0),  # fills every window, none accepted
        (0.0, 1.0, 4, 0.0, 0.0),  # never proposes
        (1.0, 0.5, 2, 2.0, 0.75),  # 0.5 + 0.25
        (0.5, 1.0, 2, 0.75, 0.75),
    ],
)
def test_acceptance_draws_follow_the_rates(
    fill: float, accept: float, window: int, mean_drafted: float, mean_accepted: float
) -> None:
    rates = PositionRates(fill=[fill] * 4, accept=[accept] * 4)
    calibration = make_calibration(acceptance={"hybrid": {"chat": rates}})
    draws = Acceptance(calibration, random.Random(3))
    samples = [draws.draw("hybrid", "chat", window) for _ in range(20_000)]
    assert statistics.fmean(d for d, _ in samples) == pytest.approx(mean_drafted, abs=0.03)
    assert statistics.fmean(a for _, a in samples) == pytest.approx(mean_accepted, abs=0.03)
    assert all(a <= d <= window for d, a in samples)


def test_a_link_adds_its_profiles_latency_and_waits_out_an_outage() -> None:
    rng = random.Random(1)
    four_g = Link(LinkSpec(profile="4g"), rng)
    delays = [four_g.delay(0.0, upstream=True) for _ in range(1000)]
    assert min(delays) >= 22.0 and max(delays) <= 39.0  # 30 ms +- 8 ms jitter, plus 0.5 ms rate
    assert statistics.fmean(delays) == pytest.approx(30.5, abs=0.5)
    cut = Link(LinkSpec(profile="loopback", outage_every_s=1.0, outage_s=2.0), rng)
    start = cut._starts[0]
    assert cut.delay(start + 1.0, upstream=True) == pytest.approx(start + 2000.0)


def test_an_outage_holds_what_is_sent_into_it_whatever_was_asked_before() -> None:
    """A message sent ahead of the clock (a verdict once a CPU is done, an RTT probe's way
    back) may be asked about past an outage's end; one sent into the outage afterwards still
    waits for the link (a cut was forgotten, and a stream's verdicts crossed it)."""
    link = Link(LinkSpec(profile="loopback"), random.Random(0))
    link.cut(300.0, 1500.0, resume_ms=50.0)
    assert link.delay(100.0, upstream=False) == pytest.approx(100.0)
    assert link.delay(5_000.0, upstream=True) == pytest.approx(5_000.0)  # far ahead
    assert link.delay(400.0, upstream=False) == pytest.approx(1_850.0)  # held: back at 1.85 s
    assert link.delay(1_900.0, upstream=False) == pytest.approx(1_900.0)
    # A periodic link's outages, asked out of order, come out the same.
    ahead = Link(LinkSpec(profile="loopback", outage_every_s=1.0, outage_s=0.5), random.Random(3))
    inline = Link(LinkSpec(profile="loopback", outage_every_s=1.0, outage_s=0.5), random.Random(3))
    times = [float(t) for t in range(0, 20_000, 37)]
    in_order = [inline.back_at(t) for t in times]
    ahead.back_at(25_000.0)
    assert [ahead.back_at(t) for t in times] == in_order
    assert any(back > t for back, t in zip(in_order, times, strict=True))


def test_a_stream_cut_off_its_device_ends_with_its_last_verdict(calibration: Calibration) -> None:
    """The verifier streams on through a cut (40 plain passes of PASS_MS, done by 0.8 s); the
    verdicts sent into the cut reach the device when the link is back, and the session ends
    with the last of them, each one's wait counted (the first to arrive had ended it)."""
    fleet = Fleet(calibration, ["cpu"], seed=0)
    link = Link(LOOPBACK, fleet.rng)
    link.cut(at_ms=100.0, for_ms=2000.0)
    ended: list[Session] = []
    session = Session(
        id="s0", device=Device("d0", "bench", link, {"hybrid": 0.0}), task="chat",
        prompt_tokens=30, length=40, adaptive=False,
        policy=m.Policy(mode=m.Mode.PLAIN, draft_model="hybrid", k=0), opened_at=0.0,
        on_end=ended.append,
    )  # fmt: skip
    fleet.open_session(session)
    fleet.loop.run()
    assert ended == [session]
    assert session.delivered == session.generated == 40
    assert len(session.waits_ms) == len(session.commits) == 40
    assert session.ended_at == pytest.approx(max(at for at, _ in session.commits))
    assert session.ended_at >= 2100.0
    held = [wait for wait in session.waits_ms if wait > 10 * PASS_MS]
    assert len(held) == 1 and held[0] > 1000.0  # the wait across the cut; the rest came at once
    assert statistics.median(session.waits_ms) < 1.0


def _cloud_run(terms: dict[str, tuple[float, float]]) -> tuple[Session, Fleet]:
    calibration = make_calibration(host_draft_terms=terms)
    fleet = Fleet(calibration, ["cpu"], seed=3)
    device = Device("d0", "bench", Link(LOOPBACK, fleet.rng), {"hybrid": 0.0})
    policy = m.Policy(mode=m.Mode.CLOUD, draft_model="hybrid", k=2)
    session = Session(
        id="s0", device=device, task="chat", prompt_tokens=30, length=200, adaptive=False,
        policy=policy, opened_at=0.0, on_end=lambda _: None,
    )  # fmt: skip
    fleet.open_session(session)
    fleet.loop.run()
    return session, fleet


def test_host_drafting_costs_a_pass_a_plus_b_n_per_window_token_and_the_verifier_learns_it() -> (
    None
):
    """A cloud stream's windows of 2 drafted at 3 ms a step plus 1 ms a row, per window token:
    8 ms a pass beside the 20 ms verification, which the verifier's goodput control learns as
    it does from its own passes. The draws are the same either way (drafting draws nothing)."""
    free, _ = _cloud_run({"hybrid": (0.0, 0.0)})
    priced, fleet = _cloud_run({"hybrid": (3.0, 1.0)})
    assert priced.generated == free.generated == 200
    assert priced.rounds_by_mode == free.rounds_by_mode
    rounds = priced.rounds_by_mode["cloud"]
    # Every round a pass of one row; its window of 2 costs (3 + 1) x 2 ms (1 near the end).
    assert rounds * 6.0 < priced.ended_at - free.ended_at <= rounds * 8.0
    assert fleet.verifiers[0].control.draft_ms("hybrid", 1) == pytest.approx(4.0, rel=0.05)


def test_a_replayed_session_draws_from_its_prompts_rates_and_others_from_their_tasks() -> None:
    task = PositionRates(fill=[1.0] * 4, accept=[0.5] * 4)
    copying = PositionRates(fill=[1.0] * 4, accept=[0.95] * 4)
    calibration = make_calibration(
        acceptance={"hybrid": {"chat": task}}, prompt_acceptance={"hybrid": {"chat-07": copying}}
    )
    draws = Acceptance(calibration, random.Random(5))

    def mean_accepted(prompt: str | None, drafter: str = "hybrid") -> float:
        return statistics.fmean(draws.draw(drafter, "chat", 1, prompt)[1] for _ in range(5000))

    assert mean_accepted("chat-07") == pytest.approx(0.95, abs=0.02)
    # A hybrid of the drafter answers from its table too, as the task tables do.
    assert mean_accepted("chat-07", "hybrid+eagle-h1") == pytest.approx(0.95, abs=0.02)
    assert mean_accepted("chat-01") == pytest.approx(0.5, abs=0.03)  # no table: its task's
    assert mean_accepted(None) == pytest.approx(0.5, abs=0.03)


def test_the_policy_sees_the_verifiers_costs_once_a_heartbeat(calibration: Calibration) -> None:
    """The coordinator's policy knows a verifier's pass cost from its heartbeats (one every
    HEARTBEAT_S), so a pass timed between two of them changes nothing until the next."""
    fleet = Fleet(calibration, ["cpu"], seed=0)
    coordinator, control = fleet.coordinator, fleet.verifiers[0].control
    coordinator._report_costs()
    reported = fleet.policy.verify_cost.reported
    assert reported == control.cost.coefficients
    for _ in range(50):  # the verifier times passes three times as dear
        control.observe_pass(4, 1, 3 * PASS_MS)
    assert control.cost.coefficients != reported
    fleet.loop.now = HEARTBEAT_S * 1e3 - 1.0
    coordinator._report_costs()
    assert fleet.policy.verify_cost.reported == reported
    fleet.loop.now = HEARTBEAT_S * 1e3
    coordinator._report_costs()
    assert fleet.policy.verify_cost.reported == control.cost.coefficients


def test_a_host_drafted_round_records_its_share_of_the_pass_drafting() -> None:
    """The verifier's draft_together splits a call's time among its rows, and that share is
    the round's t_draft_ms, which the policy learns the host's drafting cost from: two rows
    drafted together at 3 ms a step plus 1 ms a row, windows of 2, cost 10 ms, 5 each."""
    fleet = Fleet(make_calibration(host_draft_terms={"hybrid": (3.0, 1.0)}), ["cpu"], seed=0)
    device = Device("d0", "bench", Link(LOOPBACK, fleet.rng), {"hybrid": 0.0})

    def session(i: int, mode: m.Mode) -> Session:
        return Session(
            id=f"s{i}", device=device, task="chat", prompt_tokens=30, length=100,
            adaptive=True, policy=m.Policy(mode=mode, draft_model="hybrid", k=2),
            opened_at=0.0, on_end=lambda _: None,
        )  # fmt: skip

    rows = [_Row(session(i, m.Mode.CLOUD), 2, 2, 1, 0.0, stream=True) for i in range(2)]
    rows.append(_Row(session(2, m.Mode.DISTRIBUTED), 4, 4, 2, 0.0, stream=False))
    assert fleet.verifiers[0]._drafting(rows) == pytest.approx(10.0)
    assert [row.draft_ms for row in rows] == pytest.approx([5.0, 5.0, 0.0])


def test_a_plain_choice_runs_on_in_the_child_until_other_work_comes() -> None:
    """After a plain choice for every stream and no device row, the verifier's inference
    process runs STEPS_PER_CALL plain passes by itself (`Steps`): the goodput rule is asked
    again only after them, or at once when a device's round arrives."""
    fleet = Fleet(make_calibration(), ["cpu"], seed=0)
    verifier = fleet.verifiers[0]
    device = Device("d0", "bench", Link(LOOPBACK, fleet.rng), {"hybrid": 0.0})
    stream = Session(
        id="s0", device=device, task="chat", prompt_tokens=30, length=100, adaptive=True,
        policy=m.Policy(mode=m.Mode.PLAIN, draft_model="hybrid", k=0),
        opened_at=0.0, on_end=lambda _: None,
    )  # fmt: skip
    asked: list[int] = []
    choose = verifier.control.choose

    def counted(*args: Any, **kwargs: Any) -> Any:
        asked.append(verifier.passes)
        return choose(*args, **kwargs)

    verifier.control.choose = counted  # type: ignore[method-assign]
    verifier.open_stream(stream)  # pass 1: chosen plain, then passes 2-4 run on
    for _ in range(3):
        fleet.loop.run(until=fleet.loop.now + PASS_MS)
    assert asked == [1]
    assert verifier.passes >= 4
    fleet.loop.run(until=fleet.loop.now + PASS_MS)  # pass 5: asked again
    assert asked == [1, 5]
    row = _Row(Session(
        id="s1", device=device, task="chat", prompt_tokens=30, length=100, adaptive=False,
        policy=m.Policy(mode=m.Mode.DISTRIBUTED, draft_model="hybrid", k=4),
        opened_at=0.0, on_end=lambda _: None,
    ), 4, 4, 2, fleet.loop.now, stream=False)  # fmt: skip
    verifier.submit(row)  # a device's round: the next pass is chosen with it
    assert verifier.run_on == 0


def test_a_stream_that_ran_out_of_rounds_goes_on_without_a_word_to_the_device() -> None:
    """After CLOUD_STREAM_ROUNDS rounds the coordinator opens the next stream itself, from what
    it persisted: on 4G (30 ms each way) no gap between two tokens holds a device round trip."""
    fleet = Fleet(make_calibration(), ["cpu"], seed=0)
    device = Device("d0", "bench", Link(LinkSpec(profile="4g"), fleet.rng), {"hybrid": 0.0})
    session = Session(
        id="s0", device=device, task="chat", prompt_tokens=30, length=3 * CLOUD_STREAM_ROUNDS,
        adaptive=False, policy=m.Policy(mode=m.Mode.PLAIN, draft_model="hybrid", k=0),
        opened_at=0.0, on_end=lambda _: None,
    )  # fmt: skip
    fleet.open_session(session)
    fleet.loop.run()
    assert session.generated == 3 * CLOUD_STREAM_ROUNDS
    gaps = session.token_gaps_ms()
    # A pass each, and the downlink's jitter (+-8 ms) between two verdicts: never + 60 ms.
    assert max(gaps) < PASS_MS + 2 * 8.0 + 5.0


def _on(verifier: Verifier, name: str, policy: m.Policy, adaptive: bool, length: int) -> Session:
    """A session of device d0 that `verifier` serves, as the coordinator would hand it over."""
    device = Device("d0", "bench", Link(LOOPBACK, verifier.fleet.rng), {"hybrid": 0.0})
    session = Session(
        id=name, device=device, task="chat", prompt_tokens=30, length=length, adaptive=adaptive,
        policy=policy, opened_at=0.0, on_end=lambda _: None,
    )  # fmt: skip
    session.verifier = verifier
    return session


def _record_passes(verifier: Verifier) -> list[list[str]]:
    """Each pass's rows (their sessions' ids), in the order the verifier ends them."""
    passes: list[list[str]] = []
    end_pass = verifier._end_pass

    def recorded(batch: list[_Row], *args: Any) -> None:
        passes.append([row.session.id for row in batch])
        end_pass(batch, *args)

    verifier._end_pass = recorded  # type: ignore[method-assign]
    return passes


def test_a_pass_that_opens_a_session_leaves_the_stream_under_way_to_the_next() -> None:
    """As the verifier does (`HostStreams.turn`): the pass that prefills a new stream's prompt
    runs without the stream that ran the pass before; that one joins the pass after."""
    fleet = Fleet(make_calibration(), ["cpu"], seed=0)
    verifier = fleet.verifiers[0]

    def stream(name: str) -> Session:
        plain = m.Policy(mode=m.Mode.PLAIN, draft_model="hybrid", k=0)
        return _on(verifier, name, plain, adaptive=True, length=20)

    rows = _record_passes(verifier)
    verifier.open_stream(stream("under-way"))
    fleet.loop.run(until=fleet.loop.now + PASS_MS / 2)
    verifier.open_stream(stream("opened"))
    fleet.loop.run()
    assert rows[:3] == [["under-way"], ["opened"], ["under-way", "opened"]]


def _device_beside_streams(streams: int) -> tuple[list[bool], list[list[str]]]:
    """A device's distributed session (k = 4) joining a verifier with `streams` adaptive cloud
    streams under way, passes costing 30 + 2 B + 3 B T ms: the worker's rule's decision for
    each pass that held the device's round (`GoodputControl.apart`), and every pass's rows."""
    profile = VerifierProfile(
        passes=[(b, t, 30.0 + 2.0 * b + 3.0 * b * t) for b in (1, 2, 4, 8, 16) for t in (1, 3, 5)],
        prefill_fixed_ms=0.0,
        prefill_ms_per_token=0.0,
        pass_cv=0.0,
    )
    fleet = Fleet(make_calibration(verifiers={"cpu": profile}), ["cpu"], seed=0)
    verifier = fleet.verifiers[0]

    def session(name: str, mode: m.Mode, adaptive: bool) -> Session:
        policy = m.Policy(mode=mode, draft_model="hybrid", k=4)
        return _on(verifier, name, policy, adaptive=adaptive, length=400)

    passes = _record_passes(verifier)
    decided: list[bool] = []
    apart = verifier.control.apart

    def counted(*args: Any, **kwargs: Any) -> bool:
        decided.append(apart(*args, **kwargs))
        return decided[-1]

    verifier.control.apart = counted  # type: ignore[method-assign]
    for i in range(streams):
        verifier.open_stream(session(f"s{i}", m.Mode.CLOUD, adaptive=True))
    fleet.loop.run(until=fleet.loop.now + 3000.0)  # under way, their windows learnt
    owner = session("d", m.Mode.DISTRIBUTED, adaptive=False)
    verifier.submit(_Row(owner, 4, 4, 1, fleet.loop.now, stream=False))
    fleet.loop.run(until=fleet.loop.now + 3000.0)  # its rounds go on as the fleet runs them
    return decided, passes


@pytest.mark.parametrize(("streams", "two_passes"), [(15, True), (2, False)])
def test_a_device_window_beside_streams_gets_a_pass_of_its_own_where_the_worker_gives_one(
    streams: int, two_passes: bool
) -> None:
    """As the worker does (`VerifierWorker._apart`): where one pass widened to a device's
    window promises less than two (15 streams widened to 5 positions), the device's round goes
    first in a pass of its own and the streams' round follows in the next; beside two streams
    one pass holds them all."""
    decided, passes = _device_beside_streams(streams)
    held = [i for i, rows in enumerate(passes) if "d" in rows]
    # One decision for each pass that held the device's round, in order (the last may run on).
    assert len(held) > 1 and len(decided) - len(held) in (0, 1)
    assert decided[0] is two_passes
    for two, at in zip(decided, held, strict=False):
        if two:
            assert passes[at] == ["d"]
            assert sorted(passes[at + 1]) == sorted(f"s{i}" for i in range(streams))
        else:
            assert len(passes[at]) == streams + 1
