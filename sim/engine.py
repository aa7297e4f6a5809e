"""The discrete-event core: devices, links, the broker, the coordinator and verifiers.

Time is in milliseconds of simulated fleet time. What the real code decides runs here as the
real code: the coordinator's `AdaptivePolicy` chooses each adaptive session's mode, drafter and
k from the rounds it observes, and each verifier's `GoodputControl` chooses its host streams'
window pass by pass from the pass costs it observes, exactly as in
`coordinator/runtime/sessions.py` and
`verifier/worker.py`. What the real system measures comes from the calibration: what a pass of
B rows and T positions costs (`PassCost` seeded with the profile, the same class the verifier
learns with), acceptance per drafted position by drafter and task, draft costs, and the time a
round spends in the services beyond its links and compute.

The flows, as in docs/protocol.md:
- a distributed (direct) round: the device drafts, the draft crosses its link and the broker to
  the verifier that holds the session's lease, waits for a pass, is persisted there and its
  verdict goes back the same way; the coordinator hears a RoundDone off the round's path and, for
  an adaptive session, decides again (its policy reaches the device with a later verdict);
- a host stream (cloud or plain mode): the verifier runs a round of it in every pass it has room
  in; each result crosses the broker to the coordinator, which persists it and sends the verdict
  over the device's link; every STREAM_DECISION_EVERY rounds the coordinator may move it.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import itertools
import math
import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from broker import messages as m
from coordinator.runtime.decisions import opening_candidate
from coordinator.runtime.policy import STREAM_DECISION_EVERY, AdaptivePolicy, RoundObservation
from coordinator.runtime.round_model import CLOUD_STREAM_ROUNDS
from netem.profiles import PROFILES, LinkShape
from sim.devices import Conditions
from sim.inputs import LOOPBACK, Calibration, LinkSpec, PositionRates, VerifierProfile
from verifier.child import PROFILE_SHAPES
from verifier.goodput import PRIOR_ACCEPT, GoodputControl, StreamRow
from verifier.streams import pass_turn
from verifier.worker import BATCH_WINDOW_MS, HEARTBEAT_S, STEPS_PER_CALL

# A mode's name, as rounds are counted by it (Enum's .value is a descriptor call, every round).
MODE_NAMES = {mode: mode.value for mode in m.Mode}
_LOAD = attrgetter("load")  # a verifier's
_CLOUD = m.Mode.CLOUD
MESSAGE_BYTES = 320  # a draft or a verdict of a few tokens, JSON, with MQTT framing
TIMELINE_LIMIT = 10_000_000  # events one simulation may run, against a runaway model


@contextlib.contextmanager
def without_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off while a simulation runs. A run allocates millions
    of small objects and keeps most (its sessions, their commits), and each full collection
    walked them all: in 10 minutes of 10,000 devices with ~600 sessions open it took 13% of the
    run (186.6 s of CPU with it, 162.0 s without, the same 0.99 GB at most: a run leaves no
    cycles behind to collect). It is back on, as it was, when the run ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Loop:
    """Events in time order; ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0
        self.halted = False  # set by an action to stop run() after it

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        now = self.now  # max(when, now), as max() picks
        heapq.heappush(self._heap, (now if now > when else when, next(self._seq), action, args))

    def after(self, delay_ms: float, action: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay_ms, action, *args)

    def run(self, until: float = math.inf) -> None:
        self.halted = False
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until and not self.halted:
            when, _, action, args = pop(heap)
            self.now = when
            self.events += 1
            if self.events > TIMELINE_LIMIT:
                raise RuntimeError("the simulation ran past its event limit")
            action(*args)
        if not self.halted:
            self.now = max(self.now, until) if until != math.inf else self.now


@dataclass(slots=True)  # read and written on every round
class Server:
    """A FIFO single server (a CPU, a broker's throughput): when work given now would end."""

    free_at: float = 0.0
    busy_ms: float = 0.0

    def serve(self, now: float, ms: float) -> float:
        free_at = self.free_at
        start = free_at if free_at > now else now  # max(now, free_at), as max() picks
        self.free_at = start + ms
        self.busy_ms += ms
        return self.free_at


class Link:
    """One device's link: a netem profile's latency, jitter and rate, with loss and outages."""

    def __init__(self, spec: LinkSpec, rng: random.Random) -> None:
        self.spec = spec
        if spec.profile == LOOPBACK:
            self.up = self.down = LinkShape()
        else:
            self.up, self.down = PROFILES[spec.profile].up, PROFILES[spec.profile].down
        self.rng = rng
        self.extra_ms = 0.0  # each way, beyond the profile (a network emulator's own cost)
        # Its outages, in order: [start, end) in ms, the end after the client reconnected. A
        # query may ask ahead of the simulation's clock (a verdict sent once a CPU is done, an
        # RTT probe's way back), so an outage is kept after such a query has passed it: one
        # whose end was asked about first was forgotten, and every verdict sent into the
        # outage after that went through (bench adaptive's blip: a cloud stream's tokens
        # arrived during the cut, where the agent had them all 2 s later).
        self._periodic = spec.outage_every_s is not None and spec.outage_s > 0
        self._starts: list[float] = []
        self._ends: list[float] = []
        if self._periodic:
            self._draw_outage(0.0)

    def _draw_outage(self, after_ms: float) -> None:
        """The link's next outage of its own, an exponential gap after `after_ms`."""
        assert self.spec.outage_every_s is not None
        start = after_ms + self.rng.expovariate(1.0 / (self.spec.outage_every_s * 1e3))
        self._starts.append(start)
        self._ends.append(start + self.spec.outage_s * 1e3)

    def cut(
        self,
        at_ms: float,
        for_ms: float,
        backoff_s: tuple[float, float] | None = None,
        resume_ms: float = 0.0,
    ) -> None:
        """One outage of `for_ms` from `at_ms` (a blip: the connection drops). The client tries
        again after full-jitter exponential waits (`backoff_s`: its first ceiling and its cap, as
        broker.client.Backoff draws them), so messages flow from its first try after the link
        is back, plus `resume_ms`; the link's own outages, if any, resume after it."""
        tried, attempt = at_ms, 0
        if backoff_s is not None:
            low, high = backoff_s
            while tried < at_ms + for_ms:
                tried += self.rng.uniform(low, max(low, min(high, low * 2.0**attempt))) * 1e3
                attempt += 1
        reconnect = max(0.0, tried - at_ms - for_ms) + resume_ms
        keep = bisect.bisect_left(self._starts, at_ms)
        del self._starts[keep:], self._ends[keep:]
        self._starts.append(at_ms)
        self._ends.append(at_ms + for_ms + reconnect)

    def back_at(self, now: float) -> float:
        """When a message sent at `now` can go: now, or the end of the outage it falls in."""
        starts, ends = self._starts, self._ends
        if not starts:
            return now
        # The link's own outages, one after another: the next is drawn once the last is over.
        while self._periodic and now >= ends[-1]:
            self._draw_outage(ends[-1])
        i = bisect.bisect_right(starts, now) - 1
        return ends[i] if i >= 0 and now < ends[i] else now

    def delay(self, now: float, upstream: bool) -> float:
        """When a message sent now arrives on the other side."""
        now = self.back_at(now)
        shape = self.up if upstream else self.down
        ms = shape.latency_ms + self.extra_ms + self.rng.uniform(-shape.jitter_ms, shape.jitter_ms)
        if shape.rate_kbit_s:
            ms += MESSAGE_BYTES * 8 / shape.rate_kbit_s
        while self.spec.loss and self.rng.random() < self.spec.loss:
            ms += self.spec.retransmit_ms
        return now + max(0.0, ms)


class Broker:
    """Every publish crosses it once: a per-hop latency behind a throughput limit."""

    def __init__(self, hop_ms: float, max_messages_per_s: float | None) -> None:
        self.hop_ms = hop_ms
        self.service_ms = 1e3 / max_messages_per_s if max_messages_per_s else 0.0
        self.server = Server()
        self.messages = 0

    def hop(self, now: float) -> float:
        """When a message handed to the broker at `now` (now or later) leaves it. Without a
        throughput limit it is a pure delay: a message hopped ahead of time must not hold back
        the ones hopped after it for an earlier time."""
        self.messages += 1
        if not self.service_ms:
            return now + self.hop_ms
        return self.server.serve(now, self.service_ms) + self.hop_ms


def _interpolate(points: dict[int, float], x: int) -> float:
    """Linear between the nearest measured points; beyond them, along the last two's slope."""
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x < xs[0]:
        x1, x2 = xs[0], xs[1]
    elif x > xs[-1]:
        x1, x2 = xs[-2], xs[-1]
    else:
        x2 = next(v for v in xs if v > x)
        x1 = max(v for v in xs if v < x)
    slope = (points[x2] - points[x1]) / (x2 - x1)
    return max(1e-3, points[x1] + slope * (x - x1))


class ProfileCost:
    """What a pass of B rows and T positions costs a simulated verifier: its profile's own
    figures, linear between the shapes timed (first along T within each B, then across B)."""

    def __init__(self, profile: VerifierProfile) -> None:
        self.table: dict[int, dict[int, float]] = {}
        for rows, positions, ms in profile.passes:
            self.table.setdefault(rows, {})[positions] = ms
        self.scale_at = profile.scale_at
        self._known: dict[tuple[int, int], float] = {}  # a pure function of the shape

    def predict(self, rows: int, positions: int) -> float:
        known = self._known.get((rows, positions))
        if known is None:
            along = {b: _interpolate(by_t, positions) for b, by_t in self.table.items()}
            known = self._known[rows, positions] = _interpolate(along, rows) * self.scale_at(rows)
        return known


class Acceptance:
    """Draws how far a drafter fills a window and how much of it the target accepts."""

    def __init__(self, calibration: Calibration, rng: random.Random) -> None:
        self.rates = calibration.acceptance
        self.prompts = calibration.prompt_acceptance
        self.rng = rng
        # table() of each (drafter, task, prompt), once
        self._tables: dict[tuple[str, str, str | None], PositionRates] = {}

    def table(self, drafter: str, task: str) -> PositionRates:
        by_task = _of_drafter(self.rates, drafter)
        if by_task is None:
            by_task = next(iter(self.rates.values()))
        return by_task.get(task) or by_task.get("*") or next(iter(by_task.values()))

    def prompt_table(self, drafter: str, task: str, prompt: str | None) -> PositionRates:
        """The drafter's rates on a benchmark prompt where the calibration has them, else on
        its task (`table`)."""
        by_prompt = _of_drafter(self.prompts, drafter) or {}
        table = by_prompt.get(prompt) if prompt is not None else None
        return table if table is not None else self.table(drafter, task)

    def draw(
        self, drafter: str, task: str, window: int, prompt: str | None = None
    ) -> tuple[int, int]:
        """(drafted, accepted) for one round with a window of `window`; `prompt`: the
        benchmark prompt a replayed session answers."""
        if window <= 0:
            return 0, 0  # nothing drafted, nothing drawn
        table = self._tables.get((drafter, task, prompt))
        if table is None:
            table = self._tables[drafter, task, prompt] = self.prompt_table(drafter, task, prompt)
        random, fill, accept = self.rng.random, table.fill, table.accept
        drafted = 0
        while drafted < window and random() < _at(fill, drafted):
            drafted += 1
        accepted = 0
        while accepted < drafted and random() < _at(accept, accepted):
            accepted += 1
        return drafted, accepted


def _of_drafter(
    tables: dict[str, dict[str, PositionRates]], drafter: str
) -> dict[str, PositionRates] | None:
    """A drafter's tables, else those of the drafter it is the hybrid of (`hybrid+eagle-h1`:
    `hybrid`'s)."""
    return tables.get(drafter) or tables.get(drafter.split("+")[0])


def _at(rates: list[float], index: int) -> float:
    return rates[min(index, len(rates) - 1)]


# -- sessions ----------------------------------------------------------------------------------


@dataclass(slots=True)  # read and written on every round
class Device:
    id: str
    device_class: str
    link: Link
    draft_ms_per_token: dict[str, float]
    cpu: Server = field(default_factory=Server)
    throttle_after_ms: float = math.inf
    throttle_factor: float = 1.0
    conditions: Conditions | None = None  # its battery and heat, where its class has them

    def draft_ms(self, drafter: str, tokens: int) -> float:
        per_token = self.draft_ms_per_token.get(drafter)
        if per_token is None:
            per_token = self.draft_ms_per_token.get(drafter.split("+")[-1], 1.0)
        factor = self.throttle_factor if self.cpu.busy_ms > self.throttle_after_ms else 1.0
        conditions = self.conditions
        if conditions is not None and conditions.heat is not None:
            factor *= conditions.heat.factor
        return tokens * per_token * factor

    def telemetry(self, now: float) -> m.Telemetry | None:
        """Its agent's reading of its battery and heat, when a tick has passed since the last
        one read (`sim.devices`)."""
        conditions = self.conditions
        if conditions is None:
            return None
        return conditions.reading(self.id, now, self.cpu.busy_ms)


@dataclass(slots=True)  # read and written on every round
class Session:
    id: str
    device: Device
    task: str
    prompt_tokens: int
    length: int  # tokens the target's answer has (its eos, or the session's max_tokens)
    adaptive: bool
    policy: m.Policy
    opened_at: float
    on_end: Callable[[Session], None]
    generated: int = 0  # committed (where the round was verified)
    delivered: int = 0  # at the device (its verdicts arrived): it ends with the last
    round: int = 0
    ended_at: float | None = None
    verifier: Verifier | None = None
    sent_at: float = 0.0  # the device: when its window in flight went out (or last verdict)
    waits_ms: list[float] = field(default_factory=list)
    commits: list[tuple[float, int]] = field(default_factory=list)  # (verdict arrived, tokens)
    rounds_by_mode: dict[str, int] = field(default_factory=dict)
    in_mode_rounds: int = 0
    shard: int = -1  # the coordinator that owns it, once asked
    prompt: str | None = None  # the benchmark prompt a replayed session answers
    # A replayed session's measured rounds, (drafted, accepted) in order: a greedy session with
    # a fixed window drafts and has accepted the same tokens whatever the load, so its rounds
    # are replayed as they were, not drawn (drawn past the trace's end, or where it is empty).
    trace: Sequence[tuple[int, int]] = ()
    # Its stream's acceptance prior, as the stream's request carries it (the coordinator's
    # estimate for an adaptive cloud stream, StreamSpec.alpha; else the verifier's own).
    stream_prior: float = PRIOR_ACCEPT

    @property
    def finished(self) -> bool:
        return self.generated >= self.length

    def token_gaps_ms(self) -> list[float]:
        """Time between tokens as the device sees them: each verdict's gap since the one
        before, shared by the tokens it brought (the first verdict's wait is not a gap)."""
        gaps: list[float] = []
        for (before, _), (at, tokens) in zip(self.commits, self.commits[1:], strict=False):
            if tokens:
                gaps += [(at - before) / tokens] * tokens
        return gaps

    def replayed(self, window: int) -> tuple[int, int] | None:
        """This round's (drafted, accepted) from its trace, cut to `window`; None past the
        trace's end (or with no window), where the round is drawn."""
        if self.round >= len(self.trace) or window <= 0:
            return None
        drafted, accepted = self.trace[self.round]
        drafted = drafted if drafted < window else window
        return drafted, (accepted if accepted < drafted else drafted)

    def commit(self, accepted: int) -> int:
        kept = min(accepted + 1, self.length - self.generated)
        self.generated += kept
        self.round += 1
        return kept


@dataclass(slots=True)  # read and written on every round
class _Row:
    """One row of a pass: a device's draft or a round of a host stream."""

    session: Session
    window: int
    drafted: int
    accepted: int
    arrived: float
    stream: bool
    # A host-drafted window's share of its drafter's drafting in the pass, ms: what the
    # verifier's draft_together records on the round (a call's time split among its rows).
    draft_ms: float = 0.0


def prefills_ms(profile: VerifierProfile, contexts: Sequence[int]) -> float:
    """What prefilling `contexts` (positions each) in one pass costs: each prompt by itself, one
    after another, as the verifier runs them (`VerifierCore._prefill_scored`: a context it lacks
    by more than a few positions is prefilled alone, its first round scored from it). Measured
    in bench e2e's pass traces on 2026-12-06: the passes that prefilled a wave of 16 prompts
    (782 positions) took 2,712-2,783 ms where plain serving's, one prompt at a time, took
    2,768-2,843; of 32, 5,792-6,067 against 5,549-5,840. They had been priced as rows padded to
    the longest (the earlier runs' such passes cost 1.29-1.34 times the sum), which priced the
    adaptive arm at 16 and 32 sessions 6-8% slow."""
    return sum([profile.prefill_ms(c) for c in contexts])


class Verifier:
    """One verifier: a queue of device-drafted rounds, host streams, one pass at a time."""

    def __init__(self, fleet: Fleet, name: str, profile: VerifierProfile) -> None:
        self.fleet = fleet
        self.name = name
        self.profile = profile
        self.truth = fleet.profile_cost(profile)
        self.speed = 1.0  # its host's slowdown now: every pass and prefill costs this times more
        # Seeded as the real worker seeds it, with the passes its child times at start.
        self.control = GoodputControl()
        for rows, positions in PROFILE_SHAPES:
            self.control.observe_pass(rows, positions, self.truth.predict(rows, positions))
        self.queue: list[_Row] = []
        self.streams: dict[str, Session] = {}
        self.last_pass: dict[str, int] = {}
        self.cached: set[str] = set()
        self.outstanding: set[str] = set()  # distributed sessions due back with a draft
        self.worker_cpu = Server()  # the worker process: decoding, persisting, publishing
        # Its streams and the sessions due back (as the coordinator counts a verifier's load),
        # kept as they change: every session opened picks the least loaded verifier.
        self.load = 0
        self.busy = False
        self.waiting = False
        # Passes the inference process still runs by itself after a choice for every stream
        # (`verifier.child.Steps`, STEPS_PER_CALL a call), until other work arrives, at the
        # window of that choice.
        self.run_on = 0
        self.run_on_choice: m.PassChoice | None = None
        # The streams of a pass whose device windows went in a pass of their own
        # (`GoodputControl.apart`): the next pass is theirs, as the worker runs it right after.
        self.streams_next: list[Session] = []
        self.passes = 0
        self.busy_ms = 0.0
        self.rows_total = 0

    def due(self, session_id: str) -> None:
        """A distributed session's draft is on its way here."""
        if session_id not in self.outstanding:
            self.outstanding.add(session_id)
            self.load += 1
            self.fleet.total_load += 1

    def not_due(self, session_id: str) -> None:
        if session_id in self.outstanding:
            self.outstanding.discard(session_id)
            self.load -= 1
            self.fleet.total_load -= 1

    def submit(self, row: _Row) -> None:
        self.not_due(row.session.id)
        self.queue.append(row)
        self.run_on = 0  # the worker interrupts the child's run: this goes in the next pass
        self.kick()

    def open_stream(self, session: Session) -> None:
        if session.id not in self.streams:
            self.streams[session.id] = session
            self.run_on = 0
            policy = session.policy
            session.stream_prior = (
                self.fleet.policy.alpha(session.device.id, policy.draft_model, session.task)
                if session.adaptive and policy.mode is _CLOUD
                else PRIOR_ACCEPT
            )
            self.load += 1
            self.fleet.total_load += 1
            self.fleet.total_streams += 1
        self.last_pass.setdefault(session.id, -1)
        self.kick()

    def stop_stream(self, session: Session) -> None:
        if self.streams.pop(session.id, None) is not None:
            self.load -= 1
            self.fleet.total_load -= 1
            self.fleet.total_streams -= 1

    def kick(self) -> None:
        if self.busy or self.waiting or not (self.queue or self.streams):
            return
        if self.queue and not self.streams and len(self.queue) < self.profile.max_batch:
            others = self.outstanding - {row.session.id for row in self.queue}
            if others:  # another session is due back: the batch window
                self.waiting = True
                self.fleet.loop.after(BATCH_WINDOW_MS, self._window_over)
                return
        self._start_pass()

    def _window_over(self) -> None:
        self.waiting = False
        if not self.busy and (self.queue or self.streams):
            self._start_pass()

    def _start_pass(self) -> None:
        # The streams' pass right after their device rows' own (VerifierWorker._apart), those
        # still streaming here; else the queue's device rounds and the streams' turn.
        turn = [s for s in self.streams_next if s.id in self.streams]
        self.streams_next = []
        batch: list[_Row] = []
        if not turn:
            batch, turn = self._next_rows()
        caps = [self._cap(s) for s in turn]
        choice: m.PassChoice | None = None
        whole = not batch and len(turn) == len(self.streams)  # every stream, no device row
        if turn and self.run_on > 0 and whole:
            self.run_on -= 1  # the child runs the rounds on by itself, at the call's window
            choice = self.run_on_choice
        elif turn:
            self.run_on = 0
            rows = [
                StreamRow(s.policy.draft_model, s.task, cap, s.stream_prior, s.id)
                for s, cap in zip(turn, caps, strict=True)
                if s.adaptive
            ]
            widths = [row.drafted for row in batch]
            fixed = widths + [cap for s, cap in zip(turn, caps, strict=True) if not s.adaptive]
            choice = self.control.choose(rows, fixed)
            if batch and len(rows) == len(turn) and self.control.apart(rows, widths, choice):
                # The device windows first, in a pass of their own (VerifierWorker._apart).
                self.streams_next = turn
                turn, caps, choice = [], [], None
            elif whole and not self.control.retimes_plain(choice):
                # A choice for every stream: a `Steps` call (VerifierWorker._steps), as many
                # passes as its rows have rounds left, STEPS_PER_CALL at most.
                left = max(s.length - s.generated for s in turn)
                self.run_on = min(STEPS_PER_CALL, left) - 1
                self.run_on_choice = choice
        self._run_pass(batch, turn, caps, choice)

    def _next_rows(self) -> tuple[list[_Row], list[Session]]:
        """A new pass's device rounds (the queue's first, max_batch at most) and the streams
        that take their turn beside them (`pass_turn`)."""
        batch, self.queue = (
            self.queue[: self.profile.max_batch],
            self.queue[self.profile.max_batch :],
        )
        self.passes += 1
        if batch:
            busy = {row.session.id for row in batch}
            ready = [s for s in self.streams.values() if s.id not in busy]
        else:
            ready = list(self.streams.values())
        turn = pass_turn(
            ready,
            self.profile.max_batch - len(batch),
            self.passes,
            lambda s: self.last_pass[s.id],
            lambda s: s.round == 0,
            beside_device_rows=bool(batch),
        )
        for session in turn:
            self.last_pass[session.id] = self.passes
        return batch, turn

    def _run_pass(
        self,
        batch: list[_Row],
        turn: list[Session],
        caps: list[int],
        choice: m.PassChoice | None,
    ) -> None:
        """A pass of the device rows of `batch` and a round of each stream of `turn` (its cap
        in `caps`), at the window `choice` picked (none: the child runs plain passes on)."""
        loop, rng = self.fleet.loop, self.fleet.rng
        k = 0 if choice is None else choice.k
        for session, cap in zip(turn, caps, strict=True):
            window = (cap if cap < k else k) if session.adaptive else cap  # min(k, cap)
            drafter = session.policy.draft_model
            replayed = session.replayed(window) if session.trace else None
            drafted, accepted = (
                self.fleet.acceptance.draw(drafter, session.task, window, session.prompt)
                if replayed is None
                else replayed
            )
            batch.append(_Row(session, window, drafted, accepted, loop.now, stream=True))
        positions = max([row.drafted for row in batch]) + 1
        prefill = self._prefill_ms(batch) * self.speed
        verify_ms = self.truth.predict(len(batch), positions) * self.speed
        verify_ms *= max(0.2, rng.gauss(1.0, self.profile.pass_cv))
        drafting = self.speed * self._drafting(batch)
        self.busy = True
        self.busy_ms += verify_ms + prefill + drafting
        self.rows_total += len(batch)
        loop.after(
            verify_ms + prefill + drafting, self._end_pass, batch, positions, verify_ms, prefill
        )

    def _drafting(self, batch: list[_Row]) -> float:
        """The pass's host drafting, ms: each drafter's rows drafted together, a + b n per
        window token of its widest window (what the verifier's goodput control then learns)."""
        by_drafter: dict[str, list[_Row]] = {}
        for row in batch:
            if row.stream and row.window:
                by_drafter.setdefault(row.session.policy.draft_model, []).append(row)
        total = 0.0
        for drafter, rows in by_drafter.items():
            a, b = self.fleet.host_draft_terms(drafter)
            widest = max(row.window for row in rows)
            ms = (a + b * len(rows)) * widest
            self.control.observe_draft_ms(drafter, widest, ms * self.speed, rows=len(rows))
            share = ms * self.speed / len(rows)  # each row's, as draft_together splits a call
            for row in rows:
                row.draft_ms = share
            total += ms
        return total

    def _cap(self, session: Session) -> int:
        policy = session.policy
        if policy.mode is not _CLOUD:
            return 0
        window = max(policy.k, self.fleet.policy.k_max) if session.adaptive else policy.k
        return max(0, min(window, session.length - session.generated - 1, m.MAX_CLOUD_K))

    def _prefill_ms(self, batch: list[_Row]) -> float:
        """The prefills of the pass's sessions new to this verifier, each its own context's, as
        the pass runs them (`prefills_ms`)."""
        contexts = []
        for row in batch:
            session = row.session
            if session.id not in self.cached:
                self.cached.add(session.id)
                contexts.append(session.prompt_tokens + session.generated)
        return prefills_ms(self.profile, contexts)

    def _end_pass(
        self, batch: list[_Row], positions: int, verify_ms: float, prefill: float
    ) -> None:
        self.busy = False
        if not prefill:
            self.control.observe_pass(len(batch), positions, verify_ms)
        for row in batch:
            if row.stream:
                if row.window:
                    drafter = row.session.policy.draft_model
                    self.control.observe_round(
                        drafter,
                        row.session.task,
                        row.window,
                        row.drafted,
                        row.accepted,
                        stream=row.session.id,
                    )
                self.fleet.coordinator.stream_result(self, row, verify_ms, len(batch))
            else:
                self.fleet.direct_round_done(self, row, verify_ms, len(batch))
        self.kick()


class Coordinator:
    """The control plane: opens sessions, persists streamed rounds, runs the adaptive policy."""

    def __init__(self, fleet: Fleet, shards: int = 1) -> None:
        self.fleet = fleet
        self.policy = fleet.policy
        self.cpus = [Server() for _ in range(shards)]
        self._costs_due = 0.0  # fleet time of the next heartbeats' costs

    def cpu(self, session: Session) -> Server:
        """The CPU of the coordinator that owns the session."""
        if session.shard < 0:
            session.shard = zlib.crc32(session.id.encode()) % len(self.cpus)
        return self.cpus[session.shard]

    def _load(self, session: Session | None = None) -> float:
        """The verifiers' mean load, less the session's own stream (AdaptiveBook's
        _load_beside)."""
        fleet = self.fleet
        verifiers = fleet.verifiers
        own = False
        if session is not None and session.verifier is not None:
            own = session.id in session.verifier.streams
        return max(0.0, fleet.mean_load() - 1.0 / len(verifiers)) if own else fleet.mean_load()

    def _report_costs(self) -> None:
        """What the verifiers' heartbeats report of their costs (VerifierPool.reported_costs),
        told to the policy as the coordinator tells it before it decides. A heartbeat comes
        every HEARTBEAT_S, so the costs the policy sees change once a heartbeat, not after
        every pass (which also spared the simulation averaging 96 fits at every decision)."""
        now = self.fleet.loop.now
        if now < self._costs_due:
            return  # the policy holds the last heartbeats' costs
        self._costs_due = now + HEARTBEAT_S * 1e3
        fits = [v.control.cost.coefficients for v in self.fleet.verifiers]
        a, b, c = (sum(fit[i] for fit in fits) / len(fits) for i in range(3))
        self.policy.observe_verifiers((a, b, c), self.fleet.calibration.host_draft_ms_per_token)

    def _beside(self, session: Session) -> float:
        """The host streams beside the session's own, on the verifiers' mean (as the
        coordinator's AdaptiveBook counts them)."""
        fleet = self.fleet
        own = session.verifier is not None and session.id in session.verifier.streams
        return (fleet.total_streams - own) / len(fleet.verifiers)

    def _host_drafts(self) -> tuple[str, ...]:
        return tuple(self.fleet.calibration.host_draft_ms_per_token) or ("hybrid",)

    def telemetry(self, device: Device) -> None:
        """The device's latest telemetry to the policy, when a tick has passed since the last
        (before the policy decides for it, `sim.devices`)."""
        reading = device.telemetry(self.fleet.loop.now)
        if reading is not None:
            self.policy.observe_telemetry(device.id, reading)

    def open(self, session: Session) -> None:
        done = self.cpu(session).serve(self.fleet.loop.now, self.fleet.calibration.open_ms)
        self.fleet.loop.at(done, self._opened, session)

    def _opened(self, session: Session) -> None:
        fleet = self.fleet
        session.verifier = min(fleet.verifiers, key=_LOAD)
        if session.adaptive:
            self._report_costs()
            self.telemetry(session.device)
            decision = self.policy.decide(
                session.id,
                session.device.id,
                session.task,
                session.policy.draft_model,
                self._load(),
                host_drafts=self._host_drafts(),
                plain=True,
                beside=self._beside(session),
                opening=True,
            )
            best = opening_candidate(decision)
            if best is not None:
                session.policy = m.Policy(mode=best.mode, draft_model=best.draft_model, k=best.k)
        if session.policy.mode in m.HOST_MODES:
            # The session state goes down saying the stream runs (its agent awaits it), and the
            # coordinator hands the stream to the verifier now (`SessionBook.on_session_open`).
            session.sent_at = fleet.loop.now
            fleet.start_stream(session)
            return
        # The session state goes down; the device drafts its first window (an adaptive
        # session's first is empty: it has no drafter yet).
        fleet.send_down(session, fleet.device_drafts, session, session.adaptive)

    def stream_result(self, verifier: Verifier, row: _Row, verify_ms: float, rows: int) -> None:
        fleet = self.fleet
        session = row.session
        arrive = fleet.broker.hop(fleet.loop.now)
        done = self.cpu(session).serve(arrive, fleet.calibration.coordinator_round_ms)
        if session.ended_at is not None or session.policy.mode not in m.HOST_MODES:
            return  # closed, or moved back to its device: the result is dropped
        kept = session.commit(row.accepted)
        mode = session.policy.mode if row.window else m.Mode.PLAIN
        name = MODE_NAMES[mode]
        session.rounds_by_mode[name] = session.rounds_by_mode.get(name, 0) + 1
        finished = session.generated >= session.length
        if finished or session.round % CLOUD_STREAM_ROUNDS == 0:
            verifier.stop_stream(session)
            if finished:  # its own rounds no longer count (a stream reopened keeps them)
                verifier.control.forget_stream(session.id)
        if session.adaptive:
            self._observe(session, row, verify_ms, mode, prefill=session.round == 1)
            if not finished and session.round % STREAM_DECISION_EVERY == 0:
                self._decide(session)
        fleet.loop.at(fleet.down_at(session, done), fleet.verdict_arrived, session, True, kept)
        next_stream = not finished and session.round % CLOUD_STREAM_ROUNDS == 0
        if next_stream and session.policy.mode in m.HOST_MODES:
            # A stream that ran out of rounds: the coordinator opens the next itself, from
            # what it persisted (RoundPipeline._host_stream's loop), on the verifier that holds
            # the session's cache (VerifierPool.pick); no word to the device.
            fleet.loop.at(fleet.broker.hop(done), verifier.open_stream, session)

    def round_done(self, session: Session, row: _Row, verify_ms: float) -> None:
        """A direct round's report, off its path: the policy learns, and may move it."""
        done = self.cpu(session).serve(
            self.fleet.loop.now, self.fleet.calibration.coordinator_round_ms
        )
        self.fleet.loop.at(done, self._after_round_done, session, row, verify_ms)

    def _after_round_done(self, session: Session, row: _Row, verify_ms: float) -> None:
        if not session.adaptive or session.ended_at is not None:
            return
        self._observe(session, row, verify_ms, m.Mode.DISTRIBUTED, prefill=session.round == 1)
        if not session.finished:
            self._decide(session)

    def _observe(
        self, session: Session, row: _Row, verify_ms: float, mode: m.Mode, prefill: bool
    ) -> None:
        host = mode in m.HOST_MODES
        drafter = session.policy.draft_model
        self.policy.observe(
            RoundObservation(
                session_id=session.id,
                device_id=session.device.id,
                draft_model=drafter,
                task_type=session.task,
                k=row.drafted,
                n_accepted=row.accepted,
                t_draft_ms=(
                    row.draft_ms if host else session.device.draft_ms(drafter, row.drafted)
                ),
                t_uplink_ms=None if host else self.fleet.link_ms(session),
                t_queue_ms=0.0 if host else max(0.0, self.fleet.loop.now - row.arrived - verify_ms),
                t_verify_ms=verify_ms,
                verifier_load=self._load(session),
                mode=mode,
                window=row.window,
                prefill=prefill,
                overhead_ms=None if host else self.fleet.overhead_ms(session),
            )
        )

    def _decide(self, session: Session) -> None:
        self._report_costs()
        self.telemetry(session.device)
        decision = self.policy.decide(
            session.id,
            session.device.id,
            session.task,
            session.policy.draft_model,
            self._load(session),
            current_mode=session.policy.mode,
            host_drafts=self._host_drafts(),
            plain=True,
            beside=self._beside(session),
            new_stream=session.verifier is None or session.id not in session.verifier.streams,
        )
        current = session.policy
        before, after = current.mode, decision.mode
        if (after, decision.draft_model, decision.k, decision.min_confidence) != (
            before,
            current.draft_model,
            current.k,
            current.min_confidence,
        ):  # a Policy is validated as it is built: only a changed one is
            session.policy = decision.policy
        verifier = session.verifier
        assert verifier is not None
        if before in m.HOST_MODES and after not in m.HOST_MODES:
            verifier.stop_stream(session)  # the next verdict tells the device to draft
        elif before not in m.HOST_MODES and after in m.HOST_MODES:
            verifier.not_due(session.id)
            hop = self.fleet.broker.hop(self.fleet.loop.now)
            self.fleet.loop.at(hop, verifier.open_stream, session)


class Fleet:
    """Everything one simulation holds, and the legs between them."""

    def __init__(
        self,
        calibration: Calibration,
        verifier_kinds: list[str],
        seed: int = 0,
        broker_hop_ms: float | None = None,
        broker_max_messages_per_s: float | None = None,
        host_cpu: Server | None = None,
        coordinators: int = 1,
    ) -> None:
        """`host_cpu`: one CPU that the devices, the coordinator, the broker's clients and the
        verifiers' workers all share, as on the one host the benchmarks run on (their target
        passes run on CPUs of their own); None, each has its own, as in the field."""
        self.calibration = calibration
        self.host_cpu = host_cpu
        self.total_load = 0  # the sum of the verifiers' loads
        self.total_streams = 0  # the host streams the verifiers run
        self.rng = random.Random(seed)
        self.loop = Loop()
        self.policy = AdaptivePolicy()
        self.acceptance = Acceptance(calibration, self.rng)
        # One cost table per verifier kind: a pure function of its profile, shared by its
        # verifiers rather than interpolated again by each.
        self._profile_costs: dict[int, tuple[VerifierProfile, ProfileCost]] = {}
        hop = calibration.broker_hop_ms if broker_hop_ms is None else broker_hop_ms
        self.broker = Broker(hop, broker_max_messages_per_s)
        self.verifiers = [
            Verifier(self, f"verifier-{i}", calibration.verifiers[kind])
            for i, kind in enumerate(verifier_kinds)
        ]
        self.coordinator = Coordinator(self, coordinators)
        if host_cpu is not None:
            self.coordinator.cpus = [host_cpu]
            for verifier in self.verifiers:
                verifier.worker_cpu = host_cpu
        self._service = sorted(calibration.round_service_ms)
        self._round_cpu_ms = calibration.round_cpu_ms

    def profile_cost(self, profile: VerifierProfile) -> ProfileCost:
        """The pass cost of a verifier of this profile, shared by the verifiers of its kind."""
        kept = self._profile_costs.get(id(profile))
        if kept is None:
            kept = self._profile_costs[id(profile)] = (profile, ProfileCost(profile))
        return kept[1]

    def mean_load(self) -> float:
        """The verifiers' mean load, as the coordinator counts it (verifier_load): the sessions
        due back with a draft and the streams, kept as they change (every decision asks)."""
        return self.total_load / len(self.verifiers)

    # -- costs ---------------------------------------------------------------------------------

    def host_draft_terms(self, drafter: str) -> tuple[float, float]:
        """A pass's drafting per window token, a + b n for n rows (per row where unfitted)."""
        terms = self.calibration.host_draft_terms.get(drafter)
        if terms is not None:
            return terms
        return 0.0, self.calibration.host_draft_ms_per_token.get(drafter, 0.2)

    def link_ms(self, session: Session) -> float:
        link = session.device.link
        return link.up.latency_ms + self.broker.hop_ms

    def overhead_ms(self, session: Session) -> float:
        link = session.device.link
        return link.up.latency_ms + link.down.latency_ms + self.service_ms(0.5)

    def service_ms(self, quantile: float | None = None) -> float:
        """A direct round's service time beyond compute and links: drawn from the measured."""
        q = self.rng.random() if quantile is None else quantile
        return self._service[min(len(self._service) - 1, int(q * len(self._service)))]

    # -- legs ------------------------------------------------------------------------------------

    def send_down(self, session: Session, then: Callable[..., None], *args: Any) -> None:
        """Coordinator or verifier -> broker -> the device's link -> the device."""
        arrive = session.device.link.delay(self.broker.hop(self.loop.now), upstream=False)
        self.loop.at(arrive, then, *args)

    def down_at(self, session: Session, sent: float) -> float:
        """When a message the control plane sends at `sent` (now or later) reaches the device:
        its legs computed at once, rather than as an event per leg."""
        return session.device.link.delay(self.broker.hop(sent), upstream=False)

    def send_up(self, session: Session, then: Callable[..., None], *args: Any) -> None:
        arrive = self.broker.hop(session.device.link.delay(self.loop.now, upstream=True))
        self.loop.at(arrive, then, *args)

    def device_drafts(self, session: Session, empty: bool = False) -> None:
        """The device's turn: draft a window and send it to the session's verifier."""
        if session.ended_at is not None or session.finished:
            return  # ended, or its answer is committed and its last verdicts are on their way
        if session.policy.mode in m.HOST_MODES:
            session.sent_at = self.loop.now  # the stream comes by itself
            return
        drafter = session.policy.draft_model
        if session.device.conditions is not None:  # its heat as of now: a throttle slows this
            session.device.conditions.advance(self.loop.now, session.device.cpu.busy_ms)
        window = 0 if empty else min(session.policy.k, session.length - session.generated - 1)
        replayed = session.replayed(window) if session.trace else None
        drafted, accepted = (
            self.acceptance.draw(drafter, session.task, max(0, window), session.prompt)
            if replayed is None
            else replayed
        )
        work = self.calibration.agent_turn_ms + session.device.draft_ms(drafter, drafted)
        sent = session.device.cpu.serve(self.loop.now, work)
        verifier = session.verifier
        assert verifier is not None
        verifier.due(session.id)
        self.loop.at(
            sent, self._draft_sent, session, _Row(session, window, drafted, accepted, 0.0, False)
        )

    def _draft_sent(self, session: Session, row: _Row) -> None:
        session.sent_at = self.loop.now
        self.send_up(session, self._draft_arrived, row)

    def _draft_arrived(self, row: _Row) -> None:
        row.arrived = self.loop.now
        verifier = row.session.verifier
        assert verifier is not None
        verifier.submit(row)

    def direct_round_done(self, verifier: Verifier, row: _Row, verify_ms: float, rows: int) -> None:
        session = row.session
        kept = session.commit(row.accepted)
        key = MODE_NAMES[m.Mode.DISTRIBUTED]
        session.rounds_by_mode[key] = session.rounds_by_mode.get(key, 0) + 1
        service = self.service_ms()
        held = service if self._round_cpu_ms is None else min(service, self._round_cpu_ms)
        persisted = verifier.worker_cpu.serve(self.loop.now, held) + service - held
        self.loop.at(self.down_at(session, persisted), self.verdict_arrived, session, False, kept)
        self.loop.at(persisted, self.coordinator.round_done, session, row, verify_ms)

    def verdict_arrived(self, session: Session, streamed: bool, kept: int) -> None:
        now = self.loop.now
        session.waits_ms.append(now - session.sent_at)
        session.commits.append((now, kept))
        session.delivered += kept
        # Finished once its last verdict is in, not the first to arrive after the last commit:
        # a stream's verdicts sent into a cut link all arrive when it is back, and the session
        # ended with the first of them, its other verdicts (and their waits) never heard.
        if session.delivered >= session.length:
            if session.ended_at is None:
                session.ended_at = now + self.calibration.close_ms
                if session.verifier is not None:
                    session.verifier.not_due(session.id)
                    session.verifier.stop_stream(session)
                self.loop.at(session.ended_at, session.on_end, session)
            return
        if session.policy.mode in m.HOST_MODES:
            session.sent_at = now
            return
        if streamed and session.verifier is not None and session.id in session.verifier.streams:
            session.sent_at = now
            return
        self.device_drafts(session)

    def start_stream(self, session: Session) -> None:
        """The coordinator opens the session's stream, at its open, on the verifier the open
        picked (the least loaded then, as `VerifierPool.stream` picks it as the stream starts)."""
        verifier = session.verifier
        assert verifier is not None  # picked by `Coordinator._opened`
        done = self.coordinator.cpu(session).serve(
            self.loop.now, self.calibration.coordinator_round_ms
        )
        self.loop.at(self.broker.hop(done), verifier.open_stream, session)

    def open_session(self, session: Session) -> None:
        """The device asks; the coordinator opens the session and starts its first round."""
        self.send_up(session, self.coordinator.open, session)
