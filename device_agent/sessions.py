"""Decoding sessions on the bus: each session's rounds, resynchronisation and streamed text.

A `SessionBook` belongs to one agent. `start` opens a session (`SessionOpen` on
`dev/{id}/session`) and runs its rounds in a task of its own: draft, publish the `Draft`, apply the
`Verdict`, draft the next window, until the coordinator says the session has finished. Messages
from the device's verdict topic reach their session through `dispatch`. Callers read the committed
text as it grows through `AgentSession.text_deltas()` (or every event of the stream, provisional
text included, through `events()`) and the final `SessionSummary` from `wait()`.

Local mode: a session that hears nothing from the coordinator for `fallback_after_s` (its link is
down, or no verdict comes) generates with its drafter alone. Those tokens are provisional: they
stream as `provisional` events and go to the journal. When the coordinator answers again, the
session resynchronises, sends the provisional tail as one long draft, and tells the caller in a
`reconciled` event which provisional tokens the target kept and which it replaced; the committed
text is always the target's. A drafter that proposes nothing (a copying drafter with no match)
simply waits for the link. With a journal, every open session is written down on each commit,
and a restarted agent resumes them (`SessionBook.resume_journal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from broker import messages as m
from broker.topics import DeviceChannel
from core.aio import timeout
from device_agent.admission import MemoryRefused, StandInProposer
from device_agent.catalog import CatalogError, DrafterCatalog
from device_agent.drafting import DraftWindow, LocalSpell, OutOfSync, SessionDrafter, SessionSpec
from device_agent.journal import JournalEntry, SessionJournal
from device_agent.settings import LocalSettings
from inference.drafters import BUILTIN_DRAFTERS, HYBRID_PREFIX
from inference.proposers import Proposer
from inference.tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger(__name__)

# Module-level so tests can shrink them.
OPEN_TIMEOUT_S = 10.0  # a SessionOpen with no SessionState after this long is sent again
MAX_REFUSALS = 3  # drafts of one round refused this often fail the session
RECENT_SESSIONS = 32  # finished sessions kept for the local API to read back
LOCAL_STEP_TOKENS = 8  # tokens generated alone between two looks at the inbox
# Local mode is for a coordinator gone quiet. A session's first verdict carries its prompt's
# prefill, which a verifier opening a wave of sessions at once takes seconds over (32 prompts,
# several seconds on a CPU verifier), and the coordinator has just confirmed the session. So,
# while the link is up, that verdict gets this many times fallback_after_s before local mode.
FIRST_VERDICT_GRACE = 4.0
# ... and so do the verdicts after it up to this many: a session whose first round went in a
# pass of its own sends its second while the verifier prefills the rest of the wave (31 prompts
# in one 5.6 s pass at 32 sessions, past the default 5 s), and it went local for that alone.
GRACE_VERDICTS = 2

Publish = Callable[[DeviceChannel, m.Message], Awaitable[bool]]
T = TypeVar("T")


class Phase(Enum):
    """Where a session stands in its exchange with the coordinator: what it waits for next."""

    OPENING = "opening"  # the open goes out and the first window is drafted meanwhile
    AWAITING_STATE = "awaiting_state"  # an open is out: a SessionState answers it
    AWAITING_VERDICT = "awaiting_verdict"  # a window is out (or streamed): a verdict answers it
    DONE = "done"


class Report(Enum):
    """The coordinator's knowledge of a spell of local mode (SessionOpen.fallback)."""

    NONE = "none"  # nothing to report
    DUE = "due"  # provisional tokens the coordinator has not been told of
    SENT = "sent"  # told in an open; settled once a SessionState answers


class SessionError(Exception):
    """A session that cannot start: a bad request, an unknown drafter, no tokenizer."""


class SessionRequest(BaseModel):
    """A session as an app on the device asks for it (the local API's body, `ask`'s flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: str = Field(min_length=1, max_length=64 * 1024)
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    task_type: str = Field(default="chat", min_length=1, max_length=32)
    draft: str | None = Field(default=None, min_length=1, max_length=128)
    k: int | None = Field(default=None, ge=0, le=64)
    proactive: bool | None = None  # None: the agent's setting
    # cloud: the verifier host drafts every window (needs k > 0; k = 0 lets the coordinator
    # choose the mode too).
    # plain: the host decodes with no drafter at all (k is then ignored).
    mode: Literal["distributed", "cloud", "plain"] = "distributed"
    # The local API's answer: Server-Sent Events as the text grows (True), or one JSON summary
    # once the session has ended (False), for an app that wants the whole answer only.
    stream: bool = True

    @classmethod
    def parse_json(cls, body: bytes) -> SessionRequest:
        """Validate a JSON body; raise SessionError with a one-line reason."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            raise SessionError(validation_reason(exc)) from None

    @classmethod
    def from_command(cls, args: dict[str, Any]) -> tuple[str, SessionRequest]:
        """The session id and request of a coordinator's `start_session` command."""
        known = {"session_id", "prompt", "task_type", "max_tokens", "sampling", "draft_model", "k"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise SessionError(f"unknown start_session arguments: {', '.join(unknown)}")
        try:
            session = _SESSION_ID.validate_python(args.get("session_id"))
        except ValidationError as exc:
            raise SessionError(f"session_id: {exc.errors(include_url=False)[0]['msg']}") from None
        try:
            sampling = m.SamplingSpec.model_validate(args.get("sampling") or {})
            request = cls.model_validate(
                {
                    "prompt": args.get("prompt"),
                    "task_type": args.get("task_type", "chat"),
                    "max_tokens": args.get("max_tokens"),
                    "temperature": float(sampling.temperature),
                    "top_p": float(sampling.top_p),
                    "seed": sampling.seed,
                    "draft": args.get("draft_model"),
                    "k": args.get("k"),
                }
            )
        except ValidationError as exc:
            raise SessionError(validation_reason(exc)) from None
        return session, request


_SESSION_ID: TypeAdapter[str] = TypeAdapter(m.SessionId)


def validation_reason(exc: ValidationError) -> str:
    """The first error of a validation, as `field: message`."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


@dataclass(frozen=True)
class SessionSummary:
    """What a finished (or failed, or cancelled) session did."""

    session_id: str
    status: str  # finished, cancelled, failed
    error: str
    prompt: str
    prompt_len: int
    token_ids: list[int]  # generated, the prompt excluded; ends with eos when it stopped there
    tokens: int  # len(token_ids)
    text: str
    rounds: int
    drafted: list[int]  # per round
    accepted: list[int]  # per round
    alpha: float | None  # accepted / drafted over the session
    tokens_per_round: float | None
    tokens_per_s: float | None  # generated tokens over the wall time from open to the end
    elapsed_s: float
    first_token_s: float | None
    draft_ms: float
    draft_models: list[str]
    k: int
    proactive: bool
    proactive_hits: int
    proactive_misses: int
    proactive_skipped: int  # rounds not drafted ahead because recent windows kept missing
    verifiers: list[str]
    resyncs: int
    # Per verified round: from handing the draft to the bus to its verdict reaching the agent,
    # and from that arrival to the next draft being handed over (the agent's own share).
    wait_ms: list[float]
    turnaround_ms: list[float]
    # Local mode: spells of it, the tokens generated alone, and what the target made of them.
    fallbacks: int
    provisional_tokens: int
    provisional_kept: int
    provisional_replaced: int
    resumed: bool  # resumed from the journal by a restarted agent

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class StreamEvent:
    """One event of a session's stream: `text` (committed), `provisional` or `reconciled`."""

    kind: str
    data: dict[str, Any]


class _Reconnected:
    """Put into every inbox when the bus comes back: re-send the open to resynchronise."""


Inbound = m.Verdict | m.SessionState | m.ErrorReply | _Reconnected


class AgentSession:
    """One session on this device: its task, its drafter, and its text as it commits."""

    def __init__(
        self,
        book: SessionBook,
        spec: SessionSpec,
        drafter: SessionDrafter,
        tokenizer: ChatTokenizer,
    ) -> None:
        self.book = book
        self.spec = spec
        self.session_id = spec.session_id
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.status = "opening"
        self.error = ""
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.resyncs = 0
        self.inbox: asyncio.Queue[tuple[float, Inbound]] = asyncio.Queue()  # (arrival, message)
        self._detokenizer: IncrementalDetokenizer = tokenizer.detokenizer()
        self._chunks: list[str] = []
        self._events: list[StreamEvent] = []
        self._changed = asyncio.Condition()
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._speculating: asyncio.Future[bool] | None = None
        self._published = False  # whether the window in flight went out
        # The last verdict came from the verifier holding the session (a direct round): the next
        # window goes to it alone, on the direct topic; whether the one in flight went there.
        self._direct = False
        self._sent_direct = False
        self._sent_at = 0.0  # perf_counter when the window in flight went out
        self._downlink: tuple[int, float] | None = None  # (round, ms) of the last verdict applied
        self.wait_ms: list[float] = []
        self.turnaround_ms: list[float] = []
        self._refusals = 0
        self._close_reason = ""
        self.phase = Phase.OPENING
        # Local mode (generating alone) is not a phase: the open or window that was out when
        # the coordinator went quiet is still what it owes when it answers again, so the phase
        # runs on beneath it. The report of the spell outlives both until a state settles it.
        self.local = False
        self.resumed = False
        self.fallbacks = 0
        self.provisional_tokens = 0
        self.provisional_kept = 0
        self.provisional_replaced = 0
        self._heard_at = time.monotonic()  # the coordinator's last answer (or the last reconnect)
        self._verdicts = 0  # verdicts heard by this session (in this process)
        self._confirmed = False  # a SessionState has come: the coordinator holds the session
        self._offline_since = 0.0  # unix time of the last answer before local mode began
        self._unreported = 0  # provisional tokens the coordinator has not been told of
        self._report = Report.NONE
        self._resume_reason: m.ResumeReason | None = None  # for the next open that goes out
        self._provisional_text: IncrementalDetokenizer | None = None

    # -- reading the session -------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The session's stream from the start (committed text, provisional text, reconciliations)
        as it grows; ends with the session."""
        index = 0
        while True:
            async with self._changed:
                while index >= len(self._events) and not self.done:
                    await self._changed.wait()
                events = self._events[index:]
                finished = self.done
            index += len(events)
            for event in events:
                yield event
            if finished and index >= len(self._events):
                return

    async def text_deltas(self) -> AsyncIterator[str]:
        """The committed text in pieces as it grows, from the start; ends with the session."""
        async for event in self.events():
            if event.kind == "text":
                yield str(event.data["delta"])

    async def wait(self) -> SessionSummary:
        await self._done.wait()
        return self.summary()

    def summary(self) -> SessionSummary:
        drafter = self.drafter
        records = drafter.records
        drafted = [r.drafted for r in records]
        accepted = [r.accepted for r in records]
        generated = drafter.generated
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        elapsed = end - self.started_at
        models = list(dict.fromkeys(r.draft_model for r in records)) or [drafter.draft_model]
        return SessionSummary(
            session_id=self.session_id,
            status=self.status,
            error=self.error,
            prompt=self.spec.prompt,
            prompt_len=len(self.spec.prompt_ids),
            token_ids=list(generated),
            tokens=len(generated),
            text=self.tokenizer.decode(generated),
            rounds=len(records),
            drafted=drafted,
            accepted=accepted,
            alpha=sum(accepted) / sum(drafted) if sum(drafted) else None,
            tokens_per_round=len(generated) / len(records) if records else None,
            tokens_per_s=len(generated) / elapsed if elapsed > 0 and generated else None,
            elapsed_s=elapsed,
            first_token_s=None
            if self.first_token_at is None
            else self.first_token_at - self.started_at,
            draft_ms=sum(r.draft_ms for r in records),
            draft_models=models,
            k=drafter.k,
            proactive=drafter.proactive,
            proactive_hits=drafter.stats.hits,
            proactive_misses=drafter.stats.misses,
            proactive_skipped=drafter.stats.skipped,
            verifiers=list(dict.fromkeys(r.verifier_id for r in records if r.verifier_id)),
            resyncs=self.resyncs,
            wait_ms=[round(ms, 3) for ms in self.wait_ms],
            turnaround_ms=[round(ms, 3) for ms in self.turnaround_ms],
            fallbacks=self.fallbacks,
            provisional_tokens=self.provisional_tokens,
            provisional_kept=self.provisional_kept,
            provisional_replaced=self.provisional_replaced,
            resumed=self.resumed,
        )

    async def cancel(self, reason: str = "cancelled") -> None:
        """Stop the session and tell the coordinator (SessionClose); no-op once it has ended."""
        if self.done or self._task is None:
            return
        self._close_reason = reason
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # -- the rounds ------------------------------------------------------------------------

    def _start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"session-{self.session_id}")

    def resume_after_restart(self, spell: LocalSpell | None) -> None:
        """Run again a session this agent's journal held when it stopped; `spell`: the tokens it
        generated alone meanwhile, which the coordinator may not have heard of yet."""
        self.resumed = True
        self._resume_reason = m.ResumeReason.RESTART
        if spell is not None:
            self._report = Report.DUE
            self._unreported = spell.generated
            self._offline_since = spell.since
        self._start()

    async def _emit(self, tokens: list[int], rewound: bool = False) -> None:
        if rewound:
            # The coordinator's truth dropped text already streamed; the summary's text is right.
            self._detokenizer = self.tokenizer.detokenizer(self.drafter.generated)
        visible = [t for t in tokens if t != self.tokenizer.eos_id]
        if tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        text = self._detokenizer.push(visible) if visible else ""
        if text:
            async with self._changed:
                self._chunks.append(text)
                self._events.append(StreamEvent("text", {"delta": text}))
                self._changed.notify_all()

    async def _add_event(self, kind: str, data: dict[str, Any]) -> None:
        async with self._changed:
            self._events.append(StreamEvent(kind, data))
            self._changed.notify_all()

    async def _emit_provisional(self, tokens: list[int]) -> None:
        if self._provisional_text is None:
            self._provisional_text = self.tokenizer.detokenizer(self.drafter.generated)
        visible = [t for t in tokens if t != self.tokenizer.eos_id]
        delta = self._provisional_text.push(visible) if visible else ""
        self.provisional_tokens += len(tokens)
        self._unreported += len(tokens)
        await self._add_event("provisional", {"delta": delta, "tokens": tokens})

    async def _emit_reconciled(self) -> None:
        """Tell the caller what the target made of a settled provisional tail."""
        outcome = self.drafter.take_reconciled()
        if outcome is None:
            return
        self._provisional_text = None
        self.provisional_kept += outcome.kept
        self.provisional_replaced += len(outcome.replaced)
        log.info(
            "session %s: reconciled %d provisional tokens: %d kept, %d replaced",
            self.session_id,
            outcome.provisional,
            outcome.kept,
            len(outcome.replaced),
        )
        await self._add_event(
            "reconciled",
            {
                "at": outcome.at,  # generated tokens before the first provisional one
                "provisional": outcome.provisional,
                "kept": outcome.kept,
                "replaced": list(outcome.replaced),
                "replaced_text": self.tokenizer.decode(outcome.replaced),
                "text": self.text,  # the committed text so far: every `text` delta joined
            },
        )

    async def _finish(self, status: str, error: str = "") -> None:
        tail = self._detokenizer.flush()
        self.phase = Phase.DONE
        self.status = status
        self.error = error
        self.ended_at = time.monotonic()
        async with self._changed:
            if tail:
                self._chunks.append(tail)
                self._events.append(StreamEvent("text", {"delta": tail}))
            self._done.set()
            self._changed.notify_all()

    def _journal(self) -> None:
        self.book.record(self)

    async def _drafting(self, work: Callable[[], T]) -> T:
        """Run drafter work: on the drafting thread for neural drafts, inline for copying ones."""
        await self._settle()
        drafter = self.drafter
        if self.book.threaded(drafter.draft_model, drafter.next_draft_model):
            return await asyncio.get_running_loop().run_in_executor(self.book.executor, work)
        return work()

    async def _settle(self) -> None:
        """Wait for a proactive draft still running, so the drafter is ours alone again."""
        speculating, self._speculating = self._speculating, None
        if speculating is not None:
            try:
                await asyncio.shield(speculating)
            except Exception as exc:
                log.warning("session %s: proactive drafting failed: %s", self.session_id, exc)

    async def _send_window(self, *, direct: bool = False) -> None:
        """Publish the window in flight: on the direct topic when `direct` (a new window after a
        direct verdict), else on the draft topic (resends too, which the coordinator hears)."""
        await self._settle()
        window = self.drafter.in_flight
        assert window is not None
        # The coordinator records the downlink of the round before on that round.
        downlink = self._downlink
        downlink_ms = downlink[1] if downlink and downlink[0] == window.round - 1 else None
        self._sent_at = time.perf_counter()
        message = window.message(self.session_id, time.time(), downlink_ms)
        note = self._drafter_note(window.draft_model)
        if note:
            message = message.model_copy(update={"drafter_note": note[:256]})
        self._sent_direct = direct and self.book.direct and not message.cloud
        channel = DeviceChannel.DIRECT if self._sent_direct else DeviceChannel.DRAFT
        self._published = await self.book.publish(channel, message)
        # A window sent again keeps the next one already drafted for it.
        if (
            not self._published
            or not self.drafter.proactive
            or self.drafter.has_speculation
            or window.provisional
        ):
            return
        if self.book.threaded(self.drafter.draft_model, self.drafter.next_draft_model):
            loop = asyncio.get_running_loop()
            self._speculating = loop.run_in_executor(self.book.executor, self.drafter.speculate)
        else:
            self.drafter.speculate()

    def _drafter_note(self, drafted_by: str) -> str | None:
        """Why a window came from a stand-in's fallback (memory, a draft being fetched)."""
        proposer = self.drafter.proposer
        if drafted_by == self.drafter.draft_model or not isinstance(proposer, StandInProposer):
            return None
        return proposer.note

    async def _next_round(self) -> None:
        await self._drafting(self.drafter.draft)
        self._refusals = 0
        await self._send_window(direct=self._direct)

    async def _open(self, reason: m.ResumeReason | None = None) -> None:
        """Publish the session's open; a reason says why it is sent again, and a spell of local
        mode the coordinator has not heard of yet goes with it."""
        reason = self._resume_reason or reason
        update: dict[str, Any] = {}
        if reason is not None:
            update["resume"] = reason
        if not self.book.catalog.has(self.spec.draft_model):
            update["draft_missing"] = True  # drafts on demand: the coordinator may send it
        if self._report is not Report.NONE:
            update["fallback"] = m.Fallback(
                provisional_tokens=min(self._unreported, m.MAX_DRAFT_TOKENS),
                offline_s=max(0.0, time.time() - self._offline_since),
            )
        published = await self.book.publish(
            DeviceChannel.SESSION, self.spec.open_message().model_copy(update=update)
        )
        if published:
            self._resume_reason = None
            if self._report is Report.DUE:
                self._report = Report.SENT

    def _retry_s(self) -> float:
        """How long the answer the phase waits for may take before the request goes again."""
        if self.phase is Phase.AWAITING_STATE:
            return OPEN_TIMEOUT_S
        return self.book.settings.round_timeout_s

    def _fallback_after_s(self) -> float:
        """How long a silence starts local mode: fallback_after_s, and FIRST_VERDICT_GRACE
        times that while one of the first GRACE_VERDICTS verdicts, which wait on the prompt's
        prefill and on those of the sessions opened with it, is due from a coordinator that
        confirmed the session, over a link that is up."""
        fallback = self.book.settings.fallback_after_s
        if self._confirmed and self._verdicts < GRACE_VERDICTS and self.book.bus_up:
            return fallback * FIRST_VERDICT_GRACE
        return fallback

    def _wait_s(self, retry_at: float) -> float:
        """How long to wait for the next message before acting on our own."""
        if self.local and self.drafter.can_generate_locally:
            return 0.0
        now = time.monotonic()
        wait = retry_at - now
        if self._fallback_after_s() > 0 and not self.local:
            wait = min(wait, self._heard_at + self._fallback_after_s() - now)
        return max(0.0, wait)

    async def _receive(self, wait_s: float) -> tuple[float, Inbound] | None:
        if not self.inbox.empty():
            return self.inbox.get_nowait()
        if wait_s <= 0:
            return None
        # A deadline on this task, not `wait_for`, whose get() is a task of its own: two more
        # event-loop turns between a verdict's arrival and its session's turn.
        try:
            async with timeout(wait_s):
                return await self.inbox.get()
        except TimeoutError:
            return None

    async def _enter_local(self) -> None:
        """Nothing heard for fallback_after_s: generate alone, marking the text provisional."""
        await self._settle()
        self.local = True
        self.fallbacks += 1
        if self._report is Report.NONE:
            self._offline_since = time.time() - (time.monotonic() - self._heard_at)
            self._report = Report.DUE
        tokens = self.drafter.start_local()
        spell = self.drafter.spell
        if spell is not None and not spell.since:
            spell.since = self._offline_since
        log.warning(
            "session %s: nothing from the coordinator for %.1fs; generating alone (provisional)",
            self.session_id,
            time.monotonic() - self._heard_at,
        )
        if tokens:
            await self._emit_provisional(tokens)
        self._journal()

    async def _generate_locally(self) -> None:
        step = functools.partial(self.drafter.generate_locally, LOCAL_STEP_TOKENS)
        tokens = await self._drafting(step)
        if tokens:
            await self._emit_provisional(tokens)
            self._journal()
        if not self.drafter.can_generate_locally:
            log.info(
                "session %s: %d provisional tokens; waiting for the link",
                self.session_id,
                len(self.drafter.provisional),
            )

    async def _run(self) -> None:
        timeouts = 0
        settings = self.book.settings
        try:
            if self.resumed:  # the stream starts over: what the journal holds comes first
                await self._emit(self.drafter.generated)
                if self.drafter.provisional:
                    await self._emit_provisional(list(self.drafter.provisional))
            await self._open()
            self._journal()
            # The first window is drafted while the open travels; it goes out once the state
            # confirms that nothing is committed yet.
            await self._drafting(self.drafter.draft)
            self.status = "active"
            self.phase = Phase.AWAITING_STATE
            self._heard_at = time.monotonic()
            retry_at = self._heard_at + OPEN_TIMEOUT_S
            while not self.drafter.finished:
                if self.local and self.drafter.can_generate_locally:
                    await self._generate_locally()
                received = await self._receive(self._wait_s(retry_at))
                if received is None:
                    now = time.monotonic()
                    fallback = self._fallback_after_s()
                    if not self.local and fallback > 0 and now >= self._heard_at + fallback:
                        await self._enter_local()
                    if now < retry_at:
                        continue
                    retry_at = now + self._retry_s()
                    if not self.book.bus_up:
                        continue  # nothing goes out while the link is down; its return resyncs
                    timeouts += 1
                    if timeouts > settings.round_retries:
                        reason = f"no answer from the coordinator after {timeouts} tries"
                        raise SessionError(reason) from None
                    if (
                        self.phase is Phase.AWAITING_STATE
                        or self.drafter.in_flight is None
                        or self.local
                    ):
                        log.info("session %s: no state yet; opening again", self.session_id)
                        self.phase = Phase.AWAITING_STATE
                        await self._open(m.ResumeReason.RETRY)
                    else:
                        log.info("session %s: no verdict yet; sending again", self.session_id)
                        if self._sent_direct:
                            self.book.direct_unanswered()
                        await self._send_window()
                    continue
                arrived, message = received
                timeouts = 0
                if isinstance(message, _Reconnected):
                    # The link is back: stop generating alone and ask for the state, which the
                    # coordinator gets fallback_after_s to send before local mode resumes.
                    self.phase = Phase.AWAITING_STATE
                    self.local = False
                    self._heard_at = time.monotonic()
                    await self._open(m.ResumeReason.RECONNECT)
                    retry_at = self._heard_at + OPEN_TIMEOUT_S
                    continue
                self._heard_at = time.monotonic()
                if self.local:
                    log.info("session %s: the coordinator answers again", self.session_id)
                    self.local = False
                if isinstance(message, m.SessionState):
                    self._confirmed = True
                    self.phase = Phase.AWAITING_VERDICT
                    if self._report is Report.SENT:
                        self._report = Report.NONE
                        self._unreported = 0
                    await self._on_state(message)
                elif isinstance(message, m.Verdict):
                    self._verdicts += 1
                    if not await self._on_verdict(message, arrived):
                        self.phase = Phase.AWAITING_STATE
                        await self._open(m.ResumeReason.RESYNC)
                    elif self._report is Report.DUE:
                        await self._open(m.ResumeReason.FALLBACK)
                else:
                    self._on_error(message)
                retry_at = time.monotonic() + self._retry_s()
            await self._finish(self.drafter.status)
        except asyncio.CancelledError:
            await self._settle()
            reason = self._close_reason or "cancelled"
            await self.book.publish(
                DeviceChannel.SESSION, m.SessionClose(session_id=self.session_id, reason=reason)
            )
            await self._finish("cancelled", reason)
            raise
        except (SessionError, OutOfSync, CatalogError, m.BusError) as exc:
            log.warning("session %s failed: %s", self.session_id, exc)
            await self._settle()
            await self._finish("failed", str(exc))
        except Exception as exc:
            log.exception("session %s crashed", self.session_id)
            await self._settle()
            await self._finish("failed", f"{type(exc).__name__}: {exc}")
        finally:
            self.book._ended(self)

    async def _on_state(self, state: m.SessionState) -> None:
        self._direct = False  # the coordinator speaks for the session again
        await self._settle()
        window = self.drafter.in_flight
        outcome = self.drafter.resync(state)
        if outcome.new_tokens or outcome.rewound:
            self.resyncs += 1
            if outcome.rewound:
                log.error(
                    "session %s: the coordinator's state drops tokens this agent committed",
                    self.session_id,
                )
            await self._emit(outcome.new_tokens, outcome.rewound)
        await self._emit_reconciled()
        if self.drafter.finished:
            return
        if outcome.in_sync and window is not None and not self.drafter.tail_unsent:
            if state.streaming and self.drafter.mode in m.HOST_MODES and not window.provisional:
                # The coordinator runs the session's host stream: started at the open (this
                # agent awaits it), or running when a request went again. Its verdicts are on
                # their way; a request would only be answered with this state again.
                if self._first_window_for_the_host(window):
                    await self._drafting(self.drafter.draft)  # a host window for the empty one
                self._refusals = 0
                self._sent_at = time.perf_counter()
                self._published = True
                self._journal()
                return
            if self._first_window_for_the_host(window):
                # The state opens the session on the verifier host: a request in place of the
                # empty window starts its host stream at this round, the prompt's prefill in
                # its first pass, with no device round and no bus round trip before it (in a
                # wave of 32 the streams had joined 0.5 s after the prefills, in passes of 1-2
                # rows).
                await self._next_round()
                self._journal()
                return
            # The window may have been lost with a coordinator that restarted, or with our own
            # link: send it again. A round is idempotent, so at worst its verdict comes twice.
            await self._send_window()
            return
        # A provisional tail goes out now as one draft of this round (a window of the same
        # round in flight is a prefix of it, so that window's verdict fits the tail too).
        await self._next_round()
        self._journal()

    def _first_window_for_the_host(self, window: DraftWindow) -> bool:
        """Whether `window` is the empty device window drafted while the open travelled, never
        sent, and the state has put the session in a host mode."""
        return (
            not self._published
            and window.cloud_k is None
            and not window.tokens
            and not window.provisional
            and self.drafter.mode in m.HOST_MODES
        )

    async def _on_verdict(self, verdict: m.Verdict, arrived: float) -> bool:
        """Apply a verdict; False when it does not fit and the state must be asked for."""
        waited_ms = (arrived - self._sent_at) * 1e3
        await self._settle()
        try:
            new_tokens = self.drafter.apply_verdict(verdict)
        except OutOfSync as exc:
            log.warning("session %s: %s; resynchronising", self.session_id, exc)
            return False
        if new_tokens is None:
            log.debug("session %s: stale verdict of round %d", self.session_id, verdict.round)
            return True
        self._direct = verdict.direct
        if verdict.sent_at:
            arrived_at = time.time() - (time.perf_counter() - arrived)  # on the unix clock
            self._downlink = (verdict.round, max(0.0, (arrived_at - verdict.sent_at) * 1e3))
        await self._emit(new_tokens)
        await self._emit_reconciled()
        self.wait_ms.append(waited_ms)
        if not self.drafter.finished and self.drafter.in_flight is not None:
            self._sent_at = arrived  # cloud mode: the coordinator streams the next round itself
        elif not self.drafter.finished:
            await self._next_round()
            self.turnaround_ms.append((self._sent_at - arrived) * 1e3)
        self._journal()  # while the next window is on its way
        return True

    def _on_error(self, error: m.ErrorReply) -> None:
        self._direct = False
        if error.refused_type is m.Refused.SESSION_OPEN:
            raise SessionError(f"the coordinator refused the session: {error.reason}")
        window = self.drafter.in_flight
        log.warning(
            "session %s: the coordinator refused our %s of round %s: %s",
            self.session_id,
            error.refused_type,
            error.round,
            error.reason,
        )
        if window is not None and error.round == window.round:
            self._refusals += 1
            if self._refusals > MAX_REFUSALS:
                raise SessionError(f"round {window.round} refused: {error.reason}")
        # The SessionState that follows an error reply resynchronises the session.


class SessionBook:
    """The sessions of one agent, by id; routes verdict-topic messages to them."""

    def __init__(
        self,
        settings: LocalSettings,
        catalog: DrafterCatalog,
        publish: Publish,
        executor: Executor,
        *,
        connected: asyncio.Event | None = None,
        journal: SessionJournal | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.publish = publish
        self.executor = executor
        self.connected = connected
        self.journal = journal
        self._sessions: dict[str, AgentSession] = {}
        self._recent: dict[str, AgentSession] = {}
        # Whether a session may name a draft this device lacks (drafts on demand: signed
        # releases can be installed here); the agent sets it.
        self.on_demand = False
        # Whether windows after a direct verdict go on the direct topic: until one goes
        # unanswered (a broker whose ACL predates that topic drops it), then never again here.
        self.direct = True

    def direct_unanswered(self) -> None:
        if self.direct:
            log.warning(
                "a window sent on the direct topic went unanswered: this agent sends its drafts "
                "on the draft topic from now on (does the broker's ACL let it write %s?)",
                DeviceChannel.DIRECT.value,
            )
        self.direct = False

    @property
    def bus_up(self) -> bool:
        return self.connected is None or self.connected.is_set()

    def threaded(self, *draft_models: str) -> bool:
        return any(self.catalog.is_neural(name) for name in draft_models)

    @property
    def active(self) -> list[AgentSession]:
        return list(self._sessions.values())

    @property
    def recent(self) -> list[AgentSession]:
        """Sessions that ended lately, oldest first."""
        return list(self._recent.values())

    def get(self, session_id: str) -> AgentSession | None:
        return self._sessions.get(session_id) or self._recent.get(session_id)

    def _spec(self, request: SessionRequest, session_id: str) -> SessionSpec:
        draft = request.draft or self.settings.default_draft
        if not self.catalog.has(draft) and not (self.on_demand and _on_demand_name(draft)):
            raise SessionError(
                f"unknown drafter {draft!r}; this device has: {', '.join(self.catalog.names())}"
            )
        k = request.k
        if k is None:
            k = self.settings.default_k
        if k is None:
            k = self.catalog.default_k(draft)
        tokenizer = self.catalog.tokenizer()
        prompt_ids = tokenizer.apply_chat_template(request.prompt)
        sampling = m.SamplingSpec(
            temperature=request.temperature, top_p=request.top_p, seed=request.seed
        )
        try:
            spec = SessionSpec(
                session_id=session_id,
                prompt=request.prompt,
                prompt_ids=tuple(prompt_ids),
                task_type=request.task_type,
                sampling=sampling,
                max_tokens=request.max_tokens or self.settings.default_max_tokens,
                draft_model=draft,
                k=k,
                mode=m.Mode(request.mode),
                vocab=tokenizer.vocab_sha256,
            )
            spec.open_message()  # the bus contract's own limits (prompt length, ...)
        except ValidationError as exc:
            raise SessionError(validation_reason(exc)) from None
        return spec

    async def start(self, request: SessionRequest, session_id: str | None = None) -> AgentSession:
        """Open a session and run it; raises SessionError when it cannot start."""
        session_id = session_id or str(uuid.uuid4())
        if session_id in self._sessions:
            raise SessionError(f"session {session_id} is already running")
        loop = asyncio.get_running_loop()
        try:
            # The prompt's ids, the tokenizer and the drafter (each may load from disk) in one
            # hop to the drafting thread. Opens that come together queue there: with a hop each,
            # a wave's first open waited behind the others' prompts (its open left ~14 ms into a
            # wave of 4 sessions an agent, where its own work took ~1 ms).
            spec, tokenizer, proposer = await loop.run_in_executor(
                self.executor, self._opening, request, session_id
            )
        except CatalogError as exc:
            raise SessionError(str(exc)) from None
        proactive = self.settings.proactive if request.proactive is None else request.proactive
        session = self._new_session(spec, proactive, tokenizer, proposer)
        session._start()
        return session

    def _opening(
        self, request: SessionRequest, session_id: str
    ) -> tuple[SessionSpec, ChatTokenizer, Proposer]:
        """A new session's spec, tokenizer and drafter; runs on the drafting thread."""
        spec = self._spec(request, session_id)
        return (spec, *self._parts(spec))

    def _parts(self, spec: SessionSpec) -> tuple[ChatTokenizer, Proposer]:
        """A session's tokenizer and drafter (each may load from disk); runs on the drafting
        thread."""
        proposer = self._acquire(spec.draft_model, spec.sampling.temperature, None)
        return self.catalog.tokenizer(), proposer

    async def _session(self, spec: SessionSpec, proactive: bool, **state: Any) -> AgentSession:
        """A session with its own drafter; `state` restores the drafter's (from the journal)."""
        loop = asyncio.get_running_loop()
        try:
            # A drafter may load from disk: off the loop.
            tokenizer, proposer = await loop.run_in_executor(self.executor, self._parts, spec)
        except CatalogError as exc:
            raise SessionError(str(exc)) from None
        return self._new_session(spec, proactive, tokenizer, proposer, **state)

    def _new_session(
        self,
        spec: SessionSpec,
        proactive: bool,
        tokenizer: ChatTokenizer,
        proposer: Proposer,
        **state: Any,
    ) -> AgentSession:
        temperature = spec.sampling.temperature

        def swap(old: Proposer, name: str) -> Proposer | None:
            if not self.catalog.has(name) and not self.on_demand:
                return None
            new = self._acquire(name, temperature, old)
            if not (isinstance(new, StandInProposer) and new.fallback is old):
                self.catalog.release(drafter.draft_model, temperature, old)
            return new

        drafter = SessionDrafter(
            spec=spec,
            proposer=proposer,
            eos_id=tokenizer.eos_id,
            proactive=proactive,
            swap_proposer=swap,
            **state,
        )
        session = AgentSession(self, spec, drafter, tokenizer)
        self._sessions[spec.session_id] = session
        return session

    def _acquire(self, name: str, temperature: float, current: Proposer | None) -> Proposer:
        """The drafter `name` for a session; where it cannot run yet (not on this device, or
        too big for the memory free now), a stand-in that drafts with `current` (or the copying
        fallback) until it can. Runs on the drafting thread: a load may take a while."""
        if not self.catalog.has(name):
            log.info("drafter %s is not on this device: drafting without it until it is", name)
            return self.catalog.stand_in(name, temperature, current, fetching=True)
        try:
            return self.catalog.acquire(name, temperature)
        except MemoryRefused as exc:
            log.warning("%s; drafting without it while it does not fit", exc)
            return self.catalog.stand_in(name, temperature, current)

    async def resume_journal(self) -> list[AgentSession]:
        """Resume every session the journal holds: this agent restarted while they ran."""
        if self.journal is None:
            return []
        resumed = []
        for entry in self.journal.open_sessions():
            session_id = entry.spec.session_id
            if session_id in self._sessions:
                continue
            try:
                session = await self._session(entry.spec, entry.proactive, **_drafter_state(entry))
            except SessionError as exc:
                log.error("session %s cannot resume: %s; dropped", session_id, exc)
                self.journal.forget(session_id)
                continue
            session.resume_after_restart(entry.spell)
            log.info(
                "session %s resumed from the journal: %d tokens committed, %d provisional",
                session_id,
                len(entry.generated),
                len(entry.provisional),
            )
            resumed.append(session)
        return resumed

    def record(self, session: AgentSession) -> None:
        """Write a session's progress to the journal; a failing journal never stops it."""
        if self.journal is None or session.done:
            return
        try:
            self.journal.record(session.drafter, "local" if session.local else "active")
        except sqlite3.Error as exc:
            log.error("journal: cannot record session %s: %s", session.session_id, exc)

    def dispatch(self, message: m.Verdict | m.SessionState | m.ErrorReply) -> bool:
        """Hand a verdict-topic message to its session; False when no session here owns it."""
        session = self._sessions.get(message.session_id or "")
        if session is None:
            return False
        session.inbox.put_nowait((time.perf_counter(), message))
        return True

    def reconnected(self) -> None:
        """The bus is back: every running session asks for its state again."""
        for session in self._sessions.values():
            session.inbox.put_nowait((time.perf_counter(), _Reconnected()))

    async def cancel(self, session_id: str, reason: str = "cancelled") -> bool:
        session = self._sessions.get(session_id)
        if session is None:
            return False
        await session.cancel(reason)
        return True

    async def aclose(self, reason: str = "agent stopped") -> None:
        """Cancel every running session (each sends its SessionClose while the bus is up)."""
        for session in list(self._sessions.values()):
            await session.cancel(reason)

    def _ended(self, session: AgentSession) -> None:
        self._sessions.pop(session.session_id, None)
        if self.journal is not None:
            try:
                self.journal.forget(session.session_id)
            except sqlite3.Error as exc:
                log.error("journal: cannot drop session %s: %s", session.session_id, exc)
        self._recent[session.session_id] = session
        while len(self._recent) > RECENT_SESSIONS:
            self._recent.pop(next(iter(self._recent)))
        drafter = session.drafter
        temperature = session.spec.sampling.temperature

        def release() -> None:
            try:
                self.catalog.release(drafter.draft_model, temperature, drafter.proposer)
            except Exception:  # on the drafting thread nobody awaits it: log it here
                log.exception("could not take back the drafter of %s", session.session_id)

        # A cancelled session may leave a draft running on the drafting thread; queued behind
        # it, the drafter goes back only once nothing can still be using it.
        try:
            self.executor.submit(release)
        except RuntimeError:  # the executor has shut down: no draft can be running
            release()


def _on_demand_name(name: str) -> bool:
    """Whether a drafter name could come as a release: a model name, alone or behind hybrid+."""
    model = name.removeprefix(HYBRID_PREFIX)
    return model not in BUILTIN_DRAFTERS and _MODEL_NAME.fullmatch(model) is not None


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def _drafter_state(entry: JournalEntry) -> dict[str, Any]:
    """A journal entry as `SessionDrafter` fields."""
    return {
        "committed": [*entry.spec.prompt_ids, *entry.generated],
        "round": entry.next_round,
        "provisional": list(entry.provisional),
        "provisional_q": list(entry.provisional_q),
        "spell": entry.spell,
    }
