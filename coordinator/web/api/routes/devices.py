"""`/devices`: the fleet as the registry sees it; tagging and retiring are admin writes."""

from __future__ import annotations

import logging
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, Query
from fastapi import status as http
from fastapi.concurrency import run_in_threadpool

from broker.topics import DEVICE_ID_PATTERN
from coordinator.db.events import EventKind, append_event
from coordinator.db.models import (
    Deployment,
    DeploymentDevice,
    Device,
    DeviceDeploymentState,
    DeviceKind,
    DeviceStatus,
    Event,
    Model,
    utcnow,
)
from coordinator.db.registry import device_filters, validate_tags
from coordinator.live import ControlError
from coordinator.web.api.deps import CurrentAdmin, OptionalControlDep, SessionDep, SettingsDep
from coordinator.web.api.paging import Skip
from coordinator.web.api.routes.deployments import ReleaseVersions
from coordinator.web.api.schemas import (
    DeviceDeploymentPublic,
    DeviceDetailPublic,
    DevicePublic,
    DeviceRetire,
    DevicesPublic,
    DeviceTagsUpdate,
    InstalledDraftPublic,
)

log = logging.getLogger(__name__)

MAX_PAGE = 1000
# A device page lists this many of the device's rollouts, newest first.
DEVICE_DEPLOYMENTS = 50
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


@router.get("/{device_id}/detail", response_model=DeviceDetailPublic)
def read_device_detail(
    session: SessionDep, settings: SettingsDep, device_id: DeviceId
) -> DeviceDetailPublic:
    """The device with its agent's version, its installed drafts (with the release each came
    in, where a rollout installed it) and its part in recent rollouts."""
    device = _load(session, device_id)
    online = session.scalar(
        sa.select(Event)
        .where(Event.device_id == device_id, Event.kind == EventKind.DEVICE_ONLINE.value)
        .order_by(Event.id.desc())
        .limit(1)
    )
    agent = online.detail if online is not None else {}
    versions = ReleaseVersions(settings.home)
    rows = session.execute(
        sa.select(DeploymentDevice, Deployment.artifact_sha256, Model.name, Model.format)
        .join(Deployment, Deployment.id == DeploymentDevice.deployment_id)
        .join(Model, Model.id == Deployment.model_id)
        .where(DeploymentDevice.device_id == device_id)
        .order_by(DeploymentDevice.deployment_id.desc())
        .limit(DEVICE_DEPLOYMENTS)
    ).all()
    deployments = [
        DeviceDeploymentPublic(
            deployment_id=row.deployment_id,
            model=name,
            version=versions.version(name, sha),
            wave=row.wave,
            state=row.state,
            detail=row.detail,
            updated_at=row.updated_at,
        )
        for row, sha, name, _ in rows
    ]
    # The newest installed rollout of each model is what serves (a rollback is a rollout too).
    rolled_out: dict[str, tuple[DeploymentDevice, str | None, str]] = {}
    for row, sha, name, model_format in rows:
        if row.state is DeviceDeploymentState.INSTALLED:
            rolled_out.setdefault(name, (row, sha, model_format))
    registered = {
        m.name: m
        for m in session.scalars(sa.select(Model).where(Model.name.in_(device.installed_models)))
    }
    drafts = [
        _installed_draft(n, rolled_out, registered, versions) for n in device.installed_models
    ]
    runtimes = agent.get("runtimes", [])
    return DeviceDetailPublic(
        device=DevicePublic.model_validate(device),
        agent_version=str(agent.get("agent_version") or "") or None,
        runtimes=[str(r) for r in runtimes] if isinstance(runtimes, list) else [],
        agent_reported_at=online.at if online is not None else None,
        drafts=drafts,
        deployments=deployments,
    )


def _installed_draft(
    name: str,
    rolled_out: dict[str, tuple[DeploymentDevice, str | None, str]],
    registered: dict[str, Model],
    versions: ReleaseVersions,
) -> InstalledDraftPublic:
    if name in rolled_out:
        row, sha, model_format = rolled_out[name]
        return InstalledDraftPublic(
            name=name,
            source="rollout",
            sha256=sha,
            version=versions.version(name, sha),
            format=model_format,
            deployment_id=row.deployment_id,
            installed_at=row.updated_at,
        )
    model = registered.get(name)
    return InstalledDraftPublic(
        name=name,
        source="registry" if model is not None else "device",
        sha256=model.sha256 if model is not None else None,
        version=None,
        format=model.format if model is not None else None,
        deployment_id=None,
        installed_at=None,
    )


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
