"""CoordinatorControl over the running coordinator service: verifier load from its pool, and
sessions started and cancelled on devices through bus commands."""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI

from broker import messages as m
from broker.client import BusConnectionError
from coordinator.db.events import append_event
from coordinator.db.models import (
    DecodingSession,
    Device,
    DeviceStatus,
    Round,
    SessionStatus,
    utcnow,
)
from coordinator.db.registry import RETIREMENT_POLL_S
from coordinator.live import ControlError, SessionStartRequest, VerifierLoad
from coordinator.ops.provisioning import ProvisioningError
from coordinator.runtime.fleet import CommandFailed
from coordinator.runtime.metrics import CoordinatorMetrics
from coordinator.runtime.service import Coordinator

log = logging.getLogger(__name__)

# The device acknowledges a start once its session is open; loading a drafter takes a while.
START_TIMEOUT_S = 60.0
# The session is closed before the agent is told; its answer is waited for only this long.
CANCEL_ACK_WAIT_S = 5.0
DEVICE_REVOKED = "device.revoked"

# Takes a retired device's account off the broker and disconnects it; says what it did.
BrokerRevoke = Callable[[str], Awaitable[str]]


class ServiceControl:
    """What the admin API asks of the service: `create_app(..., control=ServiceControl(c))`."""

    def __init__(self, coordinator: Coordinator, revoke: BrokerRevoke | None = None) -> None:
        self._coordinator = coordinator
        self._revoke = revoke
        # Retired devices already revoked, or found retired with nothing left to revoke.
        self._revoked: set[str] | None = None

    def verifier_loads(self) -> Sequence[VerifierLoad]:
        loads = []
        for info in self._coordinator.verifiers.verifiers.values():
            status = info.status
            loads.append(
                VerifierLoad(
                    verifier_id=info.verifier_id,
                    online=info.alive,
                    queue_depth=status.queue_depth,
                    in_flight=max(status.in_flight, len(info.in_flight)),
                    sessions_cached=status.sessions_cached,
                    max_batch=status.max_batch,
                    target=status.target,
                    last_heartbeat=datetime.fromtimestamp(status.at, tz=timezone.utc),
                )
            )
        return loads

    def broker_connected(self) -> bool:
        return self._coordinator.connected.is_set()

    def _device_status(self, device_id: str) -> DeviceStatus | None:
        with self._coordinator.sessions() as db:
            device = db.get(Device, device_id)
            return None if device is None else device.status

    def _session_device(self, session_id: uuid.UUID) -> str | None:
        with self._coordinator.sessions() as db:
            row = db.get(DecodingSession, session_id)
            return None if row is None else row.device_id

    async def start_session(self, request: SessionStartRequest) -> uuid.UUID:
        status = await asyncio.to_thread(self._device_status, request.device_id)
        if status is None:
            raise ControlError(f"no device {request.device_id!r}", status=404)
        if status is not DeviceStatus.ONLINE:
            raise ControlError(f"device {request.device_id!r} is {status.value}", status=409)
        session_id = uuid.uuid4()
        # The seed is chosen here and stored with the session, so replay can verify it.
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        args: dict[str, Any] = {
            "session_id": str(session_id),
            "prompt": request.prompt,
            "task_type": request.task_type,
            "max_tokens": request.max_tokens,
            "sampling": {
                "temperature": request.temperature,
                "top_p": request.top_p,
                "seed": seed,
            },
        }
        if request.draft_model is not None:
            args["draft_model"] = request.draft_model
        if request.k is not None:
            args["k"] = request.k
        try:
            await self._coordinator.fleet.send_command(
                request.device_id, m.CommandName.START_SESSION, args, timeout_s=START_TIMEOUT_S
            )
        except CommandFailed as exc:
            raise ControlError(str(exc), status=409) from exc
        return session_id

    async def cancel_session(self, session_id: uuid.UUID, *, reason: str, actor: str) -> None:
        """Close the session on the coordinator, which is its authority (later drafts are
        refused and the device hears the new state), then ask the agent to stop drafting."""
        device_id = await asyncio.to_thread(self._session_device, session_id)
        if device_id is None:
            raise ControlError(f"no session {session_id}", status=404)
        close = m.SessionClose(session_id=str(session_id), reason=reason[:256])
        await self._coordinator.close_session(device_id, close)
        try:
            await self._coordinator.fleet.send_command(
                device_id,
                m.CommandName.CANCEL_SESSION,
                {"session_id": str(session_id), "reason": reason[:256]},
                timeout_s=CANCEL_ACK_WAIT_S,
            )
        except CommandFailed as exc:
            # Closed already: an agent that is offline, slow, or done with it changes nothing.
            log.info("cancel of %s on %s: %s", session_id, device_id, exc)

    async def revoke_device(self, device_id: str, *, reason: str, actor: str) -> None:
        """Off the broker first, so that no draft follows; then its sessions end (recorded)."""
        if self._revoked is not None:
            self._revoked.add(device_id)
        broker = "no broker files configured: the broker was not told"
        failure: str | None = None
        if self._revoke is not None:
            try:
                broker = await self._revoke(device_id)
            except (ProvisioningError, OSError) as exc:
                failure = broker = f"the broker was not updated: {exc}"
        why = f"device retired: {reason}" if reason else "device retired"
        closed = await self._close_sessions(device_id, why[:256])
        await asyncio.to_thread(self._record_revoked, device_id, actor, broker, closed)
        log.info("revoked %s: %s; %d sessions closed", device_id, broker, len(closed))
        if failure is not None:
            raise ControlError(
                f"{device_id} is retired and its sessions closed, but {failure}", 502
            )

    async def watch_retirements(self) -> None:
        """Revoke, until cancelled, devices retired without this API (the CLI, another process):
        each is taken off the broker and its sessions closed within a poll, as the API's retire
        does. The first poll revokes retired devices that still hold open sessions."""
        while True:
            try:
                await self.revoke_retired()
            except Exception:
                # The database may be briefly away; the next poll tries again.
                log.exception("reading retired devices failed")
            await asyncio.sleep(RETIREMENT_POLL_S)

    async def revoke_retired(self) -> list[str]:
        """One poll of `watch_retirements`; returns the devices it revoked."""
        retired, holding = await asyncio.to_thread(self._retired_devices)
        if self._revoked is None:
            self._revoked = retired - holding
        pending = sorted(retired - self._revoked)
        for device_id in pending:
            reason = await asyncio.to_thread(self._retired_reason, device_id)
            try:
                await self.revoke_device(device_id, reason=reason, actor="coordinator")
            except ControlError as exc:
                log.error("retired %s out of band: %s", device_id, exc)
        return pending

    def _retired_devices(self) -> tuple[set[str], set[str]]:
        """Retired devices, and those of them that still hold open sessions."""
        with self._coordinator.sessions() as db:
            retired = set(
                db.scalars(sa.select(Device.id).where(Device.status == DeviceStatus.RETIRED))
            )
            holding = set(
                db.scalars(
                    sa.select(DecodingSession.device_id)
                    .join(Device, Device.id == DecodingSession.device_id)
                    .where(
                        Device.status == DeviceStatus.RETIRED,
                        DecodingSession.status.in_([SessionStatus.ACTIVE, SessionStatus.SUSPENDED]),
                    )
                    .distinct()
                )
            )
        return retired, holding

    def _retired_reason(self, device_id: str) -> str:
        with self._coordinator.sessions() as db:
            device = db.get(Device, device_id)
            return "" if device is None else device.status_reason or ""

    async def _close_sessions(self, device_id: str, reason: str) -> list[str]:
        """Close the device's active sessions through the book (which records each) and end its
        suspended ones in the database; returns their ids."""
        book = self._coordinator.book
        closed = []
        for session_id, status in await asyncio.to_thread(self._open_sessions, device_id):
            if status is SessionStatus.SUSPENDED:
                await asyncio.to_thread(self._cancel_suspended, session_id, device_id, reason)
            else:
                try:
                    await book.on_session_close(
                        device_id, m.SessionClose(session_id=str(session_id), reason=reason)
                    )
                except (ConnectionError, BusConnectionError, m.BusError) as exc:
                    # Closed and recorded already; only telling the (cut off) device failed.
                    log.info("closed %s of retired %s untold: %s", session_id, device_id, exc)
            closed.append(str(session_id))
        return closed

    def _open_sessions(self, device_id: str) -> list[tuple[uuid.UUID, SessionStatus]]:
        with self._coordinator.sessions() as db:
            rows = db.execute(
                sa.select(DecodingSession.id, DecodingSession.status).where(
                    DecodingSession.device_id == device_id,
                    DecodingSession.status.in_([SessionStatus.ACTIVE, SessionStatus.SUSPENDED]),
                )
            )
            return [(session_id, status) for session_id, status in rows]

    def _cancel_suspended(self, session_id: uuid.UUID, device_id: str, reason: str) -> None:
        with self._coordinator.sessions.begin() as db:
            row = db.get(DecodingSession, session_id, with_for_update=True)
            if row is None or row.status is not SessionStatus.SUSPENDED:
                return
            row.status = SessionStatus.CANCELLED
            row.finished_at = utcnow()
            append_event(
                db,
                f"session.{SessionStatus.CANCELLED.value}",
                device_id=device_id,
                session_id=session_id,
                detail={"reason": reason},
            )

    def _record_revoked(self, device_id: str, actor: str, broker: str, closed: list[str]) -> None:
        with self._coordinator.sessions.begin() as db:
            append_event(
                db,
                DEVICE_REVOKED,
                device_id=device_id,
                actor=actor,
                detail={"broker": broker, "sessions_closed": closed},
            )


def attach_service(
    app: FastAPI, coordinator: Coordinator, revoke: BrokerRevoke | None = None
) -> ServiceControl:
    """Wire a running coordinator into the admin app: start/cancel and verifier load through
    it, retired devices revoked on the broker through `revoke`, and every persisted round
    counted in the app's /metrics."""
    control = ServiceControl(coordinator, revoke)
    app.state.control = control
    coordinator.background.append(control.watch_retirements)
    metrics: CoordinatorMetrics = app.state.metrics

    def observe(_live: object, row: Round) -> None:
        metrics.observe_row(row)

    coordinator.book.round_observers.append(observe)
    return control
