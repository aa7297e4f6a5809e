"""The session book's side of the adaptive policy: each round observed, the next mode,
drafter and window chosen, and the mode an adaptive session opens in."""

from __future__ import annotations

import logging
from typing import Any

from broker import messages as m
from coordinator.db.models import Round, SessionStatus
from coordinator.runtime.book_core import BookCore
from coordinator.runtime.decisions import opening_candidate
from coordinator.runtime.policy import STREAM_DECISION_EVERY, RoundObservation
from coordinator.runtime.round_model import verifier_load
from coordinator.runtime.session_state import LiveSession, allowed_window

log = logging.getLogger(__name__)


class AdaptiveBook(BookCore):
    """Sessions whose window the coordinator chooses (the agent asked for k = 0)."""

    def set_k(self, session_id: str, k: int) -> None:
        """The settable, fixed window of a session; the next verdict carries it."""
        live = self.live[session_id]
        live.policy = live.policy.model_copy(update={"k": k})

    def _adapt(
        self, live: LiveSession, row: Round, prefilled: bool = False
    ) -> tuple[m.Policy, dict[str, Any]]:
        """Learn from this round, choose the next; the decision and its inputs go on the round."""
        assert live.policy_task is not None
        load = self._load_beside(live)
        self.policy.observe(
            RoundObservation(
                session_id=live.id,
                device_id=live.device_id,
                draft_model=row.draft_model or live.policy.draft_model,
                task_type=live.policy_task,
                k=row.k,
                n_accepted=row.n_accepted,
                t_draft_ms=row.t_draft_ms or 0.0,
                t_uplink_ms=row.t_uplink_ms,
                t_queue_ms=row.t_queue_ms or 0.0,
                t_verify_ms=row.t_verify_ms or 0.0,
                verifier_load=load,
                mode=row.mode,
                # An adaptive session's first round is the agent's empty window (k = 0).
                window=allowed_window(live, row),
                # A pass that also prefilled (this session's first, or another's in the batch)
                # says nothing of what verifying a window costs.
                prefill=prefilled or row.round_index == 0,
                overhead_ms=live.turn_overhead_ms if row.mode is m.Mode.DISTRIBUTED else None,
            )
        )
        hosted = row.mode in (m.Mode.CLOUD, m.Mode.PLAIN)
        if hosted and (row.round_index % STREAM_DECISION_EVERY or row.round_index == 0):
            # A host stream's window is the verifier's choice, pass by pass; whether to leave
            # the host is asked every few rounds (a decision costs ~0.4 ms of this process).
            # A stream opened at round 0 was opened by the opening's decision, which its round
            # 0 records: the next one comes after round 8, with the rounds of a drafter being
            # tried behind it.
            opening, live.opening_decision = live.opening_decision, None
            if row.round_index == 0 and opening is not None:
                return live.policy, opening
            return live.policy, live.policy.model_dump(mode="json")
        return self._decide(live, row.draft_model or live.policy.draft_model, load)

    def _load_beside(self, live: LiveSession) -> float:
        """The live verifiers' mean load less the session's own stream: a round of it is a
        row beside `load` others (the verify cost's B = load + 1). Counted in, a lone stream
        was rated at load 1: a pass of two rows, and host drafting at twice its cost."""
        verifiers = self.pool.live()
        load = verifier_load(v.load for v in verifiers)
        return max(0.0, load - 1.0 / len(verifiers)) if live.streaming and verifiers else load

    def _streams_beside(self, session_id: str, *, opening: bool = False) -> float:
        """The host streams a verifier runs beside this session's own, on the live verifiers'
        mean: what a window drafted on its device would hold up. `opening`: also the sessions
        opened in a host mode whose streams have not started (their first round waits on its
        prefill): a wave's sessions open within milliseconds of each other, and each saw none
        of the others' streams, so some opened on their devices and held up the streams'
        first passes with their windows (bench e2e at 16: passes of 180-240 ms where plain
        ones took 90)."""
        live = self.pool.live()
        if not live:
            return 0.0
        streams = sum(
            1
            for info in live
            for stream in info.streams.values()
            if stream.request.session_id != session_id
        )
        if opening:
            streams += sum(
                1
                for other in self.live.values()
                if other.id != session_id
                and other.next_round == 0
                and not other.streaming
                and other.status is SessionStatus.ACTIVE
                and other.policy.mode in m.HOST_MODES
            )
        return streams / len(live)

    def _open_where_best(self, live: LiveSession) -> None:
        """An adaptive session starts in the mode the policy rates best for its device now:
        nothing is switched yet, so no margin against flapping is asked of the host modes, and
        a session that does best on the host has no round drafted on the device first."""
        load = verifier_load(v.load for v in self.pool.live())
        host_drafts = self.host_drafts() if m.Mode.CLOUD in live.modes else ()
        self.policy.observe_verifiers(*self.pool.reported_costs())
        decision = self.policy.decide(
            live.id,
            live.device_id,
            live.policy_task or live.task_type,
            live.policy.draft_model,
            load,
            host_drafts=host_drafts,
            plain=True,
            beside=self._streams_beside(live.id, opening=True),
            opening=True,
            # A session opened on the host starts its stream at round 0 (its agent sends a
            # request for it), so this decision opens the stream: an untried host drafter is
            # tried here, as the decision after a device's round 0 would.
            new_stream=True,
        )
        best = opening_candidate(decision)
        if best is None:
            return
        live.opening_decision = decision.to_json()
        live.policy = m.Policy(
            mode=best.mode,
            draft_model=best.draft_model,
            k=best.k,
            min_confidence=decision.min_confidence,
        )
        log.info(
            "session %s opens in %s mode (%s, k=%d): %.1f tok/s predicted",
            live.id,
            best.mode.value,
            best.draft_model,
            best.k,
            best.tokens_per_s,
        )

    def _decide(
        self, live: LiveSession, draft_model: str, load: float
    ) -> tuple[m.Policy, dict[str, Any]]:
        assert live.policy_task is not None
        self.policy.observe_verifiers(*self.pool.reported_costs())
        decision = self.policy.decide(
            live.id,
            live.device_id,
            live.policy_task,
            draft_model,
            load,
            current_mode=live.policy.mode,
            host_drafts=self.host_drafts() if m.Mode.CLOUD in live.modes else (),
            plain=m.Mode.PLAIN in live.modes or m.Mode.CLOUD in live.modes,
            beside=self._streams_beside(live.id),
            new_stream=not live.streaming,
        )
        if decision.fetch is not None and self.fetches is not None:
            # Drafts on demand, asked by the policy: the session drafts on with what the device
            # has; the drafter is rated with those once the device's status lists it.
            self.policy.wants.fetching(live.device_id, decision.fetch)
            log.info("session %s: %s", live.id, self.fetches.want(live.device_id, decision.fetch))
        return decision.policy, decision.to_json()
