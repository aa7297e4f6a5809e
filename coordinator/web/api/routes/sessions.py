"""`/sessions`: decoding sessions with their rounds and text; start and cancel through the
coordinator service (see coordinator.live)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import status as http
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from broker.messages import Mode
from broker.topics import DEVICE_ID_PATTERN
from coordinator.db.engine import read_one_snapshot
from coordinator.db.events import append_event
from coordinator.db.models import (
    DecodingSession,
    Device,
    DeviceStatus,
    Round,
    SessionStatus,
)
from coordinator.live import ControlError, SessionStartRequest
from coordinator.replay import (
    ReplayStep,
    ReplayToken,
    SessionRecord,
    TokenKind,
    rebuild,
    round_delays,
)
from coordinator.web.api.deps import ControlDep, CurrentAdmin, SessionDep, TokenDecoderDep
from coordinator.web.api.paging import Skip
from coordinator.web.api.schemas import (
    RoundPublic,
    RoundsPublic,
    SessionCancel,
    SessionDetailPublic,
    SessionPublic,
    SessionsPublic,
    SessionStart,
    SessionStarted,
    SessionStatsPublic,
    TokenPublic,
)

MAX_PAGE = 1000
SESSION_START_REQUESTED = "session.start_requested"
SESSION_CANCEL_REQUESTED = "session.cancel_requested"
TERMINAL = frozenset({SessionStatus.FINISHED, SessionStatus.FAILED, SessionStatus.CANCELLED})

router = APIRouter(prefix="/sessions", tags=["sessions"])


def as_utc(at: datetime | None) -> datetime | None:
    """Query times without a zone are taken as UTC (the database compares aware times)."""
    if at is None:
        return None
    return at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at.astimezone(timezone.utc)


def _aggregates() -> sa.Subquery:
    return (
        sa.select(
            Round.session_id,
            sa.func.count().label("rounds"),
            sa.func.coalesce(sa.func.sum(Round.k), 0).label("drafted"),
            sa.func.coalesce(sa.func.sum(Round.n_accepted), 0).label("accepted"),
        )
        .group_by(Round.session_id)
        .subquery()
    )


def session_public(row: DecodingSession, rounds: int, drafted: int, accepted: int) -> SessionPublic:
    prompt_len = len(row.prompt_ids)
    return SessionPublic(
        id=row.id,
        device_id=row.device_id,
        task_type=row.task_type,
        prompt=row.prompt,
        mode=row.mode,
        status=row.status,
        draft_model=row.draft_model,
        k=row.k,
        temperature=row.temperature,
        top_p=row.top_p,
        seed=row.seed,
        max_tokens=row.max_tokens,
        prompt_len=prompt_len,
        committed_len=row.committed_len,
        generated_len=max(0, row.committed_len - prompt_len),
        rounds=rounds,
        drafted=drafted,
        accepted=accepted,
        alpha=accepted / drafted if drafted else None,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
    )


@router.get("", response_model=SessionsPublic)
def list_sessions(
    db: SessionDep,
    status: SessionStatus | None = None,
    mode: Mode | None = None,
    device_id: Annotated[str | None, Query(pattern=DEVICE_ID_PATTERN.pattern)] = None,
    task_type: Annotated[str | None, Query(min_length=1, max_length=32)] = None,
    draft_model: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
    since: Annotated[datetime | None, Query(description="created at or after (ISO 8601)")] = None,
    until: Annotated[datetime | None, Query(description="created before (ISO 8601)")] = None,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
) -> SessionsPublic:
    """Newest first; `count` is the unpaged total of the matching sessions."""
    clauses: list[sa.ColumnElement[bool]] = []
    if status is not None:
        clauses.append(DecodingSession.status == status)
    if mode is not None:
        clauses.append(DecodingSession.mode == mode)
    if device_id is not None:
        clauses.append(DecodingSession.device_id == device_id)
    if task_type is not None:
        clauses.append(DecodingSession.task_type == task_type)
    if draft_model is not None:
        clauses.append(DecodingSession.draft_model == draft_model)
    if since is not None:
        clauses.append(DecodingSession.created_at >= as_utc(since))
    if until is not None:
        clauses.append(DecodingSession.created_at < as_utc(until))
    count = db.scalar(sa.select(sa.func.count()).select_from(DecodingSession).where(*clauses))
    agg = _aggregates()
    rows = db.execute(
        sa.select(DecodingSession, agg.c.rounds, agg.c.drafted, agg.c.accepted)
        .outerjoin(agg, agg.c.session_id == DecodingSession.id)
        .where(*clauses)
        .order_by(DecodingSession.created_at.desc(), DecodingSession.id)
        .offset(skip)
        .limit(limit)
    )
    data = [
        session_public(row, int(n or 0), int(drafted or 0), int(accepted or 0))
        for row, n, drafted, accepted in rows
    ]
    return SessionsPublic(data=data, count=count or 0)


def _token(token: ReplayToken) -> TokenPublic:
    return TokenPublic(id=token.token_id, kind=token.kind, text=token.text)


def round_public(step: ReplayStep, delay_s: float) -> RoundPublic:
    rnd = step.round
    return RoundPublic(
        round=rnd.index,
        base_len=rnd.base_len,
        committed_len=rnd.committed_len,
        draft_model=rnd.draft_model,
        k=rnd.k,
        n_accepted=rnd.n_accepted,
        next_token=rnd.next_token,
        provisional=rnd.provisional,
        verifier_id=rnd.verifier_id,
        policy=rnd.policy,
        legs_ms=dict(rnd.legs.items()),
        total_ms=rnd.total_ms,
        created_at=rnd.created_at,
        delay_s=delay_s,
        tokens=[_token(t) for t in step.tokens],
        rejected=[_token(t) for t in step.rejected],
    )


def _load_record(db: SessionDep, session_id: uuid.UUID) -> tuple[DecodingSession, SessionRecord]:
    """The session's row and its record, rounds included, as of one moment (a round committed
    between the two reads would otherwise show in one and not the other)."""
    read_one_snapshot(db)
    row = db.get(DecodingSession, session_id)
    if row is None:
        raise HTTPException(http.HTTP_404_NOT_FOUND, f"no session {session_id}")
    rounds = db.scalars(
        sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
    ).all()
    return row, SessionRecord.from_rows(row, rounds)


@router.get("/{session_id}", response_model=SessionDetailPublic)
def read_session(
    db: SessionDep, decoder: TokenDecoderDep, session_id: uuid.UUID
) -> SessionDetailPublic:
    """The session, its text with each token's provenance, and every round."""
    # One row for all of it: fetched again, it could be newer than the rounds.
    row, record = _load_record(db, session_id)
    result = rebuild(record, decoder)
    kinds = {kind: 0 for kind in TokenKind}
    for step in result.steps:
        for token in step.tokens:
            kinds[token.kind] += 1
    delays = round_delays(result.steps, record.created_at)
    return SessionDetailPublic(
        session=session_public(row, len(result.steps), result.n_drafted, result.n_accepted),
        text=result.text,
        stats=SessionStatsPublic(
            generated=len(result.generated_ids),
            drafted=result.n_drafted,
            accepted=result.n_accepted,
            alpha=result.alpha,
            duration_s=result.duration_s,
            tokens_per_s=result.tokens_per_s,
            kinds=kinds,
        ),
        rounds=[round_public(s, d) for s, d in zip(result.steps, delays, strict=True)],
        rounds_count=len(result.steps),
        problems=list(result.problems),
    )


@router.get("/{session_id}/rounds", response_model=RoundsPublic)
def list_rounds(
    db: SessionDep,
    decoder: TokenDecoderDep,
    session_id: uuid.UUID,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> RoundsPublic:
    """A page of the session's rounds in order, each with its tokens' text."""
    _, record = _load_record(db, session_id)
    result = rebuild(record, decoder)
    delays = round_delays(result.steps, record.created_at)
    pairs = list(zip(result.steps, delays, strict=True))[skip : skip + limit]
    return RoundsPublic(data=[round_public(s, d) for s, d in pairs], count=len(result.steps))


def _check_startable(db: SessionDep, device_id: str) -> None:
    device = db.get(Device, device_id)
    if device is None:
        raise HTTPException(http.HTTP_404_NOT_FOUND, f"no device {device_id!r}")
    if device.status is DeviceStatus.RETIRED:
        raise HTTPException(http.HTTP_409_CONFLICT, f"device {device_id!r} is retired")
    db.rollback()  # end the read transaction before waiting on the service


def _cancellable(db: SessionDep, session_id: uuid.UUID) -> str:
    """The device of a session that may still be cancelled."""
    row = db.get(DecodingSession, session_id)
    if row is None:
        raise HTTPException(http.HTTP_404_NOT_FOUND, f"no session {session_id}")
    if row.status in TERMINAL:
        raise HTTPException(
            http.HTTP_409_CONFLICT, f"session {session_id} has already ended ({row.status.value})"
        )
    device_id = row.device_id
    db.rollback()
    return device_id


def _audit(
    db: SessionDep,
    kind: str,
    *,
    device_id: str,
    session_id: uuid.UUID,
    actor: str,
    detail: dict[str, object],
) -> None:
    with db.begin():
        append_event(
            db, kind, device_id=device_id, session_id=session_id, actor=actor, detail=detail
        )


# The database calls of these two run in the thread pool: the handlers themselves run on the
# event loop, where the coordinator service lives.
@router.post("", response_model=SessionStarted, status_code=http.HTTP_202_ACCEPTED)
async def start_session(
    db: SessionDep, admin: CurrentAdmin, control: ControlDep, body: SessionStart
) -> SessionStarted:
    """Run a prompt on a chosen device; the session appears in the list as it starts."""
    await run_in_threadpool(_check_startable, db, body.device_id)
    request = SessionStartRequest(
        device_id=body.device_id,
        prompt=body.prompt,
        task_type=body.task_type,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        draft_model=body.draft_model,
        k=body.k,
        actor=admin.actor,
    )
    try:
        session_id = await control.start_session(request)
    except ControlError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    detail: dict[str, object] = {
        "task_type": body.task_type,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "draft_model": body.draft_model,
        "k": body.k,
    }
    await run_in_threadpool(
        lambda: _audit(
            db,
            SESSION_START_REQUESTED,
            device_id=body.device_id,
            session_id=session_id,
            actor=admin.actor,
            detail=detail,
        )
    )
    return SessionStarted(id=session_id)


@router.post(
    "/{session_id}/cancel", response_model=SessionStarted, status_code=http.HTTP_202_ACCEPTED
)
async def cancel_session(
    db: SessionDep,
    admin: CurrentAdmin,
    control: ControlDep,
    session_id: uuid.UUID,
    body: SessionCancel | None = None,
) -> SessionStarted:
    """Stop an active or suspended session; 409 once it has ended."""
    reason = (body or SessionCancel()).reason
    device_id = await run_in_threadpool(_cancellable, db, session_id)
    try:
        await control.cancel_session(session_id, reason=reason, actor=admin.actor)
    except ControlError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    await run_in_threadpool(
        lambda: _audit(
            db,
            SESSION_CANCEL_REQUESTED,
            device_id=device_id,
            session_id=session_id,
            actor=admin.actor,
            detail={"reason": reason},
        )
    )
    return SessionStarted(id=session_id)


# The text stream polls the session row this often; the committed tokens only ever grow.
TEXT_POLL_INTERVAL_S = 0.05
TEXT_STREAM_IDLE_S = 600.0


def _committed(
    sessions: sessionmaker[Session], session_id: uuid.UUID
) -> tuple[list[int], SessionStatus] | None:
    with sessions() as db:
        row = db.get(DecodingSession, session_id)
        return None if row is None else (list(row.committed_ids), row.status)


@router.get("/{session_id}/stream", response_class=StreamingResponse)
async def stream_session_text(
    request: Request, decoder: TokenDecoderDep, session_id: uuid.UUID
) -> StreamingResponse:
    """Server-sent events: the session's text as it is committed (`text` events with `delta`
    and `committed`), then one `done` event with the final status. Reading a finished session
    gives its whole text at once."""
    if decoder is None:
        raise HTTPException(http.HTTP_503_SERVICE_UNAVAILABLE, "no target tokenizer is built")
    sessions: sessionmaker[Session] = request.app.state.sessions
    first = await asyncio.to_thread(_committed, sessions, session_id)
    if first is None:
        raise HTTPException(http.HTTP_404_NOT_FOUND, f"no session {session_id}")
    active = (SessionStatus.ACTIVE, SessionStatus.SUSPENDED)

    async def frames() -> AsyncIterator[str]:
        detokenizer = decoder.detokenizer()
        sent = 0
        last_change = time.monotonic()
        snapshot: tuple[list[int], SessionStatus] | None = first
        while snapshot is not None:
            ids, status = snapshot
            if len(ids) > sent:
                delta = detokenizer.push(ids[sent:])
                sent = len(ids)
                last_change = time.monotonic()
                payload = json.dumps({"delta": delta, "committed": sent})
                yield f"event: text\ndata: {payload}\n\n"
            if status not in active:
                tail = detokenizer.flush()
                if tail:
                    yield f"event: text\ndata: {json.dumps({'delta': tail, 'committed': sent})}\n\n"
                done = json.dumps({"status": status.value, "tokens": sent})
                yield f"event: done\ndata: {done}\n\n"
                return
            if await request.is_disconnected():
                return
            if time.monotonic() - last_change > TEXT_STREAM_IDLE_S:
                yield 'event: done\ndata: {"status": "idle"}\n\n'
                return
            await asyncio.sleep(TEXT_POLL_INTERVAL_S)
            snapshot = await asyncio.to_thread(_committed, sessions, session_id)

    return StreamingResponse(
        frames(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
