"""Goodput control: the cost fit, acceptance per position, and the window of a pass."""

from __future__ import annotations

import pytest

from broker.client import BrokerAddress
from broker.messages import PassChoice, StreamSpec, VerifyRequest
from verifier.goodput import (
    DOUBT_EVERY,
    FORGET_AFTER,
    LONE_SPECULATION_MARGIN,
    PLAIN_REMEASURE_PASSES,
    SHAPE_CLIP,
    SHAPE_WEIGHT,
    SPECULATION_MARGIN,
    STALE_SHAPE_WEIGHT,
    DraftCost,
    GoodputControl,
    PassCost,
    PositionAcceptance,
    StreamRow,
)
from verifier.streams import HostStream
from verifier.worker import VerifierWorker, WorkerConfig, _Pending

# DESIGN.md, "What a batch costs on this machine": (rows, tokens per row) -> ms.
TABLE = {
    (1, 1): 37, (1, 3): 40, (1, 5): 43, (1, 9): 52,
    (4, 1): 44, (4, 3): 59, (4, 5): 84, (4, 9): 122,
    (16, 1): 102, (16, 3): 183, (16, 5): 267, (16, 9): 439,
    (32, 1): 171, (32, 3): 351, (32, 5): 498, (32, 9): 816,
}  # fmt: skip


def fitted() -> GoodputControl:
    control = GoodputControl()
    for _ in range(3):
        for (rows, positions), ms in TABLE.items():
            control.observe_pass(rows, positions, ms)
    return control


def test_the_cost_fit_follows_the_measured_table() -> None:
    cost = fitted().cost
    errors = [abs(cost.predict(b, t) - ms) / ms for (b, t), ms in TABLE.items()]
    assert max(errors) < 0.25
    assert sum(errors) / len(errors) < 0.12


def test_the_cost_fit_follows_a_host_that_slows_down() -> None:
    cost = PassCost(half_life=20)
    for _ in range(20):
        for (rows, positions), ms in TABLE.items():
            cost.observe(rows, positions, ms)
    before = cost.predict(16, 1)
    for _ in range(20):
        for (rows, positions), ms in TABLE.items():
            cost.observe(rows, positions, 2 * ms)
    assert cost.predict(16, 1) == pytest.approx(2 * before, rel=0.15)


@pytest.mark.parametrize(
    ("accepted", "expected"),
    [
        ([4] * 200, 5.0),  # every token of every window of 4
        ([0] * 200, 1.0),  # none: the target's own token only
        ([2] * 200, 3.0),  # always two
        ([0, 2] * 100, 2.0),  # half the windows none, half two
    ],
)
def test_expected_tokens_come_from_acceptance_per_position(
    accepted: list[int], expected: float
) -> None:
    stats = PositionAcceptance()
    for n in accepted:
        stats.observe(4, 4, n, forget=1.0)
    assert stats.expected_tokens(4, prior=0.5) == pytest.approx(expected, abs=0.2)


def learned(control: GoodputControl, draft: str, accepted: list[int]) -> None:
    for _ in range(100):
        for n in accepted:
            control.observe_round(draft, "chat", 8, 8, n)
    for _ in range(100):  # one window moves the estimate only so far (DRAFT_MS_CLIP)
        control.observe_draft_ms(draft, 8, 0.4)


@pytest.mark.parametrize(
    ("streams", "accepted", "plain"),
    [
        (1, [4], False),  # a lone session with good drafts: speculate
        (4, [4], False),  # a few: still
        (32, [0, 1], True),  # a full CPU batch with poor drafts: plain decoding wins
        (32, [1], False),  # ... but a first token always right pays even there (k = 1)
        (16, [0], True),  # drafts that never hold: never speculate
    ],
)
def test_the_pass_window_maximises_the_batchs_goodput(
    streams: int, accepted: list[int], plain: bool
) -> None:
    control = fitted()
    learned(control, "hybrid", accepted)
    rows = [StreamRow("hybrid", "chat", 8, 0.5)] * streams
    choice = control.choose(rows, [])
    assert (choice.k == 0) is plain, choice.reason
    # Never below plain decoding, and the best once each window's goodput is discounted by
    # SPECULATION_MARGIN of what it adds to the pass's cost (the risk of a wrong estimate).
    assert choice.goodput[str(choice.k)] >= choice.goodput["0"]
    plain_ms = control.cost.predict(streams, 1)

    def worth(k: int) -> float:
        drafting = control.draft_ms("hybrid", streams) * min(k, 8)
        extra = (control.cost.predict(streams, k + 1) + drafting) / plain_ms - 1.0
        margin = SPECULATION_MARGIN if streams > 1 else LONE_SPECULATION_MARGIN
        return choice.goodput[str(k)] / (1.0 + margin * max(0.0, extra))

    assert all(worth(int(k)) <= worth(choice.k) + 1e-9 for k in choice.goodput)
    assert choice.rows == streams


def test_a_streams_own_rounds_outweigh_its_tasks_rate() -> None:
    """The task's rate comes from other prompts; a stream's own rounds say what its prompt
    does. A stream whose drafts held on a task where they usually fail gets windows; one
    whose drafts failed where they usually hold decodes plainly."""
    control = fitted()
    learned(control, "hybrid", [1])  # the task's rate: the first token right, never a second
    copying, chatty = (
        StreamRow("hybrid", "chat", 8, 0.5, "s-copying"),
        StreamRow("hybrid", "chat", 8, 0.5, "s-chatty"),
    )
    task_alone = control.expected_tokens(StreamRow("hybrid", "chat", 8, 0.5), 4)
    for _ in range(12):
        control.observe_round("hybrid", "chat", 8, 8, 8, stream="s-copying")
        control.observe_round("hybrid", "chat", 8, 8, 0, stream="s-chatty")
    assert control.expected_tokens(copying, 4) > task_alone + 1.5
    assert control.expected_tokens(chatty, 4) < 1.5 < task_alone
    assert control.choose([copying] * 1, []).k >= 4
    assert control.choose([chatty] * 4, []).k == 0
    # A row that names no stream, or a stream with no rounds here, is scored on the task.
    task_now = control.expected_tokens(StreamRow("hybrid", "chat", 8, 0.5), 4)
    assert control.expected_tokens(StreamRow("hybrid", "chat", 8, 0.5, "new"), 4) == task_now
    # A stream that ended is forgotten.
    control.forget_stream("s-copying")
    assert control.expected_tokens(copying, 4) == task_now


def test_plain_streams_and_device_rows_set_the_pass_alone() -> None:
    control = fitted()
    choice = control.choose([StreamRow(None, "chat", 0, 0.5)] * 3, [4, 2])
    assert choice.k == 0 and set(choice.goodput) == {"0"} and choice.rows == 5


def test_a_shape_seen_is_predicted_from_its_own_passes() -> None:
    """A lone row is padded to two, so its positions cost ~1 ms where a wide batch's cost 2.5;
    each shape seen is predicted from its own passes, and between them along T."""
    cost = PassCost()
    lone = {1: 44.0, 9: 52.0}
    for _ in range(30):
        for (rows, positions), ms in TABLE.items():
            if rows > 1:
                cost.observe(rows, positions, ms)
        for positions, lone_ms in lone.items():
            cost.observe(1, positions, lone_ms)
    assert cost.predict(1, 5) == pytest.approx(48.0, abs=1.0)  # between its own points
    assert cost.predict(1, 9) == pytest.approx(52.0, abs=1.0)
    assert cost.predict(16, 4) == pytest.approx((183 + 267) / 2, rel=0.05)


def test_one_stalled_pass_does_not_make_its_shape_look_dear() -> None:
    cost = PassCost()
    for _ in range(30):
        for (rows, positions), ms in TABLE.items():
            cost.observe(rows, positions, ms)
    before = cost.predict(32, 1)
    cost.observe(32, 1, 2000.0)  # the host stalled the pass
    assert cost.predict(32, 1) < before * 1.06


def test_unseen_deep_positions_inherit_the_rate_before_them() -> None:
    """Windows of 2 that, once the first token holds, keep the second: positions 3..8 were
    never seen, and are taken to hold as the second did rather than at an even chance."""
    stats = PositionAcceptance()
    for n in [0, 2] * 100:
        stats.observe(2, 2, n, forget=1.0)
    rates = stats.rates(8, prior=0.5)
    assert rates[0] == pytest.approx(0.5, abs=0.02) and rates[1] > 0.95
    assert all(rate > 0.95 for rate in rates[2:])
    assert stats.expected_tokens(8, prior=0.5) > 4.5


def test_a_window_wider_than_its_shape_was_timed_is_not_free() -> None:
    """Two noisy points of one batch size, the plain pass slower than the window of 1 (bench e2e
    at 14 rows): a wider window is priced past them at the fit's cost of a position at least,
    not at nothing; the pass keeps plain decoding where the streams' acceptance is unknown."""
    cost = PassCost()
    for _ in range(30):
        for (rows, positions), ms in TABLE.items():
            cost.observe(rows, positions, ms)
    cost.observe(14, 1, 130.0)
    cost.observe(14, 2, 110.0)
    per_position = cost.coefficients[2] * 14
    assert per_position > 10.0
    assert cost.predict(14, 5) >= cost.predict(14, 2) + 3 * per_position - 1e-9
    assert cost.predict(14, 2) == pytest.approx(110.0)  # a point seen is its own
    control = GoodputControl()
    control.cost = cost
    picked = control.choose([StreamRow("hybrid", "chat", 4, 0.5)] * 14, [])
    assert picked.goodput["4"] < picked.goodput["0"]
    assert picked.k <= 1


def test_a_shape_with_one_point_below_a_steep_fit_is_predicted_positive() -> None:
    """One 16-row shape seen cheap, then passes on a loaded host that steepen the fit: below that
    point, the fit's slope alone predicted a negative cost (-926 ms stopped a verifier)."""
    cost = PassCost()
    cost.observe(16, 5, 200.0)
    for _ in range(40):
        for shape, pass_ms in (((8, 1), 200.0), ((8, 9), 3000.0), ((32, 1), 400.0)):
            cost.observe(*shape, pass_ms)
        cost.observe(32, 9, 9000.0)
    assert cost.fitted(16, 5) - cost.fitted(16, 1) > 200.0  # the slope alone would go below 0
    predicted = cost.predict(16, 1)
    assert 0.0 < predicted <= 200.0
    choice = GoodputControl()
    choice.cost = cost
    picked = choice.choose([StreamRow("hybrid", "chat", 4, 0.5)] * 16, [])
    assert picked.cost_ms > 0 and all(g < float("inf") for g in picked.goodput.values())


def _fresh_stream(index: int, draft: str | None = None) -> HostStream:
    """A fresh stream: plain, or adaptive drafting with `draft` (nothing seen of it here yet)."""
    opening = VerifyRequest(
        request_id=f"stream-{index}",
        session_id=f"s-{index}",
        round=0,
        context_ids=(1, 2, 3),
        tokens=(),
        cloud_draft=draft,
        cloud_k=8 if draft else None,
        stream=StreamSpec(rounds=8, max_new=32, eos_id=2, alpha=0.5 if draft else None),
    )
    return HostStream.open(opening, 0.0)


def _device_round(tokens: int) -> _Pending:
    request = VerifyRequest(
        request_id="device-round",
        session_id="device-session",
        round=3,
        context_ids=(1, 2, 3),
        tokens=tuple(range(5, 5 + tokens)),
    )
    return _Pending(request, 0.0)


def test_a_wide_device_window_gets_a_pass_of_its_own_beside_many_plain_streams() -> None:
    """Every row of a pass is padded to its widest window: one device window of 8 beside 31
    plain streams would make all 32 rows score 9 positions. Two passes commit more there; beside
    one stream, one pass does."""
    worker = VerifierWorker(WorkerConfig("apart-test"), BrokerAddress("127.0.0.1", 1))
    worker.goodput = fitted()
    device = [_device_round(8)]
    many = [_fresh_stream(i) for i in range(31)]
    together = worker._choose(many, [8])
    assert worker._apart(device, many, together)
    one = many[:1]
    assert not worker._apart(device, one, worker._choose(one, [8]))


def test_streams_widened_by_a_device_window_take_the_margin_of_any_window() -> None:
    """A wave's first session drafting on its device beside 15 fresh streams: alone the streams
    run plain (a window of theirs does not clear the margin), and widened to the device's
    window of 2 they promise a little more per second than the two passes apart, a bet on
    the same estimates. With the margin the device's window gets a pass of its own; beside two
    streams, whose widened pass costs less than two passes, one pass still serves all."""
    worker = VerifierWorker(WorkerConfig("apart-test"), BrokerAddress("127.0.0.1", 1))
    worker.goodput = fitted()
    device = [_device_round(2)]
    fifteen = [_fresh_stream(i, "hybrid") for i in range(15)]
    assert worker.goodput.choose([s.row() for s in fifteen], []).k == 0
    together = worker._choose(fifteen, [2])
    assert together.k == 2
    plain_ms = worker.goodput.cost.predict(15, 1) + worker.goodput.cost.predict(1, 3)
    tokens_apart = 15 + 1.0 + 0.5 * 2
    assert together.goodput["2"] > tokens_apart / plain_ms * 1000.0  # ahead without the margin
    assert worker._apart(device, fifteen, together)
    two = fifteen[:2]
    assert not worker._apart(device, two, worker._choose(two, [2]))


def test_a_batch_size_never_timed_plain_runs_one_plain_pass_first() -> None:
    """Plain passes of 32 rows never timed (only speculative ones were): their cost is the fit's,
    which speculative passes alone price wrongly, so the pass runs plain once to measure it; a
    batch size whose plain pass was timed (here by the profile's shapes) is not held back."""
    control = GoodputControl()
    for _ in range(20):
        control.observe_pass(32, 3, 900.0)
        control.observe_pass(4, 1, 44.0)
        control.observe_pass(4, 3, 59.0)
    learned(control, "hybrid", [8])  # drafts that always hold: the rule wants a window
    streams = [StreamRow("hybrid", "chat", 8, 0.5)] * 32
    first = control.choose(streams, [])
    assert first.k == 0 and "not timed in the last" in first.reason, first.reason
    control.observe_pass(32, 1, 300.0)
    again = control.choose(streams, [])
    assert "not timed in the last" not in again.reason
    # A lone row, and a batch size whose plain pass was timed, choose by goodput alone.
    assert "not timed in the last" not in control.choose(streams[:1], []).reason
    assert control.choose(streams[:4], []).k > 0
    # Device rows set the pass's width whatever the streams do: nothing to measure there.
    with_device = control.choose(streams[:15], [4])
    assert "not timed in the last" not in with_device.reason


def test_a_window_timed_once_on_a_slow_pass_is_tried_again() -> None:
    """bench e2e at 4 streams: the first pass of 4 rows x 2 positions took 68.6 ms where such
    passes take 45-48, and no window of 1 was chosen there for the rest of the run. A window's
    shape not timed in FORGET_AFTER passes that is dearer than its neighbours predict is
    forgotten, and the window is chosen (and so timed) again; a shape as cheap as they predict
    is kept."""
    control = GoodputControl()
    for rows, positions, ms in ((4, 1, 45.3), (4, 3, 51.4), (8, 1, 47.5), (8, 5, 130.5)):
        control.observe_pass(rows, positions, ms)  # the verifier's profile at its start
    learned(control, "hybrid", [0, 1])  # half the first tokens accepted
    streams = [StreamRow("hybrid", "chat", 1, 0.5)] * 4  # windows of at most 1
    assert control.choose(streams, []).k == 1
    control.observe_pass(4, 2, 68.6)
    assert control.choose(streams, []).k == 0
    for _ in range(FORGET_AFTER):
        control.observe_pass(4, 1, 40.0)
    assert control.cost.predict(4, 2) == 68.6  # not forgotten before FORGET_AFTER passes
    for _ in range(DOUBT_EVERY):
        control.observe_pass(4, 1, 40.0)
    assert control.cost.predict(4, 2) < 50.0  # between its neighbours (4, 1) and (4, 3)
    assert control.choose(streams, []).k == 1
    # A shape no dearer than its neighbours predict stays, however long it goes untimed.
    assert control.cost.predict(4, 3) == 51.4
    assert control.cost.measured(4, 3)


def test_a_plain_pass_not_timed_lately_is_timed_again_and_weighs_more() -> None:
    """A plain cost sampled once in a slow pass (146 ms where steady plain passes take 90) would
    stand while windows are chosen over it; after PLAIN_REMEASURE_PASSES passes without a plain
    one the pass runs plain again, and that sample moves the stale mean by STALE_SHAPE_WEIGHT,
    not SHAPE_WEIGHT."""
    control = GoodputControl()
    learned(control, "hybrid", [8])
    streams = [StreamRow("hybrid", "chat", 8, 0.5)] * 16
    control.observe_pass(16, 1, 146.0)
    control.observe_pass(16, 3, 150.0)
    assert control.choose(streams, []).k > 0
    for _ in range(PLAIN_REMEASURE_PASSES):
        control.observe_pass(16, 3, 150.0)
    again = control.choose(streams, [])
    assert again.k == 0 and "not timed in the last" in again.reason, again.reason
    control.observe_pass(16, 1, 90.0)
    # Clipped to 146 / SHAPE_CLIP first, as every sample of a seen shape is.
    clipped = 146.0 / SHAPE_CLIP
    assert control.cost.predict(16, 1) == pytest.approx(
        146.0 + STALE_SHAPE_WEIGHT * (clipped - 146.0)
    )
    control.observe_pass(16, 1, 90.0)
    settled = 146.0 + STALE_SHAPE_WEIGHT * (clipped - 146.0)
    fresh = max(90.0, settled / SHAPE_CLIP)
    assert control.cost.predict(16, 1) == pytest.approx(settled + SHAPE_WEIGHT * (fresh - settled))


def test_a_window_that_also_prefilled_the_draft_does_not_price_it_out() -> None:
    """A neural draft's first window on a session prefills it on the prompt: 30 ms a token on
    that window, where its tokens cost 1.5. That window moves the estimate only so far, and the
    windows after it bring it to what a token costs."""
    control = GoodputControl()
    control.observe_draft_ms("draft-l1", 4, 120.0)
    assert control.draft_ms("draft-l1") <= 1.3
    for _ in range(40):
        control.observe_draft_ms("draft-l1", 4, 6.0)
    assert control.draft_ms("draft-l1") == pytest.approx(1.5, rel=0.05)
    assert control.timed_drafts() == {"draft-l1": control.draft_ms("draft-l1")}


@pytest.mark.parametrize(
    ("per_step", "per_row"),
    [
        (1.2, 0.05),  # a feature head: one call a step for every row (ONNX Runtime, this CPU)
        (0.0, 0.2),  # copying: each row its own work
    ],
)
def test_a_drafters_cost_is_learned_per_step_and_per_row(per_step: float, per_row: float) -> None:
    cost = DraftCost()
    for _ in range(60):
        for rows in (1, 3, 4, 16):
            cost.observe(rows, per_step + per_row * rows)
    a, b = cost.terms
    assert a == pytest.approx(per_step, abs=0.02) and b == pytest.approx(per_row, abs=0.005)
    assert cost.predict(32) == pytest.approx(per_step + per_row * 32, rel=0.02)


def test_a_drafter_seen_at_one_batch_size_costs_each_row_the_same() -> None:
    """Samples of one n cannot split a step's cost from a row's: each row is priced at the
    mean (what a drafter timed on lone sessions is taken to cost in a batch)."""
    cost = DraftCost()
    for _ in range(60):
        cost.observe(4, 2.0)
    assert cost.terms[0] == pytest.approx(0.0, abs=0.05)
    assert cost.predict(4) == pytest.approx(2.0, rel=0.05)
    assert cost.predict(8) == pytest.approx(4.0, rel=0.1)


def test_a_head_priced_per_step_speculates_at_a_batch_that_per_row_pricing_kept_plain() -> None:
    """Four streams with a feature head that drafts well: at 1.3 ms a row (what one row alone
    costs) a window of 2 adds ~10 ms of drafting to a 46 ms pass and plain decoding wins; the
    same head timed in passes of 1 to 4 rows (1.2 ms a step + 0.05 a row) speculates."""
    rows = [StreamRow("hybrid+eagle-h1", "chat", 4, 0.5, f"s{i}") for i in range(4)]

    def control_timed(samples: list[tuple[int, float]]) -> GoodputControl:
        control = fitted()
        for _ in range(60):
            for n in (4, 4, 4):
                control.observe_pass(n, 1, 46.0)
            for i in range(4):
                for accepted in (1, 0, 1, 0, 0):
                    control.observe_round("hybrid+eagle-h1", "chat", 2, 2, accepted, f"s{i}")
            for n, ms in samples:
                control.observe_draft_ms("hybrid+eagle-h1", 2, ms * 2, rows=n)
        return control

    per_row = control_timed([(1, 1.3), (4, 4 * 1.3)])
    per_step = control_timed([(n, 1.2 + 0.05 * n) for n in (1, 2, 3, 4)])
    assert per_row.choose(rows, []).k == 0
    chosen = per_step.choose(rows, [])
    assert chosen.k > 0, chosen.reason
    assert per_step.draft_ms("hybrid+eagle-h1", 4) < per_row.draft_ms("hybrid+eagle-h1", 4) / 3


def test_a_plain_pass_that_only_retimes_plain_decoding_does_not_run_on() -> None:
    """A plain choice made because plain passes of its size were not timed lately runs one
    pass, not a `Steps` run of four: the window predicted to pay is chosen on the next. A plain
    choice on its own merits, or where plain was timed lately, may run on."""
    worker = VerifierWorker(WorkerConfig("steps-test"), BrokerAddress("127.0.0.1", 1))
    worker.goodput.observe_pass(4, 1, 46.0)
    for _ in range(PLAIN_REMEASURE_PASSES + 1):
        worker.goodput.observe_pass(4, 3, 59.0)
    ahead = PassChoice(k=0, rows=4, goodput={"0": 85.0, "2": 108.0}, cost_ms=46.0, reason="")
    behind = ahead.model_copy(update={"goodput": {"0": 85.0, "2": 80.0}})
    assert worker.goodput.retimes_plain(ahead)
    assert not worker.goodput.retimes_plain(behind)
    assert not worker.goodput.retimes_plain(ahead.model_copy(update={"k": 2}))
    worker.goodput.observe_pass(4, 1, 46.0)  # the pass that timed it
    assert not worker.goodput.retimes_plain(ahead)


def test_a_streams_own_record_is_of_the_drafter_that_made_it() -> None:
    """A stream's own rounds pull its rate (STREAM_PRIOR_WEIGHT), but only for the drafter that
    drafted them: moved to another drafter, the stream is scored on that drafter's rate until
    it has rounds of its own with it."""
    control = GoodputControl()
    for _ in range(50):
        control.observe_round("eagle", "chat", 2, 2, 2)  # the drafter does well on the task
    fresh = StreamRow("eagle", "chat", 2, 0.5, "s1")
    before = control.expected_tokens(fresh, 2)
    for _ in range(6):
        control.observe_round("lookup", "chat", 2, 2, 0, stream="s1")  # nothing accepted
    assert control.expected_tokens(fresh, 2) == before
    assert control.expected_tokens(StreamRow("lookup", "chat", 2, 0.5, "s1"), 2) < 1.2
    control.observe_round("eagle", "chat", 2, 2, 0, stream="s1")
    assert control.expected_tokens(fresh, 2) < before


def test_a_stream_that_fills_its_windows_is_offered_wider_ones() -> None:
    """Windows of 3 accepted whole, round after round, on a task whose wide windows from other
    prompts hold at half: the positions the stream was never given take the rate of its
    deepest one, pulled towards the task's, so a lone row gets a wider window; a stream whose
    windows of 3 failed at the first token is scored below the task."""
    control = fitted()
    for _ in range(60):  # other prompts: each token of a window of 8 holds at half
        for n in (0, 1, 2, 3, 4, 8):
            control.observe_round("hybrid", "summarize", 8, 8, n)
    filled, failed = (
        StreamRow("hybrid", "summarize", 8, 0.5, "s-filled"),
        StreamRow("hybrid", "summarize", 8, 0.5, "s-failed"),
    )
    before = control.expected_tokens(filled, 8)
    for _ in range(5):
        control.observe_round("hybrid", "summarize", 3, 3, 3, stream="s-filled")
        control.observe_round("hybrid", "summarize", 3, 3, 0, stream="s-failed")
    own = control._stream_accept["s-filled"][1]
    task = control._stats("hybrid", "summarize").rates(8, 0.5)
    carried = own.expected_from(task)
    assert carried[8] - carried[3] > 1.0  # positions 4..8 still add a token and more
    assert control.expected_tokens(filled, 8) > before + 1.5
    assert control.choose([filled], []).k > 3
    assert control.expected_tokens(failed, 8) < before - 1.0
    assert control.choose([failed], []).k < control.choose([filled], []).k


def test_no_stream_in_a_pass_is_slowed_by_the_others_windows() -> None:
    """A window is chosen for a pass of several streams only where every one of them commits
    at least as many tokens a second as it would plainly: three streams that copy well beside
    one that accepts almost nothing decode plainly (the fourth would be slowed, and a batch that
    ends together ends with it); four that copy well speculate; a lone stream's own goodput
    decides for it alone."""
    control = fitted()
    learned(control, "hybrid", [4])  # the task's rate: windows of 8 hold for 4 tokens
    good = [StreamRow("hybrid", "chat", 8, 0.5, f"s-good-{i}") for i in range(4)]
    poor = StreamRow("hybrid", "chat", 8, 0.5, "s-poor")
    for _ in range(12):
        for row in good:
            control.observe_round("hybrid", "chat", 8, 8, 6, stream=row.stream)
    for _ in range(40):
        control.observe_round("hybrid", "chat", 8, 8, 0, stream="s-poor")
    assert control.expected_tokens(poor, 2) < 1.2
    assert control.choose(good, []).k >= 2
    mixed = control.choose([*good[:3], poor], [])
    assert mixed.k == 0
    # By tokens a second over the pass alone, the window would have won.
    assert max(v for key, v in mixed.goodput.items() if key != "0") > mixed.goodput["0"] * 1.2
    # A plain stream (the coordinator chose no drafter for it) is slowed by any window too.
    assert control.choose([*good[:3], StreamRow(None, "chat", 0, 0.5)], []).k == 0
    assert control.choose([good[0]], []).k >= 2
