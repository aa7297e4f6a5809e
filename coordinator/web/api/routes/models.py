"""`/models`: the model registry (the `models` table) joined with the manifests on disk."""

from __future__ import annotations

from typing import Annotated, Literal

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, Query
from fastapi import status as http

from coordinator.db.models import Model, ModelRole
from coordinator.web.api.deps import SessionDep, SettingsDep
from coordinator.web.api.paging import Skip
from coordinator.web.api.schemas import ModelPublic, ModelsPublic
from inference.artifacts import ArtifactError, ModelManifest, list_models

MAX_PAGE = 1000
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"

router = APIRouter(prefix="/models", tags=["models"])


def _merge(rows: list[Model], manifests: list[ModelManifest]) -> list[ModelPublic]:
    on_disk = {m.name: m for m in manifests}
    merged: list[ModelPublic] = []
    for row in rows:
        manifest = on_disk.pop(row.name, None)
        merged.append(
            ModelPublic(
                name=row.name,
                role=row.role,
                format=row.format,
                sha256=row.sha256,
                size_bytes=row.size_bytes,
                tokenizer_sha256=row.tokenizer_sha256,
                location=row.location,
                precision=manifest.precision if manifest else None,
                registered=True,
                on_disk=manifest is not None,
                sha256_mismatch=manifest is not None and manifest.sha256 != row.sha256,
                created_at=row.created_at,
            )
        )
    for manifest in on_disk.values():
        merged.append(
            ModelPublic(
                name=manifest.name,
                role=ModelRole(manifest.role),
                format=manifest.format,
                sha256=manifest.sha256,
                size_bytes=manifest.size_bytes,
                tokenizer_sha256=manifest.tokenizer_sha256,
                location=None,
                precision=manifest.precision,
                registered=False,
                on_disk=True,
                sha256_mismatch=False,
                created_at=None,
            )
        )
    # Targets first, then drafts, each by name: the order of `specfleet models list`.
    return sorted(merged, key=lambda m: (m.role is not ModelRole.TARGET, m.name))


def _all_models(db: SessionDep, settings: SettingsDep) -> list[ModelPublic]:
    rows = list(db.scalars(sa.select(Model)))
    try:
        manifests = [m for _, m in list_models(settings.resolved_models_dir)]
    except ArtifactError as exc:
        raise HTTPException(
            http.HTTP_503_SERVICE_UNAVAILABLE, f"the models directory is unreadable: {exc}"
        ) from exc
    return _merge(rows, manifests)


@router.get("", response_model=ModelsPublic)
def list_registry(
    db: SessionDep,
    settings: SettingsDep,
    role: ModelRole | None = None,
    format: Annotated[str | None, Query(min_length=1, max_length=32)] = None,
    source: Literal["registry", "disk"] | None = None,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> ModelsPublic:
    """Registered models and built ones in the models directory, with sha256 and sizes."""
    models = _all_models(db, settings)
    if role is not None:
        models = [m for m in models if m.role is role]
    if format is not None:
        models = [m for m in models if m.format == format]
    if source == "registry":
        models = [m for m in models if m.registered]
    elif source == "disk":
        models = [m for m in models if m.on_disk]
    return ModelsPublic(data=models[skip : skip + limit], count=len(models))


@router.get("/{name}", response_model=ModelPublic)
def read_model(
    db: SessionDep,
    settings: SettingsDep,
    name: Annotated[str, Path(pattern=MODEL_NAME_PATTERN)],
) -> ModelPublic:
    for model in _all_models(db, settings):
        if model.name == name:
            return model
    raise HTTPException(http.HTTP_404_NOT_FOUND, f"no model {name!r}")
