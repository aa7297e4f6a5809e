"""The append-only audit log: connects, drops, resumes, deployments and admin actions."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from enum import Enum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db.models import Event, utcnow

DEFAULT_PAGE = 100
MAX_PAGE = 1000
SYSTEM_ACTOR = "coordinator"


class EventKind(str, Enum):
    """Kinds written by this package; `kind` is free text, so other modules may add their own."""

    DEVICE_PROVISIONED = "device.provisioned"
    DEVICE_ONLINE = "device.online"
    DEVICE_OFFLINE = "device.offline"
    DEVICE_RETIRED = "device.retired"
    DEVICE_CREDENTIAL_ROTATED = "device.credential_rotated"
    # A session that heard nothing for the idle timeout (Settings.session_idle_timeout_s).
    SESSION_EXPIRED = "session.expired"


def _kind_text(kind: str) -> str:
    # str() of a str-valued Enum member is "EventKind.X" on Python 3.11+, not its value.
    return str(kind.value) if isinstance(kind, Enum) else kind


def append_event(
    session: Session,
    kind: str,
    *,
    device_id: str | None = None,
    session_id: uuid.UUID | None = None,
    actor: str = SYSTEM_ACTOR,
    detail: Mapping[str, Any] | None = None,
    at: datetime | None = None,
) -> Event:
    """Add an event inside the caller's transaction, so it commits with the change it records."""
    event = Event(
        at=at or utcnow(),
        kind=_kind_text(kind),
        device_id=device_id,
        session_id=session_id,
        actor=actor,
        detail=dict(detail or {}),
    )
    session.add(event)
    return event


class EventLog:
    """Append and read; there is deliberately no update or delete (the database refuses both)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def append(
        self,
        kind: str,
        *,
        device_id: str | None = None,
        session_id: uuid.UUID | None = None,
        actor: str = SYSTEM_ACTOR,
        detail: Mapping[str, Any] | None = None,
        at: datetime | None = None,
    ) -> Event:
        with self._sessions.begin() as session:
            event = append_event(
                session,
                kind,
                device_id=device_id,
                session_id=session_id,
                actor=actor,
                detail=detail,
                at=at,
            )
        return event

    def list(
        self,
        *,
        kind: str | None = None,
        device_id: str | None = None,
        session_id: uuid.UUID | None = None,
        since: datetime | None = None,
        before_id: int | None = None,
        after_id: int | None = None,
        limit: int = DEFAULT_PAGE,
    ) -> list[Event]:
        """Newest first, up to `limit`; page back with `before_id` = the last id of a page.

        With `after_id` the order is oldest first instead, for tailing the log.
        """
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be within 1..{MAX_PAGE}")
        query = sa.select(Event)
        if kind is not None:
            query = query.where(Event.kind == _kind_text(kind))
        if device_id is not None:
            query = query.where(Event.device_id == device_id)
        if session_id is not None:
            query = query.where(Event.session_id == session_id)
        if since is not None:
            query = query.where(Event.at >= since)
        if before_id is not None:
            query = query.where(Event.id < before_id)
        if after_id is not None:
            query = query.where(Event.id > after_id).order_by(Event.id.asc())
        else:
            query = query.order_by(Event.id.desc())
        with self._sessions() as session:
            return list(session.scalars(query.limit(limit)))
