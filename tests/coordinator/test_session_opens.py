"""A session's open reads, admits and inserts in one hop to a thread (`SessionStore.open`), and
on SQLite one open goes at a time: many opens at once, a repeated open, a refused one and a
resume from the database each end as before, in the real database."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from broker import messages as m
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import DecodingSession, Event
from coordinator.db.registry import DeviceExistsError, DeviceRegistry
from coordinator.runtime.quotas import Quotas
from coordinator.runtime.sessions import SessionBook
from coordinator.runtime.verifiers import VerifierPool
from core.settings import Settings
from tests.coordinator.test_direct_round_reports import Published
from tests.coordinator.test_quotas import session_open

DEVICE = "pi-opens"


def _book(engine: Engine, admitted: set[str], quotas: Quotas | None = None) -> SessionBook:
    """A book whose only way out is `Published`; `admitted` devices are registered."""
    registry = DeviceRegistry(make_sessionmaker(engine), hash_iterations=10)
    for device_id in admitted:
        with contextlib.suppress(DeviceExistsError):
            registry.provision(device_id, "pi")
    published = Published()
    return SessionBook(make_sessionmaker(engine), VerifierPool(published), published,
                       admit=lambda device_id: device_id in admitted,
                       quotas=quotas or Quotas.from_settings(Settings()),
                       idle_timeout_s=600)  # fmt: skip


def _replies(book: SessionBook) -> list[m.Message]:
    published = book._publish
    assert isinstance(published, Published)
    return [message for _, message in published.messages]


def _stored(engine: Engine) -> tuple[set[str], int]:
    with engine.connect() as db:
        ids = {str(i) for i in db.scalars(sa.select(DecodingSession.id))}
        opened = db.scalar(
            sa.select(sa.func.count()).where(Event.kind == "session.opened").select_from(Event)
        )
    return ids, int(opened or 0)


def test_sixteen_opens_at_once_and_one_sent_twice_are_each_stored_once(
    db_engine: Engine,
) -> None:
    """A wave's opens arrive together, and an agent may send an open again before its answer:
    every session is stored once with its one event, each device hears its state, and none is
    refused."""
    opens = [session_open(k=2) for _ in range(16)]

    async def scenario() -> SessionBook:
        book = _book(db_engine, {DEVICE})
        await asyncio.gather(
            *(book.on_session_open(DEVICE, request) for request in [*opens, opens[3]])
        )
        return book

    book = asyncio.run(scenario())
    ids, opened = _stored(db_engine)
    assert ids == {request.session_id for request in opens}
    assert opened == 16
    replies = _replies(book)
    assert not [reply for reply in replies if isinstance(reply, m.ErrorReply)]
    states = [reply for reply in replies if isinstance(reply, m.SessionState)]
    assert {state.session_id for state in states} == ids
    assert len(states) == 17  # the repeated open is answered with its state too
    assert {state.status for state in states} == {"active"}
    assert set(book.live) == ids
    assert not book._opening  # no open left counted against the device's quota


@pytest.mark.parametrize("case", ["unregistered", "over quota"])
def test_a_refused_open_stores_nothing_and_says_why(db_engine: Engine, case: str) -> None:
    quotas = Quotas.from_settings(Settings())
    if case == "over quota":
        quotas = dataclasses.replace(quotas, max_open_sessions=1)
    admitted = set() if case == "unregistered" else {DEVICE}
    first, second = session_open(k=2), session_open(k=2)

    async def scenario() -> SessionBook:
        book = _book(db_engine, admitted, quotas)
        if case == "over quota":
            await book.on_session_open(DEVICE, first)
        await book.on_session_open(DEVICE, second)
        return book

    book = asyncio.run(scenario())
    errors = [reply for reply in _replies(book) if isinstance(reply, m.ErrorReply)]
    assert [error.session_id for error in errors] == [second.session_id]
    assert errors[0].refused_type is m.Refused.SESSION_OPEN
    expected = "unregistered device" if case == "unregistered" else "its quota"
    assert expected in errors[0].reason
    ids, _ = _stored(db_engine)
    assert second.session_id not in ids
    assert second.session_id not in book.live


def test_a_stored_session_opened_again_resumes_even_over_quota(db_engine: Engine) -> None:
    """A session the database holds (the coordinator restarted, the book forgot it) is read
    back and resumed by the same hop that would create a new one; the checks of a new open
    (here the device's quota of one session) do not apply to it."""
    quotas = dataclasses.replace(Quotas.from_settings(Settings()), max_open_sessions=1)
    request = session_open(k=2)

    async def scenario() -> SessionBook:
        await _book(db_engine, {DEVICE}, quotas).on_session_open(DEVICE, request)
        book = _book(db_engine, {DEVICE}, quotas)  # a restarted coordinator
        book.live.clear()
        resent = request.model_copy(update={"resume": m.ResumeReason.RECONNECT})
        await book.on_session_open(DEVICE, resent)
        return book

    book = asyncio.run(scenario())
    replies = _replies(book)
    assert not [reply for reply in replies if isinstance(reply, m.ErrorReply)]
    states = [reply for reply in replies if isinstance(reply, m.SessionState)]
    assert [(state.session_id, state.status) for state in states] == [
        (request.session_id, "active")
    ]
    assert request.session_id in book.live
    ids, opened = _stored(db_engine)
    assert ids == {request.session_id} and opened == 1
