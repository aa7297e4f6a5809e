"""`/me`: who the credentials belong to."""

from __future__ import annotations

from fastapi import APIRouter

from coordinator.web.api.deps import CurrentUser
from coordinator.web.api.schemas import MePublic

router = APIRouter(tags=["auth"])


@router.get("/me", response_model=MePublic)
def read_me(user: CurrentUser) -> MePublic:
    return MePublic(name=user.name, role=user.role)
