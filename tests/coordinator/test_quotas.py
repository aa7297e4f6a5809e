"""Per-device quotas and bounded memory, on a running coordinator over a real Mosquitto with
PostgreSQL: over-quota messages are refused with a reason, telemetry never holds up another
device, ended sessions leave memory, idle ones expire, and unreadable prompts never open."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from coordinator_rig import (
    REPLY_TIMEOUT_S,
    raw_device,
    rig_settings,
    running_coordinator,
    tracebacks,
)
from sqlalchemy.engine import Engine

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, connect
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel, VerifierChannel, verifier_topic
from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventKind
from coordinator.db.models import DecodingSession, Event, SessionStatus
from coordinator.runtime.service import Coordinator

FLOOD = 3000


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    with PrivateMosquitto() as broker:
        yield broker


def session_open(prompt_ids: tuple[int, ...] = (1, 2, 3), **fields: Any) -> m.SessionOpen:
    return m.SessionOpen(
        session_id=str(uuid.uuid4()),
        prompt="hi",
        prompt_ids=prompt_ids,
        draft_model="lookup",
        **fields,
    )


def is_about(session_id: str) -> Any:
    return lambda reply: getattr(reply, "session_id", None) == session_id


def run(
    tmp_path: Path,
    engine: Engine,
    mosquitto: PrivateMosquitto,
    caplog: pytest.LogCaptureFixture,
    body: Any,
    *,
    vocab_size: int | None = None,
    **quotas: Any,
) -> Any:
    """`body(coordinator, device)` against a running coordinator; no traceback is allowed."""
    settings = rig_settings(tmp_path, engine, mosquitto.url, **quotas)

    async def main() -> Any:
        async with (
            running_coordinator(settings, engine, vocab_size=vocab_size) as coordinator,
            raw_device(mosquitto.url, f"dev-{uuid.uuid4().hex[:8]}") as device,
        ):
            return await body(coordinator, device)

    with caplog.at_level(logging.INFO):
        result = asyncio.run(main())
    assert tracebacks(caplog.records) == []
    return result


async def open_session(
    device: Any, request: m.SessionOpen, timeout_s: float = REPLY_TIMEOUT_S
) -> m.Message:
    await device.send(DeviceChannel.SESSION, request)
    return await device.reply(timeout_s, accept=is_about(request.session_id))


def refused(reply: m.Message, refused_type: str, reason_part: str) -> bool:
    return (
        isinstance(reply, m.ErrorReply)
        and reply.refused_type == refused_type
        and reason_part in reply.reason
    )


# --- quotas ---------------------------------------------------------------------------------


def test_open_sessions_past_the_quota_are_refused_until_one_closes(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        first, second, third = session_open(), session_open(), session_open()
        assert isinstance(await open_session(device, first), m.SessionState)
        assert isinstance(await open_session(device, second), m.SessionState)
        reply = await open_session(device, third)
        assert refused(reply, "session_open", "2 sessions open"), reply
        await device.send(DeviceChannel.SESSION, m.SessionClose(session_id=first.session_id))
        closed = await device.reply(accept=is_about(first.session_id))
        assert isinstance(closed, m.SessionState) and closed.status == "cancelled"
        assert isinstance(await open_session(device, third), m.SessionState)

    run(tmp_path, pg_clean_engine, mosquitto, caplog, body, device_max_open_sessions=2)


def test_a_prompt_past_the_quota_is_refused(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        reply = await open_session(device, session_open(tuple(range(1, 10))))
        assert refused(reply, "session_open", "prompt of 9 tokens exceeds the quota of 8"), reply
        assert isinstance(
            await open_session(device, session_open(tuple(range(1, 9)))), m.SessionState
        )

    run(tmp_path, pg_clean_engine, mosquitto, caplog, body, device_max_prompt_tokens=8)


def test_session_opens_past_the_rate_are_refused(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        opened = [session_open() for _ in range(3)]
        for request in opened:
            assert isinstance(await open_session(device, request), m.SessionState)
        reply = await open_session(device, session_open())
        assert refused(reply, "session_open", "session opens over quota"), reply
        # Past the rate, a live session's resume (a reconnect) is still answered: refusing it
        # would fail a session the device is running.
        resume = opened[0].model_copy(update={"resume": m.ResumeReason.RECONNECT})
        state = await open_session(device, resume)
        assert isinstance(state, m.SessionState) and state.session_id == opened[0].session_id

    run(
        tmp_path,
        pg_clean_engine,
        mosquitto,
        caplog,
        body,
        device_session_opens_per_s=0.001,
        device_session_open_burst=3,
    )


def test_telemetry_past_the_rate_is_dropped_and_the_device_told_why(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        for i in range(20):
            telemetry = m.Telemetry(device_id=device.device_id, at=1.0 + i, cpu_percent=float(i))
            await device.send(DeviceChannel.TELEMETRY, telemetry)
        reply = await device.reply()
        assert refused(reply, "telemetry", "telemetry over quota"), reply
        # One reply, not one per refused message: a reply each would double the flood.
        assert await device.drain(quiet_s=0.5) == []
        assert coordinator.fleet.telemetry_refused == 15
        for _ in range(100):  # the writer keeps the device's latest telemetry within quota
            stored = coordinator.registry.get(device.device_id).telemetry
            if stored and stored.get("cpu_percent") == 4.0:
                break
            await asyncio.sleep(0.05)
        assert coordinator.registry.get(device.device_id).telemetry["cpu_percent"] == 4.0

    run(
        tmp_path,
        pg_clean_engine,
        mosquitto,
        caplog,
        body,
        device_telemetry_per_s=0.001,
        device_telemetry_burst=5,
    )


def test_status_past_the_rate_is_dropped_and_the_device_told_why(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        for i in range(20):
            status = m.Status(
                device_id=device.device_id,
                state=m.DeviceState.ONLINE,
                at=1.0 + i,
                agent_version=f"0.{i}",
            )
            await device.send(DeviceChannel.STATUS, status)
        reply = await device.reply()
        assert refused(reply, "status", "status over quota"), reply
        assert await device.drain(quiet_s=0.5) == []
        assert coordinator.fleet.status_refused == 15
        # The five within quota were written: the device is online.
        assert coordinator.registry.get(device.device_id).status.value == "online"

    run(
        tmp_path,
        pg_clean_engine,
        mosquitto,
        caplog,
        body,
        device_status_per_s=0.001,
        device_status_burst=5,
    )


@pytest.mark.parametrize(
    "quota",
    [
        pytest.param({}, id="default-quota"),
        # No rate limit at all: the writer alone keeps the database off the dispatch loop.
        pytest.param(
            {"device_telemetry_per_s": 1e9, "device_telemetry_burst": 10**9}, id="no-quota"
        ),
    ],
)
def test_a_telemetry_flood_does_not_hold_up_another_device(
    tmp_path: Path,
    pg_clean_engine: Engine,
    mosquitto: PrivateMosquitto,
    caplog: Any,
    quota: dict[str, Any],
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> tuple[float, int, int]:
        async with raw_device(mosquitto.url, "flooder") as flooder:
            # Known, and online, before the flood: its telemetry is written, not refused.
            status = m.Status(device_id="flooder", state=m.DeviceState.ONLINE, at=1.0)
            await flooder.send(DeviceChannel.STATUS, status)
            for i in range(FLOOD):
                telemetry = m.Telemetry(device_id="flooder", at=2.0 + i, cpu_percent=1.0)
                await flooder.send(DeviceChannel.TELEMETRY, telemetry)
            # The other device's open is answered (60 s is only a deadline, not the property).
            # That telemetry stays off the dispatch loop is shown below: the quota refuses the
            # flood, or without a quota the writer coalesces it.
            reply = await open_session(device, session_open(), timeout_s=60.0)
            assert isinstance(reply, m.SessionState)
            fleet = coordinator.fleet
            return fleet.telemetry.coalesced, fleet.telemetry_refused

    coalesced, refused_ = run(tmp_path, pg_clean_engine, mosquitto, caplog, body, **quota)
    if quota:  # every message passed the quota: the writer kept up by coalescing
        assert coalesced > 0
    else:
        assert refused_ >= FLOOD - 100


# --- bounded memory, expiry, unreadable prompts ----------------------------------------------


def test_ended_sessions_leave_memory_and_the_policy_forgets_them(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        book = coordinator.book
        # Adaptive, with a host mode on offer: the policy decides where it opens, and keeps
        # a note of the session.
        request = session_open(k=0, modes=(m.Mode.DISTRIBUTED, m.Mode.PLAIN))
        assert isinstance(await open_session(device, request), m.SessionState)
        assert request.session_id in book.live
        assert request.session_id in book.policy._in_mode
        await device.send(DeviceChannel.SESSION, m.SessionClose(session_id=request.session_id))
        await device.reply(accept=is_about(request.session_id))
        assert request.session_id not in book.live
        assert request.session_id not in book.policy._in_mode
        # Closing it again reads it from the database and leaves nothing behind.
        await device.send(DeviceChannel.SESSION, m.SessionClose(session_id=request.session_id))
        again = await device.reply(accept=is_about(request.session_id))
        assert isinstance(again, m.SessionState) and again.status == "cancelled"
        assert book.live == {}

    run(tmp_path, pg_clean_engine, mosquitto, caplog, body)


def test_an_idle_session_expires_with_an_event(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> str:
        request = session_open()
        assert isinstance(await open_session(device, request), m.SessionState)
        ended = await device.reply(accept=is_about(request.session_id))
        assert isinstance(ended, m.SessionState) and ended.status == "cancelled"
        assert request.session_id not in coordinator.book.live
        return request.session_id

    session_id = run(tmp_path, pg_clean_engine, mosquitto, caplog, body, session_idle_timeout_s=0.5)
    with make_sessionmaker(pg_clean_engine)() as db:
        row = db.get(DecodingSession, uuid.UUID(session_id))
        assert row is not None and row.status is SessionStatus.CANCELLED
        events = db.scalars(sa.select(Event).where(Event.session_id == uuid.UUID(session_id))).all()
    expired = [e for e in events if e.kind == EventKind.SESSION_EXPIRED.value]
    assert len(expired) == 1
    assert "idle for" in expired[0].detail["reason"]


@pytest.mark.parametrize("source", ["verifier", "manifest"])
def test_a_prompt_outside_the_vocabulary_is_refused_at_open(
    tmp_path: Path,
    pg_clean_engine: Engine,
    mosquitto: PrivateMosquitto,
    caplog: Any,
    source: str,
) -> None:
    vocab_size = 1000

    async def body(coordinator: Coordinator, device: Any) -> None:
        if source == "verifier":  # a verifier's heartbeat says what its target reads
            status = m.VerifierStatus(
                verifier_id="vocab-verifier",
                state=m.DeviceState.ONLINE,
                at=time.time(),
                heartbeat_s=60.0,
                vocab_size=vocab_size,
            )
            options = ConnectOptions(client_id=f"verifier-{uuid.uuid4().hex[:6]}")
            async with connect(BrokerAddress.from_url(mosquitto.url), options) as client:
                topic = verifier_topic("vocab-verifier", VerifierChannel.STATUS)
                await client.publish(topic, m.encode(status))
            for _ in range(100):
                if coordinator.verifiers.vocab_size() == vocab_size:
                    break
                await asyncio.sleep(0.05)
        reply = await open_session(device, session_open((1, vocab_size, 2)))
        assert refused(reply, "session_open", f"token id {vocab_size} is outside"), reply
        request = session_open((1, vocab_size - 1))
        opened = await open_session(device, request)
        assert isinstance(opened, m.SessionState)
        assert coordinator.book.open_sessions(device.device_id) == 1
        # A draft past the vocabulary is refused by the coordinator, before any verifier.
        draft = m.Draft(
            session_id=request.session_id,
            round=opened.next_round,
            base_len=opened.committed_len,
            tokens=(5, vocab_size + 7),
            draft_model="lookup",
        )
        await device.send(DeviceChannel.DRAFT, draft)
        reply = await device.reply(accept=is_about(request.session_id))
        assert refused(reply, "draft", f"draft token id {vocab_size + 7} is outside"), reply

    run(
        tmp_path,
        pg_clean_engine,
        mosquitto,
        caplog,
        body,
        vocab_size=vocab_size if source == "manifest" else None,
    )
