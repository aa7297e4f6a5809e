"""The FastAPI application of the coordinator, built around an engine the caller owns."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from sqlalchemy.engine import Engine

from coordinator.api.routes import devices
from coordinator.db.engine import make_sessionmaker
from coordinator.settings import Settings

API_PREFIX = "/api/v1"

api_router = APIRouter()
api_router.include_router(devices.router)


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    """The app; the engine's lifetime (and disposal) stays with the caller."""
    app = FastAPI(title="specfleet coordinator", openapi_url=f"{API_PREFIX}/openapi.json")
    app.state.settings = settings
    app.state.sessions = make_sessionmaker(engine)
    app.include_router(api_router, prefix=API_PREFIX)
    return app
