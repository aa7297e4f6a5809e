"""`/artifacts/{sha256}`: signed model artifacts for devices, which log in as they do on the bus."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path
from fastapi.responses import FileResponse
from fastapi.security import HTTPBasic, HTTPBasicCredentials

from broker.model_release import SHA256_PATTERN
from broker.passwords import CredentialHashError, verify_credential
from coordinator.api.deps import SessionDep, SettingsDep
from coordinator.db.models import Device, DeviceStatus
from coordinator.releases import artifact_path

router = APIRouter(prefix="/artifacts", tags=["artifacts"])

_basic = HTTPBasic(auto_error=False, realm="specfleet devices")
Sha256 = Annotated[str, Path(pattern=SHA256_PATTERN, description="the artifact's sha256")]


def _refuse() -> HTTPException:
    return HTTPException(
        status_code=401,
        detail="a device id and its credential are required",
        headers={"WWW-Authenticate": 'Basic realm="specfleet devices"'},
    )


def current_device(
    session: SessionDep,
    credentials: Annotated[HTTPBasicCredentials | None, Depends(_basic)],
) -> str:
    """The device behind HTTP Basic credentials (its id and bus credential); 401 otherwise."""
    if credentials is None:
        raise _refuse()
    device = session.get(Device, credentials.username)
    if device is None or device.status is DeviceStatus.RETIRED:
        raise _refuse()
    try:
        valid = verify_credential(credentials.password, device.credential_hash)
    except CredentialHashError:
        valid = False
    if not valid:
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
