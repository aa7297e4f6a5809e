"""Direct rounds: a distributed session leased to a verifier, which answers its device's
drafts itself and reports each round; leases given, taken back and taken over."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from broker.client import BusConnectionError
from coordinator.db.models import Round, SessionStatus
from coordinator.runtime.adaptation import AdaptiveBook
from coordinator.runtime.book_core import Publish
from coordinator.runtime.session_state import ADOPTED, LiveSession
from coordinator.runtime.verifiers import VerifierPool

log = logging.getLogger(__name__)


class DirectRounds(AdaptiveBook):
    """Leases of sessions to verifiers, and the rounds those verifiers report."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        pool: VerifierPool,
        publish: Publish,
        **options: Any,
    ) -> None:
        super().__init__(sessions, pool, publish, **options)
        pool.lost_observers.append(self.on_verifier_lost)

    def _holder(self, live: LiveSession) -> str | None:
        """The live verifier answering the session's drafts, if one holds its lease. A lease
        this coordinator does not know of (it restarted) is learnt from the heartbeats."""
        if live.lease is None and live.adoptable:
            holder = self.pool.holder(live.id)
            if holder is None:
                return None
            live.lease = (holder, ADOPTED)
        if live.lease is None:
            return None
        holder, lease_id = live.lease
        if lease_id == ADOPTED and self.pool.holder(live.id) != holder:
            live.lease = None  # its heartbeat no longer lists it: given back, or finished
            return None
        if self.pool.is_alive(holder):
            return holder
        return None

    async def _leased_here(self, live: LiveSession, *, send_state: bool = False) -> bool:
        """Lease an active distributed session to a verifier that takes leases, or update the
        lease it has; True when a verifier holds it (and, with send_state, tells the device)."""
        if live.status is not SessionStatus.ACTIVE or live.policy.mode is not m.Mode.DISTRIBUTED:
            return False
        async with live.lock:
            if live.streaming:
                return False
            holder = self._holder(live)
            if holder is not None:
                lease = self._lease_message(live, live.lease[1] if live.lease else ADOPTED)
                await self.pool.tell(holder, lease.model_copy(update={"send_state": send_state}))
                return True
            if live.lease is not None:  # its verifier died: what it persisted stands
                await self._take_back(live)
            info = self.pool.lessor(live.id)
            if info is None:
                return False
            lease = self._lease_message(live, secrets.token_hex(8))
            try:
                ack = await self.pool.lease(
                    info.verifier_id, lease.model_copy(update={"send_state": send_state})
                )
            except (TimeoutError, asyncio.TimeoutError, ConnectionError, BusConnectionError):
                log.warning("verifier %s did not take session %s", info.verifier_id, live.id)
                # Its answer may only be late: a lease it took would have it answer the
                # session's drafts beside this coordinator.
                await self._end_lease_there(info.verifier_id, lease.lease_id, live.id)
                return False
            if not ack.held:
                log.info("verifier %s refused session %s: %s", ack.verifier_id, live.id, ack.reason)
                return False
            live.lease = (info.verifier_id, lease.lease_id)
            live.adoptable = False
            log.info("session %s leased to verifier %s", live.id, info.verifier_id)
            return True

    def _lease_message(self, live: LiveSession, lease_id: str) -> m.SessionLease:
        return m.SessionLease(
            lease_id=lease_id,
            session_id=live.id,
            device_id=live.device_id,
            prompt_len=len(live.prompt_ids),
            context_ids=tuple(live.prompt_ids + live.generated),
            next_round=live.next_round,
            sampling=live.sampling,
            max_tokens=live.max_tokens,
            eos_id=self.eos_id,
            policy=self._agent_policy(live),
        )

    async def _unlease(self, live: LiveSession) -> None:
        """Take a leased session back (the caller holds its lock): the verifier answers after
        the round it has in flight, and the session goes on from what the database holds."""
        if live.lease is None:
            return
        holder, lease_id = live.lease
        live.lease = None
        live.adoptable = False
        if self.pool.is_alive(holder):
            end = m.LeaseEnd(lease_id=lease_id, session_id=live.id)
            try:
                await self.pool.lease(holder, end)
            except (TimeoutError, asyncio.TimeoutError, ConnectionError, BusConnectionError):
                log.warning("verifier %s did not give session %s back in time", holder, live.id)
        await self._reload(live)

    async def _reload(self, live: LiveSession) -> set[int]:
        """The session's committed tokens and next round as the database holds them. Rounds
        stored there that this coordinator never heard of (a verifier persisted them and died,
        or its reports were lost) go to the round observers now, so that /metrics counts every
        committed token once; their indices are returned."""
        before = live.next_round
        stored = await asyncio.to_thread(self.store.load, live.id)
        live.lease = None
        if stored is None:
            return set()
        live.generated = stored.generated
        live.next_round = stored.next_round
        if live.status is SessionStatus.ACTIVE:
            live.status = stored.status
        live.last_verdict = None
        live.last_draft = None
        if stored.next_round <= before:
            return set()
        missed = await asyncio.to_thread(
            self.store.rounds_between, live.id, before, stored.next_round
        )
        for row in missed:
            for observe in self.round_observers:
                observe(live, row)
        return {row.round_index for row in missed}

    async def _take_back(self, live: LiveSession) -> None:
        """Take a session back from the verifier that held it, declared dead, and reload it.
        That verifier may only have been slow to be heard (its heartbeats queued here behind a
        backlog): alive, it would go on answering the session's drafts beside this coordinator,
        each round then stored by one and refused to the other. The end of its lease, not waited
        for, stops it after its round in flight; a verifier really gone never reads it."""
        if live.lease is not None:
            await self._end_lease_there(*live.lease, live.id)
        await self._reload(live)

    async def _end_lease_there(self, verifier_id: str, lease_id: str, session_id: str) -> None:
        """The end of a lease, not waited for: a verifier that took it stops answering the
        session after its round in flight; one that is gone never reads it."""
        try:
            await self.pool.tell(verifier_id, m.LeaseEnd(lease_id=lease_id, session_id=session_id))
        except (ConnectionError, BusConnectionError) as exc:
            log.debug("the end of %s's lease on %s was not sent: %s", verifier_id, session_id, exc)

    def on_verifier_lost(self, verifier_id: str) -> None:
        """The sessions a dead verifier held: leased again (or answered here), devices told."""
        for live in list(self.live.values()):
            if live.lease is not None and live.lease[0] == verifier_id:
                task = asyncio.create_task(self._take_over(live), name=f"take-over-{live.id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _take_over(self, live: LiveSession) -> None:
        async with live.lock:
            await self._take_back(live)
        log.warning("session %s: its verifier died; taking it over", live.id)
        if not await self._leased_here(live, send_state=True):
            await self._send_state(live)

    async def on_round_done(self, verifier_id: str, done: m.RoundDone) -> None:
        """A direct round, persisted and answered by the verifier holding the session."""
        live = await self.get(done.session_id)
        if live is None:
            return
        live.last_heard = time.monotonic()
        observed: set[int] = set()  # rounds a reload gave the observers already
        async with live.lock:
            if done.round < live.next_round:
                return  # already known (a re-sent report)
            if done.round > live.next_round or done.base_len != live.committed_len:
                # Reports were lost: the database has them all.
                observed = await self._reload(live)
                live.lease = (verifier_id, done.lease_id)
            else:
                live.generated = live.generated + list(done.committed)
                live.next_round = done.round + 1
                if done.finished:
                    live.status = SessionStatus.FINISHED
            if done.finished:
                live.lease = None
            row = self._done_row(live, done)
            if live.policy_task is not None and not done.provisional and not done.finished:
                live.turn_overhead_ms = done.overhead_ms
                before = live.policy
                live.policy, record = self._adapt(live, row, done.batch_prefilled > 0)
                # A decision that changes nothing stays here: the one in force is recorded. One
                # that has a drafter fetched for the device is recorded too (it says why).
                asks = record.get("decision", {}).get("fetch") is not None
                if live.policy != before or not live.decision_sent or asks:
                    await self._repolicy(live, record)
                    live.decision_sent = True
            live.last_verdict = None
        if done.round not in observed:
            for observe in self.round_observers:
                observe(live, row)
        if done.provisional:
            tail = tuple(done.committed[:-1])  # what is known of it: the kept prefix
            await self._reconciled(live, done.round, tail, done.n_accepted, done.committed[-1])
        if done.finished:
            self._let_go(live)
            log.info(
                "session %s finished: %d tokens in %d rounds",
                live.id,
                len(live.generated),
                live.next_round,
            )

    async def _repolicy(self, live: LiveSession, record: dict[str, Any]) -> None:
        """A new decision after a direct round: its verifier's next verdicts carry it and its
        rounds record it until the next (the policy runs off the round's path, so it is a round
        or two behind); a host mode takes the session back (the device's next draft then comes
        here, and its verdict starts the stream)."""
        holder = self._holder(live)
        if holder is None:
            return
        if live.policy.mode is not m.Mode.DISTRIBUTED:
            await self._unlease(live)
            # Its next draft may have reached neither (the verifier gave the session back, and
            # here it was still leased): the state makes the device send it again, here.
            await self._send_state(live)
            return
        assert live.lease is not None
        lease = self._lease_message(live, live.lease[1])
        await self.pool.tell(holder, lease.model_copy(update={"policy_record": record}))

    def _done_row(self, live: LiveSession, done: m.RoundDone) -> Round:
        """The round as the verifier stored it, for the policy and the observers."""
        return Round(
            session_id=uuid.UUID(live.id),
            round_index=done.round,
            base_len=done.base_len,
            draft_tokens=list(done.committed[: done.n_accepted]),
            draft_model=done.draft_model,
            provisional=done.provisional,
            k=done.drafted,
            mode=m.Mode.DISTRIBUTED,
            n_accepted=done.n_accepted,
            next_token=done.committed[-1],
            committed_len=done.base_len + len(done.committed),
            verifier_id=done.verifier_id,
            policy=self._agent_policy(live).model_dump(mode="json"),
            t_draft_ms=done.t_draft_ms,
            t_uplink_ms=done.t_uplink_ms,
            t_queue_ms=done.t_queue_ms,
            t_verify_ms=done.t_verify_ms,
        )
