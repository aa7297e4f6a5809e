"""`/deployments`: model rollouts with each device's state per wave; aborting one is an admin
write that the rollout's runner obeys before its next wave (coordinator.rollout)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path as FsPath
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi import status as http
from sqlalchemy.orm import Session

from coordinator.db.models import (
    Deployment,
    DeploymentDevice,
    DeploymentState,
    DeviceDeploymentState,
    Model,
)
from coordinator.ops.releases import ReleaseStoreError, release_versions
from coordinator.ops.rollout import AbortRefused, Deployments
from coordinator.web.api.deps import CurrentAdmin, SessionDep, SettingsDep
from coordinator.web.api.paging import MAX_ROW_ID, Skip
from coordinator.web.api.schemas import (
    DeploymentAbort,
    DeploymentDetailPublic,
    DeploymentDevicePublic,
    DeploymentPublic,
    DeploymentsPublic,
)

log = logging.getLogger(__name__)

MAX_PAGE = 200

router = APIRouter(prefix="/deployments", tags=["deployments"])

DeploymentId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="the deployment id")]


class ReleaseVersions:
    """Release numbers by (model, artifact sha256), each model's index read once per request."""

    def __init__(self, home: FsPath) -> None:
        self._home = home
        self._by_model: dict[str, dict[str, int]] = {}

    def version(self, model: str, sha256: str | None) -> int | None:
        if sha256 is None:
            return None
        if model not in self._by_model:
            try:
                self._by_model[model] = release_versions(self._home, model)
            except ReleaseStoreError as exc:
                log.warning("release index of %s unreadable: %s", model, exc)
                self._by_model[model] = {}
        return self._by_model[model].get(sha256)


def _state_counts(db: Session, ids: Sequence[int]) -> dict[int, Counter[DeviceDeploymentState]]:
    counts: dict[int, Counter[DeviceDeploymentState]] = {i: Counter() for i in ids}
    rows = db.execute(
        sa.select(DeploymentDevice.deployment_id, DeploymentDevice.state, sa.func.count())
        .where(DeploymentDevice.deployment_id.in_(ids))
        .group_by(DeploymentDevice.deployment_id, DeploymentDevice.state)
    )
    for deployment_id, state, n in rows:
        counts[deployment_id][state] = n
    return counts


def _waves(db: Session, ids: Sequence[int]) -> dict[int, int]:
    rows = db.execute(
        sa.select(DeploymentDevice.deployment_id, sa.func.max(DeploymentDevice.wave))
        .where(DeploymentDevice.deployment_id.in_(ids))
        .group_by(DeploymentDevice.deployment_id)
    )
    return {deployment_id: last + 1 for deployment_id, last in rows}


def _public(
    deployment: Deployment,
    model: str,
    counts: Counter[DeviceDeploymentState],
    waves: int,
    versions: ReleaseVersions,
) -> DeploymentPublic:
    targets = deployment.selector.get("to", [])
    return DeploymentPublic(
        id=deployment.id,
        model=model,
        artifact_sha256=deployment.artifact_sha256,
        version=versions.version(model, deployment.artifact_sha256),
        state=deployment.state,
        wave=deployment.wave,
        waves=waves,
        targets=[str(t) for t in targets] if isinstance(targets, list) else [],
        wave_percent=deployment.wave_percent,
        abort_at_percent=deployment.abort_at_percent,
        actor=deployment.actor,
        devices=sum(counts.values()),
        counts={state: counts[state] for state in DeviceDeploymentState},
        created_at=deployment.created_at,
        updated_at=deployment.updated_at,
    )


@router.get("", response_model=DeploymentsPublic)
def list_deployments(
    db: SessionDep,
    settings: SettingsDep,
    state: DeploymentState | None = None,
    model: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
) -> DeploymentsPublic:
    """Newest first, with each rollout's devices counted by state."""
    clauses: list[sa.ColumnElement[bool]] = []
    if state is not None:
        clauses.append(Deployment.state == state)
    if model is not None:
        clauses.append(Model.name == model)
    joined = sa.select(Deployment, Model.name).join(Model, Model.id == Deployment.model_id)
    count = db.scalar(
        sa.select(sa.func.count())
        .select_from(Deployment)
        .join(Model, Model.id == Deployment.model_id)
        .where(*clauses)
    )
    page = db.execute(
        joined.where(*clauses).order_by(Deployment.id.desc()).offset(skip).limit(limit)
    ).all()
    ids = [row.Deployment.id for row in page]
    counts = _state_counts(db, ids)
    waves = _waves(db, ids)
    versions = ReleaseVersions(settings.home)
    return DeploymentsPublic(
        data=[_public(d, name, counts[d.id], waves.get(d.id, 0), versions) for d, name in page],
        count=count or 0,
    )


def _load(db: Session, deployment_id: int, versions: ReleaseVersions) -> DeploymentDetailPublic:
    found = db.execute(
        sa.select(Deployment, Model.name)
        .join(Model, Model.id == Deployment.model_id)
        .where(Deployment.id == deployment_id)
    ).first()
    if found is None:
        raise HTTPException(http.HTTP_404_NOT_FOUND, f"no deployment {deployment_id}")
    deployment, model = found
    rows = db.scalars(
        sa.select(DeploymentDevice)
        .where(DeploymentDevice.deployment_id == deployment_id)
        .order_by(DeploymentDevice.wave, DeploymentDevice.device_id)
    ).all()
    counts = Counter(row.state for row in rows)
    waves = max((row.wave for row in rows), default=-1) + 1
    return DeploymentDetailPublic(
        deployment=_public(deployment, model, counts, waves, versions),
        devices=[DeploymentDevicePublic.model_validate(row) for row in rows],
    )


@router.get("/{deployment_id}", response_model=DeploymentDetailPublic)
def read_deployment(
    db: SessionDep, settings: SettingsDep, deployment_id: DeploymentId
) -> DeploymentDetailPublic:
    return _load(db, deployment_id, ReleaseVersions(settings.home))


@router.post("/{deployment_id}/abort", response_model=DeploymentDetailPublic)
def abort_deployment(
    request: Request,
    db: SessionDep,
    settings: SettingsDep,
    admin: CurrentAdmin,
    deployment_id: DeploymentId,
    body: DeploymentAbort,
) -> DeploymentDetailPublic:
    """Cancel a rollout: no wave starts after this one (the wave in flight finishes); 409 once
    it has ended."""
    deployments = Deployments(request.app.state.sessions)
    try:
        deployments.request_abort(deployment_id, actor=admin.actor, reason=body.reason)
    except LookupError as exc:
        raise HTTPException(http.HTTP_404_NOT_FOUND, str(exc)) from exc
    except AbortRefused as exc:
        raise HTTPException(http.HTTP_409_CONFLICT, str(exc)) from exc
    log.info("deployment %d: abort requested by %s", deployment_id, admin.actor)
    db.expire_all()
    return _load(db, deployment_id, ReleaseVersions(settings.home))
