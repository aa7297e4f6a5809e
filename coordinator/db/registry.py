"""The device registry: provisioning, credentials, presence and latest telemetry of devices."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, sessionmaker

from broker.acl import SERVICE_ACCOUNT_NAMES, DeviceAccount
from broker.passwords import DEFAULT_ITERATIONS, hash_credential, new_credential, verify_credential
from broker.topics import validate_device_id
from coordinator.db.events import EventKind, append_event
from coordinator.db.models import Device, DeviceKind, DeviceStatus, utcnow

ADMIN_ACTOR = "admin"
# How often a running coordinator reads the registry for devices retired without its API (the
# CLI, another process), to take them off the broker and close their sessions.
RETIREMENT_POLL_S = 2.0
MAX_TAG_LENGTH = 64

TelemetryValue = float | int | str | bool | None


class RegistryError(Exception):
    def __init__(self, device_id: str, message: str) -> None:
        super().__init__(message)
        self.device_id = device_id


class DeviceNotFoundError(RegistryError, LookupError):
    def __init__(self, device_id: str) -> None:
        super().__init__(device_id, f"no device {device_id!r}")


class DeviceExistsError(RegistryError):
    def __init__(self, device_id: str) -> None:
        super().__init__(device_id, f"device {device_id!r} already exists (ids are never reused)")


class ReservedNameError(RegistryError):
    def __init__(self, device_id: str) -> None:
        super().__init__(
            device_id, f"{device_id!r} is a service account's name on the broker; choose another"
        )


class DeviceRetiredError(RegistryError):
    def __init__(self, device_id: str) -> None:
        super().__init__(device_id, f"device {device_id!r} is retired")


def validate_tags(tags: Iterable[str]) -> builtins.list[str]:
    """Sorted, de-duplicated tags; each non-empty, printable, without spaces or commas."""
    cleaned = sorted(set(tags))
    for tag in cleaned:
        if (
            not tag
            or len(tag) > MAX_TAG_LENGTH
            or not tag.isprintable()
            or any(c in tag for c in " ,")
        ):
            raise ValueError(f"invalid tag {tag!r}: 1-{MAX_TAG_LENGTH} printable characters")
    return cleaned


def has_tag(tag: str, dialect_name: str) -> sa.ColumnElement[bool]:
    """`tag in devices.tags`, evaluated by the database so that counts and pages stay right."""
    if dialect_name == "postgresql":
        return sa.cast(Device.tags, JSONB).contains([tag])
    if dialect_name == "sqlite":
        elements = sa.func.json_each(Device.tags).table_valued("value")
        return sa.exists(sa.select(1).select_from(elements).where(elements.c.value == tag))
    raise ValueError(f"tag filter not supported on {dialect_name}")


def device_filters(
    dialect_name: str,
    *,
    status: DeviceStatus | None = None,
    kind: DeviceKind | None = None,
    tag: str | None = None,
) -> builtins.list[sa.ColumnElement[bool]]:
    """WHERE clauses shared by the registry and the API."""
    clauses: builtins.list[sa.ColumnElement[bool]] = []
    if status is not None:
        clauses.append(Device.status == status)
    if kind is not None:
        clauses.append(Device.kind == kind)
    if tag is not None:
        clauses.append(has_tag(tag, dialect_name))
    return clauses


class DeviceRegistry:
    """Synchronous and short per call; asyncio callers wrap calls in `asyncio.to_thread`.

    State changes that matter to operators (provisioning, online/offline transitions,
    retirement) append their event in the same transaction, so the log never disagrees with
    the devices table. Callers should not log those events again.
    All `at` arguments are the coordinator's clock (aware, UTC), never a device's.
    """

    def __init__(
        self, sessions: sessionmaker[Session], *, hash_iterations: int = DEFAULT_ITERATIONS
    ) -> None:
        self._sessions = sessions
        self._hash_iterations = hash_iterations

    def _load(self, session: Session, device_id: str, *, for_update: bool = False) -> Device:
        device = session.get(Device, device_id, with_for_update=for_update)
        if device is None:
            raise DeviceNotFoundError(device_id)
        return device

    def provision(
        self,
        device_id: str,
        kind: DeviceKind | str,
        tags: Iterable[str] = (),
        *,
        hardware: Mapping[str, Any] | None = None,
        actor: str = ADMIN_ACTOR,
    ) -> tuple[Device, str]:
        """A new device and its credential; the plaintext is returned here once, never stored."""
        validate_device_id(device_id)
        if device_id in SERVICE_ACCOUNT_NAMES:
            raise ReservedNameError(device_id)
        device_kind = DeviceKind(kind)
        clean_tags = validate_tags(tags)
        credential = new_credential()
        with self._sessions.begin() as session:
            if session.get(Device, device_id) is not None:
                raise DeviceExistsError(device_id)
            device = Device(
                id=device_id,
                kind=device_kind,
                tags=clean_tags,
                hardware=dict(hardware or {}),
                installed_models=[],
                credential_hash=hash_credential(credential, iterations=self._hash_iterations),
                status=DeviceStatus.OFFLINE,
                created_at=utcnow(),
            )
            session.add(device)
            append_event(
                session,
                EventKind.DEVICE_PROVISIONED,
                device_id=device_id,
                actor=actor,
                detail={"kind": device_kind.value, "tags": clean_tags},
            )
            try:
                session.flush()
            except sa.exc.IntegrityError as exc:  # provisioned concurrently by someone else
                raise DeviceExistsError(device_id) from exc
        return device, credential

    def rotate_credential(self, device_id: str, *, actor: str = ADMIN_ACTOR) -> str:
        """A fresh credential; the old one stops working once the broker reloads its files."""
        credential = new_credential()
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            if device.status is DeviceStatus.RETIRED:
                raise DeviceRetiredError(device_id)
            device.credential_hash = hash_credential(credential, iterations=self._hash_iterations)
            append_event(
                session, EventKind.DEVICE_CREDENTIAL_ROTATED, device_id=device_id, actor=actor
            )
        return credential

    def verify_credential(self, device_id: str, credential: str) -> bool:
        """False for a wrong credential, an unknown device or a retired one."""
        with self._sessions() as session:
            device = session.get(Device, device_id)
            if device is None or device.status is DeviceStatus.RETIRED:
                return False
            return verify_credential(credential, device.credential_hash)

    def get(self, device_id: str) -> Device:
        with self._sessions() as session:
            return self._load(session, device_id)

    def list(
        self,
        *,
        status: DeviceStatus | None = None,
        kind: DeviceKind | None = None,
        tag: str | None = None,
        skip: int = 0,
        limit: int | None = None,
    ) -> builtins.list[Device]:
        with self._sessions() as session:
            clauses = device_filters(
                session.get_bind().dialect.name, status=status, kind=kind, tag=tag
            )
            query = sa.select(Device).where(*clauses).order_by(Device.id).offset(skip).limit(limit)
            return builtins.list(session.scalars(query))

    def online_last_seen(self) -> builtins.list[tuple[str, datetime | None]]:
        """Every online device's id and when it was last heard: what the presence sweep reads
        twice a second. Two columns, not whole devices: at 1,000 devices, loading each as an
        object took the sweep's thread (and the GIL, away from the event loop) tens of ms."""
        with self._sessions() as session:
            query = sa.select(Device.id, Device.last_seen).where(
                Device.status == DeviceStatus.ONLINE
            )
            return [(device_id, last_seen) for device_id, last_seen in session.execute(query)]

    def count(
        self,
        *,
        status: DeviceStatus | None = None,
        kind: DeviceKind | None = None,
        tag: str | None = None,
    ) -> int:
        with self._sessions() as session:
            clauses = device_filters(
                session.get_bind().dialect.name, status=status, kind=kind, tag=tag
            )
            return (
                session.scalar(sa.select(sa.func.count()).select_from(Device).where(*clauses)) or 0
            )

    def mark_online(
        self,
        device_id: str,
        at: datetime,
        *,
        detail: Mapping[str, Any] | None = None,
        installed_models: Iterable[str] | None = None,
    ) -> Device:
        """Online as of `at`, with the drafts it reports installed (when given) in the same
        transaction, so that no reader sees it online without them; an event is logged only on
        the transition from offline."""
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            if device.status is DeviceStatus.RETIRED:
                raise DeviceRetiredError(device_id)
            was = device.status
            device.status = DeviceStatus.ONLINE
            device.status_reason = None
            device.last_seen = max(at, device.last_seen) if device.last_seen else at
            if installed_models is not None:
                device.installed_models = sorted(set(installed_models))
            if was is not DeviceStatus.ONLINE:
                append_event(
                    session,
                    EventKind.DEVICE_ONLINE,
                    device_id=device_id,
                    at=at,
                    detail=dict(detail or {}),
                )
        return device

    def mark_offline(self, device_id: str, at: datetime, reason: str) -> Device:
        """Offline as of `at`, unless the device was seen after `at` (a stale Last Will)."""
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            if device.status is DeviceStatus.RETIRED:
                raise DeviceRetiredError(device_id)
            stale = device.last_seen is not None and at < device.last_seen
            if device.status is DeviceStatus.ONLINE and not stale:
                device.status = DeviceStatus.OFFLINE
                device.status_reason = reason[:255]
                append_event(
                    session,
                    EventKind.DEVICE_OFFLINE,
                    device_id=device_id,
                    at=at,
                    detail={"reason": reason},
                )
        return device

    def record_telemetry(
        self,
        device_id: str,
        at: datetime,
        *,
        rtt_ms: float | None = None,
        cpu_percent: float | None = None,
        memory_percent: float | None = None,
        battery_percent: float | None = None,
        thermal_c: float | None = None,
        extra: Mapping[str, TelemetryValue] | None = None,
    ) -> None:
        """Replace the device's latest telemetry (history belongs in metrics, not in this row)."""
        values: dict[str, TelemetryValue] = dict(extra or {})
        values.update(
            rtt_ms=rtt_ms,
            cpu_percent=cpu_percent,
            memory_percent=memory_percent,
            battery_percent=battery_percent,
            thermal_c=thermal_c,
        )
        snapshot = {key: value for key, value in values.items() if value is not None}
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            if device.status is DeviceStatus.RETIRED:
                raise DeviceRetiredError(device_id)
            device.telemetry = snapshot
            device.telemetry_at = at
            device.last_seen = max(at, device.last_seen) if device.last_seen else at

    def set_installed_models(self, device_id: str, models: Iterable[str]) -> Device:
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            device.installed_models = sorted(set(models))
        return device

    def set_hardware(self, device_id: str, hardware: Mapping[str, Any]) -> Device:
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            device.hardware = dict(hardware)
        return device

    def retire(
        self,
        device_id: str,
        *,
        reason: str = "",
        at: datetime | None = None,
        actor: str = ADMIN_ACTOR,
    ) -> Device:
        """Retired for good: its credential stops verifying and it leaves the broker files."""
        at = at or utcnow()
        with self._sessions.begin() as session:
            device = self._load(session, device_id, for_update=True)
            if device.status is DeviceStatus.RETIRED:
                return device
            device.status = DeviceStatus.RETIRED
            device.status_reason = reason[:255] or None
            append_event(
                session,
                EventKind.DEVICE_RETIRED,
                device_id=device_id,
                actor=actor,
                at=at,
                detail={"reason": reason},
            )
        return device

    def broker_accounts(self) -> builtins.list[DeviceAccount]:
        """Every device that may connect, with its stored hash, for the broker's password file."""
        with self._sessions() as session:
            rows = session.execute(
                sa.select(Device.id, Device.credential_hash)
                .where(Device.status != DeviceStatus.RETIRED)
                .order_by(Device.id)
            )
            return [
                DeviceAccount(device_id, credential_hash) for device_id, credential_hash in rows
            ]
