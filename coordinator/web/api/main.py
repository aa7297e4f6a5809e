"""The FastAPI application of the coordinator, built around an engine the caller owns."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from datetime import timedelta

from anyio import to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from sqlalchemy.engine import Engine
from starlette.exceptions import HTTPException
from starlette.types import Scope

from coordinator.db.engine import make_sessionmaker
from coordinator.live import CoordinatorControl, VerifierLoad
from coordinator.runtime.metrics import CoordinatorMetrics
from coordinator.web.api.deps import get_current_user
from coordinator.web.api.docs import mount_api_docs
from coordinator.web.api.limits import BodyLimits, Refusal, RequestBodyGuard
from coordinator.web.api.routes import (
    artifacts,
    auth,
    deployments,
    devices,
    events,
    health,
    metrics,
    models,
    sessions,
    stats,
    verifiers,
)
from coordinator.web.auth import AdminStore, CookieSigner, LoginThrottle
from core.settings import Settings

API_PREFIX = "/api/v1"
# Model releases are the only bodies the API is meant to take in bulk; every other body is a
# small JSON document. (Releases are published from the CLI today: no route here takes one yet.)
UPLOAD_PREFIXES = (f"{API_PREFIX}/models",)
# Devices authenticate there with a download token, not an admin's credentials.
DEVICE_PREFIXES = (f"{API_PREFIX}/artifacts",)

log = logging.getLogger(__name__)

# Every resource needs credentials; `/me` checks them itself.
api_router = APIRouter(dependencies=[Depends(get_current_user)])
for module in (devices, sessions, models, deployments, verifiers, events, stats):
    api_router.include_router(module.router)
api_router.include_router(auth.router)


def signing_key(settings: Settings) -> str:
    """The secret that signs login cookies: the configured one, or (quickstart only) a random
    one per process, which logs everyone out when the process restarts."""
    if settings.secret_key:
        return settings.secret_key
    if settings.environment != "quickstart":
        # Settings refuses this already; the check stays here because cookies depend on it.
        raise ValueError("SPECFLEET_SECRET_KEY must be set outside the quickstart")
    log.info("no SPECFLEET_SECRET_KEY: dashboard logins last until this process stops")
    return secrets.token_urlsafe(32)


async def login_first(scope: Scope) -> Refusal | None:
    """Bodies sent to the admin API are read only for an authenticated caller."""
    path: str = scope["path"]
    if not path.startswith(f"{API_PREFIX}/") or path.startswith(DEVICE_PREFIXES):
        return None
    try:
        # The token lookup is a database query: off the event loop.
        await to_thread.run_sync(get_current_user, Request(scope))
    except HTTPException as exc:
        return exc.status_code, str(exc.detail), dict(exc.headers or {})
    return None


def create_app(
    settings: Settings,
    engine: Engine,
    *,
    control: CoordinatorControl | None = None,
    metrics_registry: CoordinatorMetrics | None = None,
) -> FastAPI:
    """The app; the engine's lifetime (and disposal) stays with the caller.

    `control` is the running coordinator service (see coordinator.live); it may also be set
    later as `app.state.control`. `app.state.metrics` is the CoordinatorMetrics the decoding
    loop reports rounds to.
    """
    from coordinator.web.dashboard.pages import mount_dashboard

    app = FastAPI(
        title="specfleet coordinator",
        description="Admin API of a specfleet fleet: devices, sessions, models, verifiers, "
        "events. Authenticate with `Authorization: Bearer TOKEN` (`specfleet admin create`).",
        openapi_url=f"{API_PREFIX}/openapi.json",
        docs_url=None,  # served by mount_api_docs, with no CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.sessions = make_sessionmaker(engine)
    app.state.admins = AdminStore(
        app.state.sessions, token_ttl=timedelta(days=settings.api_token_ttl_days)
    )
    app.state.login_throttle = LoginThrottle(settings.login_max_failures, settings.login_window_s)
    app.state.signer = CookieSigner(signing_key(settings))
    app.state.control = control

    def verifier_loads() -> Sequence[VerifierLoad]:
        live: CoordinatorControl | None = app.state.control
        return live.verifier_loads() if live is not None else ()

    registry = metrics_registry or CoordinatorMetrics()
    registry.bind_database(app.state.sessions)
    registry.bind_live(verifier_loads)
    app.state.metrics = registry

    app.include_router(api_router, prefix=API_PREFIX)
    app.include_router(metrics.router)
    app.include_router(health.router)
    # Devices fetch artifacts with the download token of their deploy_model command.
    app.include_router(artifacts.router, prefix=API_PREFIX)
    mount_dashboard(app)
    mount_api_docs(app, f"{API_PREFIX}/docs", f"{API_PREFIX}/openapi.json")
    limits = BodyLimits(
        settings.http_max_body_bytes,
        [(prefix, settings.http_max_upload_bytes) for prefix in UPLOAD_PREFIXES],
    )
    app.add_middleware(RequestBodyGuard, limits=limits, gate=login_first)
    return app
