"""`/artifacts/{sha256}`: signed model artifacts for devices, fetched with a download token.

The token comes in the device's `deploy_model` command (see coordinator.releases): it names the
artifact and the device, and expires within minutes. Devices never send their bus credential here.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path
from fastapi.responses import FileResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from broker.model_release import SHA256_PATTERN, ReleaseError, load_public_key
from coordinator.db.models import Device, DeviceStatus
from coordinator.ops.releases import artifact_path, check_download_token, release_public_key_pem
from coordinator.web.api.deps import SessionDep, SettingsDep

router = APIRouter(prefix="/artifacts", tags=["artifacts"])

_bearer = HTTPBearer(auto_error=False)
Sha256 = Annotated[str, Path(pattern=SHA256_PATTERN, description="the artifact's sha256")]


def _refuse() -> HTTPException:
    return HTTPException(
        status_code=401,
        detail="a download token for this artifact is required (it comes with deploy_model)",
        headers={"WWW-Authenticate": "Bearer"},
    )


def current_device(
    sha256: Sha256,
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The device a valid download token for this artifact was issued to; 401 otherwise."""
    if credentials is None:
        raise _refuse()
    try:
        public_key = load_public_key(release_public_key_pem(settings.home))
    except ReleaseError as exc:
        raise HTTPException(503, f"the release key is unreadable: {exc}") from exc
    device_id = check_download_token(public_key, credentials.credentials, sha256)
    if device_id is None:
        raise _refuse()
    device = session.get(Device, device_id)
    if device is None or device.status is DeviceStatus.RETIRED:
        raise _refuse()
    return device.id


CurrentDevice = Annotated[str, Depends(current_device)]


@router.get("/{sha256}", response_class=FileResponse)
# HEAD serves the same response without a body; one operation in the OpenAPI document is enough.
@router.head("/{sha256}", response_class=FileResponse, include_in_schema=False)
def download_artifact(
    sha256: Sha256, device_id: CurrentDevice, settings: SettingsDep
) -> FileResponse:
    """The artifact's bytes; devices check them against the signed sha256 and size."""
    path = artifact_path(settings.home, sha256)
    if not path.is_file():
        raise HTTPException(status_code=404, detail=f"no artifact {sha256}")
    return FileResponse(path, media_type="application/x-tar", filename=path.name)
