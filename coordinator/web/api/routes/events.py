"""`/events`: the audit log, paged and filtered, and a live tail as server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker

from broker.topics import DEVICE_ID_PATTERN
from coordinator.db.models import Event
from coordinator.web.api.deps import SessionDep
from coordinator.web.api.paging import MAX_ROW_ID, AfterId, Skip
from coordinator.web.api.routes.sessions import as_utc
from coordinator.web.api.schemas import EventPublic, EventsPublic

MAX_PAGE = 1000
KIND_PATTERN = r"^[a-z0-9_.]{1,64}$"
# The tail polls the table this often; a stream ends after STREAM_LIFETIME_S and the browser's
# EventSource reconnects with Last-Event-ID, so no stream outlives a server shutdown for long.
POLL_INTERVAL_S = 0.5
STREAM_LIFETIME_S = 15.0
KEEPALIVE_S = 10.0
RECONNECT_MS = 1000

router = APIRouter(prefix="/events", tags=["events"])


def _filters(
    kind: str | None,
    device_id: str | None,
    session_id: uuid.UUID | None,
    actor: str | None,
    since: datetime | None,
    until: datetime | None,
) -> list[sa.ColumnElement[bool]]:
    clauses: list[sa.ColumnElement[bool]] = []
    if kind is not None:
        # "device." matches every device event; a full kind matches itself.
        clauses.append(Event.kind.startswith(kind) if kind.endswith(".") else Event.kind == kind)
    if device_id is not None:
        clauses.append(Event.device_id == device_id)
    if session_id is not None:
        clauses.append(Event.session_id == session_id)
    if actor is not None:
        clauses.append(Event.actor == actor)
    if since is not None:
        clauses.append(Event.at >= as_utc(since))
    if until is not None:
        clauses.append(Event.at < as_utc(until))
    return clauses


KindQuery = Annotated[
    str | None,
    Query(pattern=KIND_PATTERN, description="a kind, or a prefix ending in '.' (device.)"),
]
DeviceQuery = Annotated[str | None, Query(pattern=DEVICE_ID_PATTERN.pattern)]
ActorQuery = Annotated[str | None, Query(min_length=1, max_length=64)]


@router.get("", response_model=EventsPublic)
def list_events(
    db: SessionDep,
    kind: KindQuery = None,
    device_id: DeviceQuery = None,
    session_id: uuid.UUID | None = None,
    actor: ActorQuery = None,
    since: datetime | None = None,
    until: datetime | None = None,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> EventsPublic:
    """Newest first; `count` is the unpaged total of the matching events."""
    clauses = _filters(kind, device_id, session_id, actor, since, until)
    count = db.scalar(sa.select(sa.func.count()).select_from(Event).where(*clauses)) or 0
    page = db.scalars(
        sa.select(Event).where(*clauses).order_by(Event.id.desc()).offset(skip).limit(limit)
    )
    return EventsPublic(data=[EventPublic.model_validate(e) for e in page], count=count)


def _newest_id(sessions: sessionmaker[Session]) -> int:
    with sessions() as db:
        return db.scalar(sa.select(sa.func.max(Event.id))) or 0


def _after(
    sessions: sessionmaker[Session], after_id: int, clauses: list[sa.ColumnElement[bool]]
) -> list[EventPublic]:
    with sessions() as db:
        rows = db.scalars(
            sa.select(Event)
            .where(Event.id > after_id, *clauses)
            .order_by(Event.id.asc())
            .limit(MAX_PAGE)
        )
        return [EventPublic.model_validate(e) for e in rows]


def _frame(event: EventPublic) -> str:
    # No `event:` line: a browser's EventSource then hands every kind to one handler.
    return f"id: {event.id}\ndata: {event.model_dump_json()}\n\n"


@router.get("/stream", response_class=StreamingResponse)
async def stream_events(
    request: Request,
    kind: KindQuery = None,
    device_id: DeviceQuery = None,
    after_id: AfterId = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """Server-sent events: each new event once, oldest first, from `after_id` (or now)."""
    start = after_id
    if start is None and last_event_id and last_event_id.isdigit():
        resumed = int(last_event_id)
        start = resumed if resumed <= MAX_ROW_ID else None  # not an id of ours: from now
    clauses = _filters(kind, device_id, None, None, None, None)
    sessions: sessionmaker[Session] = request.app.state.sessions

    async def frames() -> AsyncIterator[str]:
        # A new tail starts at the present.
        cursor = start if start is not None else await asyncio.to_thread(_newest_id, sessions)
        yield f"retry: {RECONNECT_MS}\n: tail after {cursor}\n\n"
        opened = last_sent = time.monotonic()
        while time.monotonic() - opened < STREAM_LIFETIME_S:
            if await request.is_disconnected():
                return
            events = await asyncio.to_thread(_after, sessions, cursor, clauses)
            for event in events:
                cursor = event.id
                yield _frame(event)
            now = time.monotonic()
            if events:
                last_sent = now
            elif now - last_sent >= KEEPALIVE_S:
                last_sent = now
                yield ": keepalive\n\n"
            await asyncio.sleep(POLL_INTERVAL_S)

    return StreamingResponse(
        frames(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
