"""Decoding sessions: open and resume, validate drafts, verify, apply stop rules, persist, reply.

Persist before publish: a round and the session's committed tokens are written in one
transaction before its verdict leaves, so a device never holds a token the database cannot
reproduce. A crash between the two loses only the publication; the re-sent draft then finds the
stored round and gets the same verdict back.

The book is built in layers, one concern a module: session_state (a session in memory),
session_store (its rows), book_core (shared state and replies), adaptation (the policy),
direct_rounds (leases to verifiers), round_pipeline (rounds answered here), and this
module: sessions opened, resumed, closed, expired and rebuilt."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from broker import messages as m
from broker.client import BusConnectionError
from coordinator.db.events import EventKind
from coordinator.db.models import SessionStatus
from coordinator.runtime.round_pipeline import RoundPipeline
from coordinator.runtime.session_state import LiveSession, busy
from coordinator.runtime.session_store import Opening
from coordinator.runtime.task_types import resolve_task

log = logging.getLogger(__name__)

# How often idle sessions are looked for (at most; a short idle timeout looks more often), and
# finished ones still in memory let go.
SWEEP_INTERVAL_S = 5.0


class SessionBook(RoundPipeline):
    """Every session's lifecycle on the coordinator side."""

    async def run_sweeper(self) -> None:
        """End idle sessions, and let go of ended ones, until cancelled."""
        while True:
            await asyncio.sleep(min(SWEEP_INTERVAL_S, self.idle_timeout_s / 4))
            try:
                await self.sweep()
            except Exception:
                # The database may be briefly away; the next sweep tries again.
                log.exception("session sweep failed")

    async def sweep(self) -> None:
        now = time.monotonic()
        for live in list(self.live.values()):
            if live.status is not SessionStatus.ACTIVE:
                self._let_go(live)
            elif now - live.last_heard >= self.idle_timeout_s and not busy(live):
                await self._expire(live, now - live.last_heard)

    def open_sessions(self, device_id: str) -> int:
        """The device's active sessions, and those being opened."""
        held = sum(
            1
            for live in self.live.values()
            if live.device_id == device_id and live.status is SessionStatus.ACTIVE
        )
        return held + self._opening[device_id]

    async def _expire(self, live: LiveSession, idle_s: float) -> None:
        """An idle session ends (cancelled, with a `session.expired` event); its device is told."""
        async with live.lock:
            if live.status is not SessionStatus.ACTIVE or busy(live, locked=False):
                return
            await self._unlease(live)  # what its verifier persisted stands
            if live.status is SessionStatus.ACTIVE:
                live.status = SessionStatus.CANCELLED
                reason = f"idle for {idle_s:.0f}s (timeout {self.idle_timeout_s:g}s)"
                log.info("session %s expired: %s", live.id, reason)
                await asyncio.to_thread(
                    self.store.finish,
                    live,
                    SessionStatus.CANCELLED,
                    reason,
                    EventKind.SESSION_EXPIRED.value,
                )
        self._let_go(live)
        try:
            await self._send_state(live)
        except (ConnectionError, BusConnectionError, m.BusError) as exc:
            log.warning("could not tell %s of the expiry of %s: %s", live.device_id, live.id, exc)

    def _open_refusal(self, device_id: str, request: m.SessionOpen) -> str | None:
        """Why a new session may not open (a quota, a prompt the target cannot read), or None."""
        quotas = self.quotas
        if len(request.prompt_ids) > quotas.max_prompt_tokens:
            return (
                f"prompt of {len(request.prompt_ids)} tokens exceeds the quota of "
                f"{quotas.max_prompt_tokens}"
            )
        target_vocab = self.target_vocab()
        if request.vocab and target_vocab and request.vocab != target_vocab:
            return (
                f"the session's vocabulary ({request.vocab[:12]}) is not the target's "
                f"({target_vocab[:12]}): its drafter and tokenizer belong to another target"
            )
        vocab_size = self.pool.vocab_size() or self.vocab_size
        highest = max(request.prompt_ids)
        if vocab_size is not None and highest >= vocab_size:
            return (
                f"prompt token id {highest} is outside the target's vocabulary "
                f"(ids 0..{vocab_size - 1})"
            )
        if self.open_sessions(device_id) >= quotas.max_open_sessions:
            return (
                f"the device has {quotas.max_open_sessions} sessions open, its quota: "
                "close one first"
            )
        return None

    async def _open(
        self, device_id: str, session_uuid: uuid.UUID, request: m.SessionOpen
    ) -> Opening:
        """A session not in memory: read it back from the database, or create it, in one hop
        to a thread (`SessionStore.open`). The checks of a new open that need no database are
        made here first; they count for nothing when the session turns out to be stored.

        On SQLite one open goes at a time. SQLite lets one writer in, and a writer that finds
        the lock taken sleeps 1, 2, 5, 10 ms and more between its tries: 16 opens at once
        starved each other, and a wave's first session waited up to 120 ms for its insert."""
        refusal = self._open_refusal(device_id, request)
        self._opening[device_id] += 1
        try:
            async with self._open_turn if self._writer.inline else contextlib.nullcontext():
                return await asyncio.to_thread(
                    self.store.open,
                    device_id,
                    session_uuid,
                    request,
                    self.default_draft,
                    admitted=self._admit,
                    refusal=refusal,
                )
        finally:
            self._opening[device_id] -= 1
            if not self._opening[device_id]:
                del self._opening[device_id]

    async def on_session_open(self, device_id: str, request: m.SessionOpen) -> None:
        try:
            session_uuid = uuid.UUID(request.session_id)
        except ValueError:
            await self._error(
                device_id,
                m.Refused.SESSION_OPEN,
                request.session_id,
                None,
                "session_id must be a UUID",
            )
            return
        # A resume of a live session is answered from memory and never refused for the rate:
        # refusing it would fail a session the device is running. Anything else (a new session,
        # or one the database must be read for) counts against the device's open rate.
        resuming = self.live.get(request.session_id)
        live_resume = resuming is not None and resuming.device_id == device_id
        if not live_resume and not self._open_limit.allow(device_id):
            limit = self._open_limit
            reason = f"session opens over quota ({limit.rate:g}/s, burst {limit.burst})"
            await self._error(device_id, m.Refused.SESSION_OPEN, request.session_id, None, reason)
            return
        live, opened = resuming, False
        if live is None:
            opening = await self._open(device_id, session_uuid, request)
            if opening.live is None:
                assert opening.refusal is not None
                await self._error(
                    device_id, m.Refused.SESSION_OPEN, request.session_id, None, opening.refusal
                )
                return
            live, opened = opening.live, opening.created
            if not opened and live.status is SessionStatus.ACTIVE:
                live = self.live.setdefault(live.id, live)  # another load may have won
        if opened:
            live.modes = frozenset({*request.modes, request.mode})
            # No window asked for: the coordinator chooses, round by round (plain mode asks for
            # no window and wants none).
            if request.k == 0 and request.mode is not m.Mode.PLAIN:
                live.policy_task = resolve_task(request.task_type, request.prompt)
                if live.modes & m.HOST_MODES:
                    self._open_where_best(live)
            self.live[live.id] = live
            log.info(
                "session %s opened on %s (k=%d, draft %s)",
                live.id,
                device_id,
                live.policy.k,
                live.policy.draft_model,
            )
        elif live.device_id != device_id:
            await self._error(
                device_id,
                m.Refused.SESSION_OPEN,
                request.session_id,
                None,
                "the session belongs to another device",
            )
            return
        else:
            live.last_heard = time.monotonic()
            log.info("session %s resumed by %s at round %d", live.id, device_id, live.next_round)
            live.modes = frozenset({*request.modes, request.mode, live.policy.mode})
            detail: dict[str, Any] = {"next_round": live.next_round}
            if request.resume is not None:
                detail["reason"] = request.resume.value
            await asyncio.to_thread(self.store.event, "session.resumed", live, detail)
        if request.fallback is not None:
            # The device generated alone while it could not reach us; its provisional tail
            # follows as one long draft.
            log.info(
                "session %s: %s generated %d provisional tokens in %.1fs offline",
                live.id,
                device_id,
                request.fallback.provisional_tokens,
                request.fallback.offline_s,
            )
            await asyncio.to_thread(
                self.store.event, "session.fallback", live, request.fallback.model_dump(mode="json")
            )
        if request.draft_missing and self.fetches is not None:
            log.info("session %s: %s", live.id, self.fetches.want(device_id, request.draft_model))
        if await self._leased_here(live, send_state=True):
            return  # the holder tells the device where the session stands
        if opened and request.awaits_stream and self._hosted(live):
            # Opened on the host for an agent that waits for its stream: the state says it runs,
            # and it starts now, the agent's request for it (a bus round trip) spared. Nor does
            # it wait for the broker to acknowledge the state (4-65 ms a session when a wave of
            # 16 opened at once): the state's publish starts in this step, the stream's task at
            # the next, and its first verdict a pass later; one client's messages on one topic
            # reach the device in order. A state that could not be sent stops the stream.
            streaming = asyncio.ensure_future(self._run_stream(live))
            try:
                await self._send_state(live, streaming=True)
            except BaseException:
                streaming.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await streaming  # its end, not its error: the state's is the one raised
                raise
            await streaming
            return
        # Opened again while its stream runs (the agent reconnected): the state says so, and the
        # agent waits for the stream's verdicts rather than asking for it.
        await self._send_state(live, streaming=live.streaming)

    async def on_session_close(self, device_id: str, request: m.SessionClose) -> None:
        live = await self.get(request.session_id)
        if live is None or live.device_id != device_id:
            await self._error(
                device_id, m.Refused.SESSION_CLOSE, request.session_id, None, "unknown session"
            )
            return
        async with live.lock:
            await self._unlease(live)
            if live.status is SessionStatus.ACTIVE:
                live.status = SessionStatus.CANCELLED
                await asyncio.to_thread(
                    self.store.finish, live, SessionStatus.CANCELLED, request.reason
                )
        self._let_go(live)
        await self._send_state(live)

    async def rebuild(
        self, owned: Callable[[str], bool] | None = None, *, heard_at: float | None = None
    ) -> list[LiveSession]:
        """After a coordinator restart: every active session back in memory from the database,
        each device told its session's state (a draft lost with the old process is re-sent).
        `owned(device_id)`: only those devices' sessions (shards taken over from a peer).
        `heard_at`: when the sessions read here count as last heard of (for `announce`)."""
        loaded = await asyncio.to_thread(self.store.load_active)
        if owned is not None:
            loaded = [live for live in loaded if owned(live.device_id)]
        rebuilt = []
        for live in loaded:
            # A session already in memory (a draft of it came first, once the shard was
            # taken) stays the one: the copy just read would be announced with a stale state.
            kept = self.live.setdefault(live.id, live)
            if kept is live and heard_at is not None:
                live.last_heard = heard_at
            rebuilt.append(kept)
        if rebuilt:
            log.info("rebuilt %d active sessions from the database", len(rebuilt))
        return rebuilt

    async def announce(
        self, sessions: list[LiveSession], *, quiet_since: float | None = None
    ) -> None:
        """Send each session's state to its device; a failed send is retried by the device.
        A session heard from after `quiet_since` (time.monotonic()) is left out: its device
        already talks to this coordinator, and a state would only make it send again a draft
        that is being answered (the answer then comes twice)."""
        for live in sessions:
            if self._holder(live) is not None:
                continue  # its verifier holds it and answers its device meanwhile
            if quiet_since is not None and live.last_heard > quiet_since:
                continue
            try:
                await self._send_state(live)
            except (ConnectionError, BusConnectionError, m.BusError) as exc:
                log.warning("could not send the state of session %s: %s", live.id, exc)
