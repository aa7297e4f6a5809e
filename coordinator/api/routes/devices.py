"""`/devices`: the fleet as the registry sees it."""

from __future__ import annotations

from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, Query

from broker.topics import DEVICE_ID_PATTERN
from coordinator.api.deps import SessionDep
from coordinator.api.schemas import DevicePublic, DevicesPublic
from coordinator.db.models import Device, DeviceKind, DeviceStatus
from coordinator.registry import device_filters

MAX_PAGE = 1000

router = APIRouter(prefix="/devices", tags=["devices"])

DeviceId = Annotated[str, Path(pattern=DEVICE_ID_PATTERN.pattern, description="the device id")]


@router.get("", response_model=DevicesPublic)
def list_devices(
    session: SessionDep,
    status: DeviceStatus | None = None,
    kind: DeviceKind | None = None,
    tag: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
    skip: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> DevicesPublic:
    """Devices ordered by id, filtered by status, kind and tag; `count` is the unpaged total."""
    clauses = device_filters(session.get_bind().dialect.name, status=status, kind=kind, tag=tag)
    count = session.scalar(sa.select(sa.func.count()).select_from(Device).where(*clauses)) or 0
    page = session.scalars(
        sa.select(Device).where(*clauses).order_by(Device.id).offset(skip).limit(limit)
    )
    return DevicesPublic(data=[DevicePublic.model_validate(d) for d in page], count=count)


@router.get("/{device_id}", response_model=DevicePublic)
def read_device(session: SessionDep, device_id: DeviceId) -> DevicePublic:
    device = session.get(Device, device_id)
    if device is None:
        raise HTTPException(status_code=404, detail=f"no device {device_id!r}")
    return DevicePublic.model_validate(device)
