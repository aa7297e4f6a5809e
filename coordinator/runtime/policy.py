"""The adaptive policy: per round, the draft model and window k that maximise committed tokens/s.

For a draft d with acceptance rate a (the chance that the target accepts each drafted token) and
window k, one round commits E(a, k) = (1 - a^(k+1)) / (1 - a) tokens in expectation, and takes
T(k) = k * t_draft(d) + RTT + queue + t_verify(k, load). The policy picks the (d, k) with the
highest E / T (DESIGN.md, "Adaptive policy"; the expectation is Leviathan et al. 2023, eq. 1).
That assumes the draft fills its window. A copying drafter proposes only what it has evidence
for: often fewer than k tokens, sometimes none. So k is a cap, and with S(i) the measured chance
that the drafter proposes an i-th token when the window allows it, E = 1 + sum_i S(1..i) a^i and
the costs count n(k) = sum_i S(1..i) drafted tokens; with S = 1 this is E(a, k) above.

Every input is measured: a is an exponentially weighted count of accepted over tried tokens per
(device, draft, task type); t_draft per (device, draft); RTT per device, from telemetry and from
the uplink leg of rounds; queue time over the fleet; and t_verify(k, load) is a ridge regression
on [1, k, load, k * load, waits] over recent rounds (waits: the round waited on a device rather
than being streamed; rounds whose pass also prefilled are left out), pulled toward a prior so it
is defined from the first round. The k * load term is what makes k shrink under load: a verifier
batching many sessions pays each drafted token once per sequence in the batch.

The mode is chosen too. In distributed mode the device drafts, and every round pays the RTT. In
cloud mode the verifier host drafts with its own copy of the draft and the coordinator streams
the rounds to the device, round after round, without waiting for it: the RTT is paid once per
request (CLOUD_STREAM_ROUNDS rounds at most), while the host's draft time, which grows with the
number of sessions it drafts for, joins each round; its verifier chooses each pass's window,
so it is worth at least plain decoding (host_worth), and plain mode (no drafter) is offered only
where the host cannot draft. The mode changes with hysteresis: the other mode must promise
MODE_SWITCH_MARGIN times the tokens/s, and never within MODE_DWELL_ROUNDS rounds of the last
change. Local mode is the device's own while offline; the coordinator never chooses it.

A device's window also holds up the host streams beside it on its verifier: what they lose,
L (batch_cost), comes off its E, and it is rated on (E - L) / T. Alone on its verifier a session
is rated as before; beside 16 streams on a CPU verifier, a window of 4 costs them ~7 tokens.

The module is pure: no clock, no I/O; callers pass in what they measured.

Its parts: task_types (the task a session is rated under), round_model (E, T and n(k)),
device_conditions (a hot or low device spared), declines (a lone stream's drafter run plainly),
decisions (candidates, the mode chosen), and here the AdaptivePolicy that learns and decides."""

from __future__ import annotations

import math
from collections.abc import Sequence

from broker import messages as m
from coordinator.runtime.decisions import (
    MODE_DWELL_ROUNDS,
    Candidate,
    Decision,
    choose_draft,
    choose_mode,
    host_worth,
    spare_the_device,
)
from coordinator.runtime.declines import Declines
from coordinator.runtime.device_conditions import DeviceCondition
from coordinator.runtime.draft_wants import DraftWants, over_memory_note
from coordinator.runtime.exploration import HostExploration, host_offer
from coordinator.runtime.observations import RoundObservation as RoundObservation
from coordinator.runtime.round_model import (
    CLOUD_STREAM_ROUNDS,
    K_MAX,
    AcceptanceRate,
    Ewma,
    ProposalLength,
    VerifyCost,
    best_window,
)

BUILTIN_DRAFTS = ("lookup", "ngram", "hybrid")  # inference.drafters.BUILTIN_DRAFTERS
SWITCH_MARGIN = 1.1  # another draft must promise 10% more tokens/s before we switch to it
REFUSED_AFTER_ROUNDS = 3  # rounds a device may keep its old draft after we asked for another

# Rounds of a host stream between two decisions on whether it should leave the host: its window
# is the verifier's choice pass by pass, and a decision costs ~0.4 ms of the coordinator.
STREAM_DECISION_EVERY = 8

HOST = "@host"  # the verifier host, where cloud rounds are drafted, in the draft-cost table
TIME_DECAY = 0.8

PRIOR_DRAFT_MS_PER_TOKEN = {"lookup": 0.05, "ngram": 0.1, "hybrid": 0.2}
PRIOR_NEURAL_DRAFT_MS_PER_TOKEN = 8.0
# On a verifier host, until its status reports the drafter: a small draft's token or a head's
# step on a server CPU (bench models: 1-2.5 ms), not a phone's 8; priced at a phone's, the
# host's neural drafters were never tried in cloud mode.
PRIOR_HOST_DRAFT_MS_PER_TOKEN = 2.5
PRIOR_RTT_MS = 20.0
PRIOR_QUEUE_MS = 1.0

# Below this draft confidence (the draft's own top probability) the agent stops the window.
MIN_CONFIDENCE = 0.3


class AdaptivePolicy:
    """Learns from every round of every session, and decides the next round of one."""

    def __init__(self, k_max: int = K_MAX, min_confidence: float | None = MIN_CONFIDENCE) -> None:
        self.k_max = k_max
        self.min_confidence = min_confidence
        self._alpha: dict[tuple[str, str, str], AcceptanceRate] = {}
        # The same rates by device, (draft, task) -> rate, for a draft or task it has not run
        # (scanning every device's cost 0.1 ms a decision in a simulated 10,000 devices).
        self._device_alpha: dict[str, dict[tuple[str, str], AcceptanceRate]] = {}
        self._fill: dict[tuple[str, str], ProposalLength] = {}  # (device, draft)
        self._draft_ms: dict[tuple[str, str], Ewma] = {}
        self.host_draft_ms: dict[str, float] = {}  # what the verifiers report (observe_verifiers)
        self._rtt_ms: dict[str, Ewma] = {}
        self._queue_ms = Ewma(PRIOR_QUEUE_MS)
        self._overhead_ms: dict[str, Ewma] = {}  # device -> a distributed round's turn
        self.verify_cost = VerifyCost()  # with its `waits` term, for both modes
        self._device_drafts: dict[str, tuple[str, ...]] = {}
        self._used_drafts: dict[str, set[str]] = {}
        self._refused: dict[str, set[str]] = {}  # device -> drafts it did not switch to
        self._asked: dict[str, tuple[str, int]] = {}  # session -> (draft asked, rounds since)
        self._in_mode: dict[str, tuple[m.Mode, int]] = {}  # session -> (mode, decisions in it)
        self._condition: dict[str, DeviceCondition] = {}  # device -> heat and power
        # device -> (its drafts that do not fit its free memory, the MB free), from telemetry
        self._over_memory: dict[str, tuple[tuple[str, ...], float | None]] = {}
        # device -> draft -> why its fetch failed (drafts on demand), while it backs off
        self._fetch_failed: dict[str, dict[str, str]] = {}
        self.wants = DraftWants()  # drafters devices lack that the fleet can deliver
        self.exploration = HostExploration()  # host drafters no cloud round has tried yet
        self.declines = Declines()  # lone streams' drafters their verifier runs plainly
        # Never updated: the fill of a drafter not seen on a device, the prior (one that fills
        # its window), its curve kept for every decision that rates such a drafter.
        self._unseen_fill = ProposalLength()

    # --- what we learn --------------------------------------------------------------------

    def set_device_drafts(self, device_id: str, drafts: Sequence[str]) -> None:
        """The drafts a device reports installed (its status message)."""
        self._device_drafts[device_id] = tuple(drafts)
        self._refused.pop(device_id, None)
        self.wants.installed(device_id, drafts)

    def observe_telemetry(self, device_id: str, telemetry: m.Telemetry) -> None:
        """Heat, power and memory from the device's telemetry (its RTT comes through
        observe_rtt)."""
        if telemetry.memory_available_mb is not None:
            self.wants.free_mb[device_id] = telemetry.memory_available_mb
        if telemetry.drafts_over_memory:
            self._over_memory[device_id] = (
                telemetry.drafts_over_memory,
                telemetry.memory_available_mb,
            )
        else:
            self._over_memory.pop(device_id, None)
        condition = self._condition.get(device_id)
        if condition is None:
            if (
                telemetry.thermal_c is None
                and telemetry.battery_percent is None
                and not telemetry.power_saver
            ):
                return  # nothing to judge: keep no state for it
            condition = self._condition[device_id] = DeviceCondition()
        condition.update(telemetry)

    def set_fetch_failure(self, device_id: str, draft: str, reason: str | None) -> None:
        """A draft fetched for the device failed (`reason`), or its backoff ended (None)."""
        failed = self._fetch_failed.setdefault(device_id, {})
        if reason is None:
            failed.pop(draft, None)
        else:
            failed[draft] = reason
            self.wants.failed(device_id, draft)

    def memory_note(self, device_id: str) -> str | None:
        """Which of the device's drafts its free memory leaves out, or None."""
        return over_memory_note(*self._over_memory.get(device_id, ((), None)))

    def device_limit(self, device_id: str) -> str | None:
        """Why the device should not draft now (too hot, battery low, power saver), or None."""
        condition = self._condition.get(device_id)
        return None if condition is None else condition.limit

    def observe_verifiers(
        self, pass_cost: tuple[float, float, float] | None, draft_ms: dict[str, float]
    ) -> None:
        """The live verifiers' own costs (VerifierStatus.pass_cost and draft_ms, averaged): the
        verify cost and the host's drafting cost are theirs where they report them."""
        self.verify_cost.set_reported(pass_cost)
        self.host_draft_ms = draft_ms

    def observe_rtt(self, device_id: str, rtt_ms: float) -> None:
        """An RTT the device measured to the coordinator (telemetry)."""
        self._rtt(device_id).update(rtt_ms, TIME_DECAY)

    def observe(self, round_: RoundObservation) -> None:
        if round_.mode is not m.Mode.PLAIN:  # a plain round drafted nothing, by choice
            # The same draft accepts alike wherever it runs: a is shared by both modes.
            key = (round_.device_id, round_.draft_model, round_.task_type)
            rate = self._alpha.get(key)
            if rate is None:
                rate = self._alpha[key] = AcceptanceRate()
                by_device = self._device_alpha.setdefault(round_.device_id, {})
                by_device[(round_.draft_model, round_.task_type)] = rate
            rate.update(round_.k, round_.n_accepted)
            # How far the drafter fills a window, an empty proposal included (lookup without a
            # match).
            fill = self._fill.get((round_.device_id, round_.draft_model))
            if fill is None:
                fill = self._fill[(round_.device_id, round_.draft_model)] = ProposalLength()
            fill.update(round_.window, round_.k)
        cloud = round_.mode in m.HOST_MODES
        if round_.mode is not m.Mode.PLAIN:
            per_token = round_.t_draft_ms / round_.k if round_.k > 0 and not cloud else None
            self.wants.observe(round_, per_token)
        if round_.k > 0:
            self._draft_cost(HOST if cloud else round_.device_id, round_.draft_model).update(
                round_.t_draft_ms / round_.k, TIME_DECAY
            )
            if cloud:
                self.exploration.observe(round_.draft_model)
        if round_.overhead_ms is not None:
            overhead = self._overhead_ms.get(round_.device_id)
            if overhead is None:
                self._overhead_ms[round_.device_id] = Ewma(round_.overhead_ms)
            else:
                overhead.update(round_.overhead_ms, TIME_DECAY)
        if round_.t_uplink_ms is not None:
            # One leg measured; the way back crosses the same link.
            self._rtt(round_.device_id).update(2.0 * round_.t_uplink_ms, TIME_DECAY)
        self._queue_ms.update(round_.t_queue_ms, TIME_DECAY)
        if not round_.prefill:
            self.verify_cost.update(
                round_.k, round_.verifier_load, round_.t_verify_ms, waits=not cloud
            )
        self.declines.observe(round_, self._in_mode)
        if not cloud:  # a cloud round says nothing of what the device has or obeys
            self._used_drafts.setdefault(round_.device_id, set()).add(round_.draft_model)
            self._note_switch(round_)

    def _note_switch(self, round_: RoundObservation) -> None:
        asked = self._asked.get(round_.session_id)
        if asked is None:
            return
        draft, rounds = asked
        if round_.draft_model == draft:
            del self._asked[round_.session_id]
        elif rounds + 1 >= REFUSED_AFTER_ROUNDS:
            self._refused.setdefault(round_.device_id, set()).add(draft)
            del self._asked[round_.session_id]
        else:
            self._asked[round_.session_id] = (draft, rounds + 1)

    def forget_session(self, session_id: str) -> None:
        self._asked.pop(session_id, None)
        self._in_mode.pop(session_id, None)
        self.exploration.forget_session(session_id)
        self.declines.forget(session_id)

    def _rtt(self, device_id: str) -> Ewma:
        return self._rtt_ms.setdefault(device_id, Ewma(PRIOR_RTT_MS))

    def _draft_cost(self, device_id: str, draft: str) -> Ewma:
        key = (device_id, draft)
        return self._draft_ms.get(key) or self._draft_ms.setdefault(key, Ewma(self._ms(*key)))

    def _ms(self, device_id: str, draft: str) -> float:
        """A token's draft cost: the device's own, else its class's, else the prior; on the
        host, what the verifiers report first (their drafts' first windows are clipped there,
        where a neural draft's first window also prefills it)."""
        host = device_id == HOST
        reported = self.host_draft_ms.get(draft) if host else None
        if reported is not None:
            return reported
        cost = self._draft_ms.get((device_id, draft))
        if cost is not None:
            return cost.value
        neural = PRIOR_HOST_DRAFT_MS_PER_TOKEN if host else PRIOR_NEURAL_DRAFT_MS_PER_TOKEN
        prior = PRIOR_DRAFT_MS_PER_TOKEN.get(draft, neural)
        by_class = None if host else self.wants.class_cost(device_id, draft)
        return prior if by_class is None else by_class

    # --- what we decide -------------------------------------------------------------------

    def alpha(self, device_id: str, draft: str, task_type: str) -> float:
        rate = self._alpha.get((device_id, draft, task_type))
        if rate is None:
            return self.wants.unseen_alpha(self._device_alpha.get(device_id, {}), draft, task_type)
        return rate.alpha

    def candidate_drafts(self, device_id: str, current_draft: str) -> list[str]:
        installed = self._device_drafts.get(device_id, ())
        used = sorted(self._used_drafts.get(device_id, set()))
        refused = {
            *self._refused.get(device_id, set()),
            *self._fetch_failed.get(device_id, {}),
            *self._over_memory.get(device_id, ((), None))[0],
        }
        names = dict.fromkeys([current_draft, *installed, *BUILTIN_DRAFTS, *used])
        return [
            name
            for name in names
            if name == current_draft
            or (name not in refused and name.removeprefix("hybrid+") not in refused)
        ]

    def best_window(
        self,
        alpha: float,
        draft_ms_per_token: float,
        fixed_ms: float,
        load: float,
        mode: m.Mode = m.Mode.DISTRIBUTED,
        fill: ProposalLength | None = None,
        beside: float = 0.0,
    ) -> tuple[int, float, float, float]:
        """(k, E, T, n(k)) with the highest E / T for k in [K_MIN, k_max]; `fixed_ms` is RTT +
        queue in distributed mode, and the RTT's share plus queue in cloud mode. Without `fill`
        the drafter fills its window. E, n(k), t_verify and T are those of round_model's
        functions and VerifyCost.predict_windows, the ones the tests check. `beside`: the host
        streams beside the session on its verifier; a device window is rated on E less what it
        costs them (streams_lost), and E is returned whole."""
        return self._best_window(alpha, draft_ms_per_token, fixed_ms, load, mode, fill, beside)[:4]

    def _best_window(
        self,
        alpha: float,
        draft_ms_per_token: float,
        fixed_ms: float,
        load: float,
        mode: m.Mode,
        fill: ProposalLength | None,
        beside: float,
    ) -> tuple[int, float, float, float, float]:
        """best_window's (k, E, T, n(k)) and what the streams beside lose to it."""
        survival, drafted_k = (self._unseen_fill if fill is None else fill).curve(self.k_max)
        return best_window(
            self.verify_cost,
            alpha,
            survival,
            drafted_k,
            draft_ms_per_token,
            fixed_ms,
            load,
            mode,
            beside,
        )

    def _candidate(
        self,
        mode: m.Mode,
        device_id: str,
        draft: str,
        task_type: str,
        rtt_ms: float,
        queue_ms: float,
        load: float,
        beside: float = 0.0,
    ) -> Candidate:
        alpha = self.alpha(device_id, draft, task_type)
        cloud = mode is m.Mode.CLOUD
        per_token = self._ms(HOST if cloud else device_id, draft)
        k, tokens, total_ms, drafted, lost = self._best_window(
            alpha,
            per_token,
            self.fixed_ms(mode, device_id, rtt_ms, queue_ms),
            load,
            mode,
            self._fill.get((device_id, draft), self._unseen_fill),
            beside if mode is m.Mode.DISTRIBUTED else 0.0,
        )
        net = max(0.0, tokens - lost)
        rate = net / total_ms * 1000.0 if total_ms > 0 else math.inf
        return Candidate(
            draft, alpha, per_token, k, tokens, total_ms, rate, mode, drafted, streams_lost=lost
        )

    def fixed_ms(self, mode: m.Mode, device_id: str, rtt_ms: float, queue_ms: float) -> float:
        """What a round costs beyond drafting and verifying. Distributed: the turn measured on
        the device's own rounds, else RTT + queue until there is one. A host stream pays the
        RTT once a stream and waits in no queue: a round of it is in every pass."""
        if mode in m.HOST_MODES:
            return rtt_ms / CLOUD_STREAM_ROUNDS
        measured = self._overhead_ms.get(device_id)
        return rtt_ms + queue_ms if measured is None else max(0.0, measured.value)

    def _plain_candidate(
        self, current_draft: str, rtt_ms: float, queue_ms: float, load: float
    ) -> Candidate:
        """Plain mode: one token a round, no drafting, streamed (the RTT paid once a stream)."""
        verify = max(0.0, self.verify_cost.predict(0, load, waits=False))
        total_ms = verify + self.fixed_ms(m.Mode.PLAIN, current_draft, rtt_ms, queue_ms)
        rate = 1000.0 / total_ms if total_ms > 0 else math.inf
        return Candidate(current_draft, 0.0, 0.0, 0, 1.0, total_ms, rate, m.Mode.PLAIN, 0.0)

    def decide(
        self,
        session_id: str,
        device_id: str,
        task_type: str,
        current_draft: str,
        verifier_load: float,
        current_mode: m.Mode = m.Mode.DISTRIBUTED,
        host_drafts: Sequence[str] = (),
        plain: bool = False,
        beside: float = 0.0,
        opening: bool = False,
        new_stream: bool = False,
    ) -> Decision:
        """The next round's mode, draft and k. `host_drafts`: what the verifier hosts can draft
        with (none: no cloud mode); `plain`: whether the agent runs plain mode; `beside`: the
        host streams on the verifier other than this session's, which its device windows
        would hold up; `opening`: the session has no mode yet, so the best candidate of all is
        chosen, with no margin against flapping (opening_candidate); `new_stream`: no host
        stream of the session runs, so a cloud decision opens one, with an untried host drafter
        if there is one (exploration)."""
        rtt_ms = self._rtt(device_id).value
        queue_ms = self._queue_ms.value
        load = verifier_load
        distributed = [
            self._candidate(
                m.Mode.DISTRIBUTED, device_id, d, task_type, rtt_ms, queue_ms, load, beside
            )
            for d in self.candidate_drafts(device_id, current_draft)
        ]
        cloud = [
            self._candidate(m.Mode.CLOUD, device_id, d, task_type, rtt_ms, queue_ms, load)
            for d in host_offer(host_drafts)
        ]
        plain_decoding = self._plain_candidate(current_draft, rtt_ms, queue_ms, load)
        cloud, declined = self.declines.rate(session_id, cloud, plain_decoding)
        plain_candidates = [plain_decoding] if plain else []
        by_mode = {
            m.Mode.DISTRIBUTED: distributed,
            m.Mode.CLOUD: cloud,
            m.Mode.PLAIN: [] if cloud else plain_candidates,  # cloud mode holds it (host_worth)
        }
        limit = self.device_limit(device_id)
        fixed = (rtt_ms, queue_ms, load)
        wanted, wants_note = self.wants.wanted(
            device_id,
            self._device_drafts.get(device_id),
            self._fetch_failed.get(device_id, {}),
            distributed if limit is None else [],  # a device spared fetches nothing
            lambda d: self._candidate(m.Mode.DISTRIBUTED, device_id, d, task_type, *fixed, beside),
        )
        if limit is not None:
            host = [*cloud, *plain_candidates]
            by_mode[m.Mode.DISTRIBUTED] = spare_the_device(distributed, host)
        best = {
            mode: max(candidates, key=lambda c: c.tokens_per_s)
            for mode, candidates in by_mode.items()
            if candidates
        }
        worth, floor_note = host_worth(best, plain_decoding)
        # A session that never changed mode may change at once; after a change it dwells.
        in_mode, rounds = self._in_mode.get(session_id, (current_mode, MODE_DWELL_ROUNDS))
        if in_mode is not current_mode:
            rounds = 0
        if opening:
            mode = max(worth, key=lambda mode: worth[mode].tokens_per_s)
            mode_reason = f"opening in {mode.value} mode"
        else:
            mode, mode_reason = choose_mode(current_mode, worth, rounds)
        self._in_mode[session_id] = (mode, rounds + 1 if mode is current_mode else 0)
        if mode is m.Mode.CLOUD:
            mode_reason += floor_note

        explore = self.exploration.pick(session_id, cloud, new_stream and mode is m.Mode.CLOUD)
        if explore is not None:
            chosen, reason = explore, f"explore {explore.draft_model}: no cloud round of it yet"
        else:
            chosen, reason = choose_draft(
                by_mode[mode], best[mode], current_draft, SWITCH_MARGIN, opening
            )
            if mode is m.Mode.DISTRIBUTED and chosen.draft_model != current_draft:
                self._asked[session_id] = (chosen.draft_model, 0)
        reason += f"; mode {mode_reason}" + (f"; {declined}" if declined else "")
        if limit is not None:
            spared = "off the device" if mode in m.HOST_MODES else f"to {chosen.draft_model}"
            reason = f"{limit}: drafting moves {spared}; {reason}"
        memory = self.memory_note(device_id)
        if memory is not None:
            reason = f"{reason}; {memory}: not asked for"
        if wants_note is not None:
            reason = f"{reason}; {wants_note}"
        return Decision(
            mode=mode,
            draft_model=chosen.draft_model,
            k=chosen.k,
            min_confidence=self.min_confidence,
            device_id=device_id,
            task_type=task_type,
            current_draft=current_draft,
            current_mode=current_mode,
            rounds_in_mode=rounds,
            rtt_ms=rtt_ms,
            queue_ms=queue_ms,
            verifier_load=verifier_load,
            verify_coefficients=self.verify_cost.coefficients(),
            candidates=(*by_mode[m.Mode.DISTRIBUTED], *cloud, *plain_candidates),
            reason=reason,
            device_limit=limit,
            fetch=wanted,
            streams_beside=beside,
        )
