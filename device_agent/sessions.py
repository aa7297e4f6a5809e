"""Decoding sessions on the bus: each session's rounds, resynchronisation and streamed text.

A `SessionBook` belongs to one agent. `start` opens a session (`SessionOpen` on
`dev/{id}/session`) and runs its rounds in a task of its own: draft, publish the `Draft`, apply the
`Verdict`, draft the next window, until the coordinator says the session has finished. Messages
from the device's verdict topic reach their session through `dispatch`. Callers read the committed
text as it grows through `AgentSession.text_deltas()` and the final `SessionSummary` from `wait()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from broker import messages as m
from broker.topics import DeviceChannel
from device_agent.catalog import CatalogError, DrafterCatalog
from device_agent.drafting import OutOfSync, SessionDrafter, SessionSpec
from device_agent.settings import LocalSettings
from inference.proposers import Proposer
from inference.tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger(__name__)

# Module-level so tests can shrink them.
OPEN_TIMEOUT_S = 10.0  # a SessionOpen with no SessionState after this long is sent again
MAX_REFUSALS = 3  # drafts of one round refused this often fail the session
RECENT_SESSIONS = 32  # finished sessions kept for the local API to read back

Publish = Callable[[DeviceChannel, m.Message], Awaitable[bool]]
T = TypeVar("T")


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

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


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
        self._changed = asyncio.Condition()
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._speculating: asyncio.Future[bool] | None = None
        self._published = False  # whether the window in flight went out
        self._sent_at = 0.0  # perf_counter when the window in flight went out
        self._downlink: tuple[int, float] | None = None  # (round, ms) of the last verdict applied
        self.wait_ms: list[float] = []
        self.turnaround_ms: list[float] = []
        self._refusals = 0
        self._close_reason = ""

    # -- reading the session -------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    async def text_deltas(self) -> AsyncIterator[str]:
        """The committed text in pieces as it grows, from the start; ends with the session."""
        index = 0
        while True:
            async with self._changed:
                while index >= len(self._chunks) and not self.done:
                    await self._changed.wait()
                chunks = self._chunks[index:]
                finished = self.done
            index += len(chunks)
            for chunk in chunks:
                yield chunk
            if finished and index >= len(self._chunks):
                return

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
                self._changed.notify_all()

    async def _finish(self, status: str, error: str = "") -> None:
        tail = self._detokenizer.flush()
        self.status = status
        self.error = error
        self.ended_at = time.monotonic()
        async with self._changed:
            if tail:
                self._chunks.append(tail)
            self._done.set()
            self._changed.notify_all()

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

    async def _send_window(self) -> None:
        await self._settle()
        window = self.drafter.in_flight
        assert window is not None
        # The coordinator records the downlink of the round before on that round.
        downlink = self._downlink
        downlink_ms = downlink[1] if downlink and downlink[0] == window.round - 1 else None
        self._sent_at = time.perf_counter()
        self._published = await self.book.publish(
            DeviceChannel.DRAFT, window.message(self.session_id, time.time(), downlink_ms)
        )
        # A window sent again keeps the next one already drafted for it.
        if not self._published or not self.drafter.proactive or self.drafter.has_speculation:
            return
        if self.book.threaded(self.drafter.draft_model, self.drafter.next_draft_model):
            loop = asyncio.get_running_loop()
            self._speculating = loop.run_in_executor(self.book.executor, self.drafter.speculate)
        else:
            self.drafter.speculate()

    async def _next_round(self) -> None:
        await self._drafting(self.drafter.draft)
        self._refusals = 0
        await self._send_window()

    async def _run(self) -> None:
        timeouts = 0
        awaiting_state = True
        try:
            await self.book.publish(DeviceChannel.SESSION, self.spec.open_message())
            # The first window is drafted while the open travels; it goes out once the state
            # confirms that nothing is committed yet.
            await self._drafting(self.drafter.draft)
            self.status = "active"
            while not self.drafter.finished:
                timeout = OPEN_TIMEOUT_S if awaiting_state else self.book.settings.round_timeout_s
                try:
                    arrived, message = await asyncio.wait_for(self.inbox.get(), timeout)
                except asyncio.TimeoutError:
                    timeouts += 1
                    if timeouts > self.book.settings.round_retries:
                        reason = f"no answer from the coordinator after {timeouts} tries"
                        raise SessionError(reason) from None
                    if awaiting_state or self.drafter.in_flight is None:
                        log.info("session %s: no state yet; opening again", self.session_id)
                        await self.book.publish(DeviceChannel.SESSION, self.spec.open_message())
                    else:
                        log.info("session %s: no verdict yet; sending again", self.session_id)
                        await self._send_window()
                    continue
                timeouts = 0
                if isinstance(message, _Reconnected):
                    awaiting_state = True
                    await self.book.publish(DeviceChannel.SESSION, self.spec.open_message())
                elif isinstance(message, m.SessionState):
                    awaiting_state = False
                    await self._on_state(message)
                elif isinstance(message, m.Verdict):
                    if not await self._on_verdict(message, arrived):
                        awaiting_state = True
                        await self.book.publish(DeviceChannel.SESSION, self.spec.open_message())
                else:
                    self._on_error(message)
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
        if self.drafter.finished:
            return
        if outcome.in_sync and window is not None:
            # The window may have been lost with a coordinator that restarted, or with our own
            # link: send it again. A round is idempotent, so at worst its verdict comes twice.
            await self._send_window()
            return
        await self._next_round()

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
        if verdict.sent_at:
            arrived_at = time.time() - (time.perf_counter() - arrived)  # on the unix clock
            self._downlink = (verdict.round, max(0.0, (arrived_at - verdict.sent_at) * 1e3))
        await self._emit(new_tokens)
        self.wait_ms.append(waited_ms)
        if not self.drafter.finished:
            await self._next_round()
            self.turnaround_ms.append((self._sent_at - arrived) * 1e3)
        return True

    def _on_error(self, error: m.ErrorReply) -> None:
        if error.refused_type == m.SessionOpen.model_fields["type"].default:
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
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.publish = publish
        self.executor = executor
        self._sessions: dict[str, AgentSession] = {}
        self._recent: dict[str, AgentSession] = {}

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

    def _spec(self, request: SessionRequest, session_id: str) -> tuple[SessionSpec, int]:
        draft = request.draft or self.settings.default_draft
        if not self.catalog.has(draft):
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
            )
            spec.open_message()  # the bus contract's own limits (prompt length, ...)
        except ValidationError as exc:
            raise SessionError(validation_reason(exc)) from None
        return spec, tokenizer.eos_id

    async def start(self, request: SessionRequest, session_id: str | None = None) -> AgentSession:
        """Open a session and run it; raises SessionError when it cannot start."""
        session_id = session_id or str(uuid.uuid4())
        if session_id in self._sessions:
            raise SessionError(f"session {session_id} is already running")
        loop = asyncio.get_running_loop()
        try:
            # Tokenizer and drafter may load from disk on first use: off the loop.
            spec, eos_id = await loop.run_in_executor(
                self.executor, self._spec, request, session_id
            )
            temperature = spec.sampling.temperature
            proposer = await loop.run_in_executor(
                self.executor, self.catalog.acquire, spec.draft_model, temperature
            )
        except CatalogError as exc:
            raise SessionError(str(exc)) from None

        def swap(old: Proposer, name: str) -> Proposer | None:
            if not self.catalog.has(name):
                return None
            new = self.catalog.acquire(name, temperature)
            self.catalog.release(drafter.draft_model, temperature, old)
            return new

        drafter = SessionDrafter(
            spec=spec,
            proposer=proposer,
            eos_id=eos_id,
            proactive=self.settings.proactive if request.proactive is None else request.proactive,
            swap_proposer=swap,
        )
        session = AgentSession(self, spec, drafter, self.catalog.tokenizer())
        self._sessions[session_id] = session
        session._start()
        return session

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
