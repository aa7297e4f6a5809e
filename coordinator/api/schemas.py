"""API schemas (pydantic), kept apart from the ORM tables so that neither leaks into the other."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from coordinator.db.models import DeviceKind, DeviceStatus


class DevicePublic(BaseModel):
    """A device as operators see it; the credential hash never leaves the database."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    kind: DeviceKind
    status: DeviceStatus
    status_reason: str | None
    tags: list[str]
    hardware: dict[str, Any]
    installed_models: list[str]
    last_seen: datetime | None
    telemetry: dict[str, Any] | None
    telemetry_at: datetime | None
    created_at: datetime


class DevicesPublic(BaseModel):
    data: list[DevicePublic]
    count: int  # matching devices in all, not only this page
