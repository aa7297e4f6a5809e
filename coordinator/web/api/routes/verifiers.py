"""`/verifiers`: live load of the verifier workers, as the coordinator service last heard it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from coordinator.web.api.deps import OptionalControlDep
from coordinator.web.api.paging import Skip
from coordinator.web.api.schemas import VerifierPublic, VerifiersPublic

MAX_PAGE = 1000

router = APIRouter(prefix="/verifiers", tags=["verifiers"])


@router.get("", response_model=VerifiersPublic)
def list_verifiers(
    control: OptionalControlDep,
    online: bool | None = None,
    skip: Skip = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> VerifiersPublic:
    """Verifiers by id; `live` is false when no coordinator service runs in this process."""
    if control is None:
        return VerifiersPublic(data=[], count=0, live=False)
    loads = sorted(control.verifier_loads(), key=lambda load: load.verifier_id)
    if online is not None:
        loads = [load for load in loads if load.online is online]
    page = [VerifierPublic.model_validate(load) for load in loads[skip : skip + limit]]
    return VerifiersPublic(data=page, count=len(loads), live=True)
