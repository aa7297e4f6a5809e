"""`/devices`: the fleet as the registry sees it; tagging and retiring are admin writes."""

from __future__ import annotations

import logging
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, Query
from fastapi import status as http
from fastapi.concurrency import run_in_threadpool

from broker.topics import DEVICE_ID_PATTERN
from coordinator.api.deps import CurrentAdmin, OptionalControlDep, SessionDep
from coordinator.api.paging import Skip
from coordinator.api.schemas import DevicePublic, DeviceRetire, DevicesPublic, DeviceTagsUpdate
from coordinator.db.models import Device, DeviceKind, DeviceStatus, utcnow
from coordinator.events import EventKind, append_event
from coordinator.live import ControlError
from coordinator.registry import device_filters, validate_tags

log = logging.getLogger(__name__)

MAX_PAGE = 1000
DEVICE_TAGGED = "device.tagged"

router = APIRouter(prefix="/devices", tags=["devices"])

DeviceId = Annotated[str, Path(pattern=DEVICE_ID_PATTERN.pattern, description="the device id")]


@router.get("", response_model=DevicesPublic)
def list_devices(
    session: SessionDep,
    status: DeviceStatus | None = None,
    kind: DeviceKind | None = None,
    tag: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> DevicesPublic:
    """Devices ordered by id, filtered by status, kind and tag; `count` is the unpaged total."""
    clauses = device_filters(session.get_bind().dialect.name, status=status, kind=kind, tag=tag)
    count = session.scalar(sa.select(sa.func.count()).select_from(Device).where(*clauses)) or 0
    page = session.scalars(
        sa.select(Device).where(*clauses).order_by(Device.id).offset(skip).limit(limit)
    )
    return DevicesPublic(data=[DevicePublic.model_validate(d) for d in page], count=count)


def _load(session: SessionDep, device_id: str, *, for_update: bool = False) -> Device:
    device = session.get(Device, device_id, with_for_update=for_update)
    if device is None:
        raise HTTPException(status_code=404, detail=f"no device {device_id!r}")
    return device


@router.get("/{device_id}", response_model=DevicePublic)
def read_device(session: SessionDep, device_id: DeviceId) -> DevicePublic:
    return DevicePublic.model_validate(_load(session, device_id))


@router.put("/{device_id}/tags", response_model=DevicePublic)
def set_tags(
    session: SessionDep, admin: CurrentAdmin, device_id: DeviceId, body: DeviceTagsUpdate
) -> DevicePublic:
    """Replace the device's tags (sorted, de-duplicated)."""
    try:
        tags = validate_tags(body.tags)
    except ValueError as exc:
        raise HTTPException(http.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    with session.begin():
        device = _load(session, device_id, for_update=True)
        if device.status is DeviceStatus.RETIRED:
            raise HTTPException(http.HTTP_409_CONFLICT, f"device {device_id!r} is retired")
        before = list(device.tags)
        device.tags = tags
        append_event(
            session,
            DEVICE_TAGGED,
            device_id=device_id,
            actor=admin.actor,
            detail={"before": before, "after": tags},
        )
    return DevicePublic.model_validate(device)


@router.post("/{device_id}/retire", response_model=DevicePublic)
async def retire_device(
    session: SessionDep,
    admin: CurrentAdmin,
    control: OptionalControlDep,
    device_id: DeviceId,
    body: DeviceRetire,
) -> DevicePublic:
    """Retire for good: its credential stops verifying, the running service takes it off the
    broker (which disconnects it) and closes its open sessions. Retiring twice revokes again."""
    device = await run_in_threadpool(_retire, session, admin.actor, device_id, body.reason)
    if control is None:
        log.warning("retired %s with no service attached: the broker was not told", device_id)
    else:
        try:
            await control.revoke_device(device_id, reason=body.reason, actor=admin.actor)
        except ControlError as exc:
            raise HTTPException(exc.status, str(exc)) from exc
    return device


def _retire(session: SessionDep, actor: str, device_id: str, reason: str) -> DevicePublic:
    with session.begin():
        device = _load(session, device_id, for_update=True)
        if device.status is not DeviceStatus.RETIRED:
            device.status = DeviceStatus.RETIRED
            device.status_reason = reason or None
            append_event(
                session,
                EventKind.DEVICE_RETIRED,
                device_id=device_id,
                actor=actor,
                at=utcnow(),
                detail={"reason": reason},
            )
    return DevicePublic.model_validate(device)
