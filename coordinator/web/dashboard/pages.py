"""Dashboard pages: server-rendered shells whose scripts read /api/v1 with the login cookie."""

from __future__ import annotations

import math
import uuid
from pathlib import Path as FsPath
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Form, Path, Request
from fastapi import status as http
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from broker.topics import DEVICE_ID_PATTERN
from coordinator.db.events import EventLog
from coordinator.web.api.deps import get_admins, get_signer, principal_from_cookie
from coordinator.web.api.paging import MAX_ROW_ID
from coordinator.web.auth import (
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    AuthEvent,
    LoginThrottle,
    Principal,
)
from core.settings import Settings

HERE = FsPath(__file__).resolve().parent
templates = Jinja2Templates(directory=HERE / "templates")

router = APIRouter(include_in_schema=False)

# The pages of the navigation bar, in order: (path, title).
NAV = (
    ("/fleet", "Fleet"),
    ("/sessions", "Sessions"),
    ("/charts", "Charts"),
    ("/models", "Models"),
    ("/deployments", "Deployments"),
    ("/events", "Events"),
)


def _safe_next(target: str | None) -> str:
    # Only paths on this site: "//host" and "https://..." would send the user elsewhere.
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/fleet"
    return target


def _page(
    request: Request, template: str, user: Principal, title: str, **context: Any
) -> HTMLResponse:
    cookie = request.cookies.get(SESSION_COOKIE, "")
    return templates.TemplateResponse(
        request,
        template,
        {
            "user": user,
            "title": title,
            "nav": NAV,
            "path": request.url.path,
            "csrf": get_signer(request).csrf_token(cookie),
            **context,
        },
    )


def _login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(
        f"/login?next={quote(target, safe='')}", status_code=http.HTTP_303_SEE_OTHER
    )


def _render(request: Request, template: str, title: str, **context: Any) -> Response:
    user = principal_from_cookie(request)
    if user is None:
        return _login_redirect(request)
    return _page(request, template, user, title, **context)


def _event_log(request: Request) -> EventLog:
    return EventLog(request.app.state.sessions)


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/fleet", status_code=http.HTTP_303_SEE_OTHER)


@router.get("/login")
def login_form(request: Request, next: str | None = None) -> Response:
    if principal_from_cookie(request) is not None:
        return RedirectResponse(_safe_next(next), status_code=http.HTTP_303_SEE_OTHER)
    return templates.TemplateResponse(
        request, "login.html", {"next": _safe_next(next), "error": None, "title": "Log in"}
    )


def _login_keys(request: Request, token: str) -> tuple[str, ...]:
    client = request.client.host if request.client else "unknown"
    # The prefix is how a token is told apart (listings, events): guessing the rest of one
    # admin's token is throttled as that admin, whatever addresses it comes from.
    return (f"client:{client}", f"token:{token[:12]}")


@router.post("/login")
def login(
    request: Request,
    token: Annotated[str, Form(max_length=256)],
    next: Annotated[str, Form(max_length=2048)] = "/fleet",
) -> Response:
    throttle: LoginThrottle = request.app.state.login_throttle
    keys = _login_keys(request, token.strip())
    wait = throttle.retry_after(keys)
    if wait > 0:
        retry = str(math.ceil(wait))
        return templates.TemplateResponse(
            request,
            "login.html",
            {
                "next": _safe_next(next),
                "error": f"Too many failed logins: try again in {retry} s.",
                "title": "Log in",
            },
            status_code=http.HTTP_429_TOO_MANY_REQUESTS,
            headers={"Retry-After": retry},
        )
    principal = get_admins(request).authenticate(token.strip())
    client = request.client.host if request.client else "unknown"
    if principal is None:
        throttle.failed(keys)
        _event_log(request).append(
            AuthEvent.LOGIN_FAILED, actor="anonymous", detail={"client": client}
        )
        return templates.TemplateResponse(
            request,
            "login.html",
            {"next": _safe_next(next), "error": "That token is not valid.", "title": "Log in"},
            status_code=http.HTTP_401_UNAUTHORIZED,
        )
    login_id = get_admins(request).open_login(principal)
    _event_log(request).append(
        AuthEvent.LOGIN, actor=principal.actor, detail={"client": client, "via": "dashboard"}
    )
    response = RedirectResponse(_safe_next(next), status_code=http.HTTP_303_SEE_OTHER)
    settings: Settings = request.app.state.settings
    response.set_cookie(
        SESSION_COOKIE,
        get_signer(request).login_cookie(login_id),
        max_age=SESSION_MAX_AGE_S,
        httponly=True,
        samesite="lax",
        secure=settings.environment == "production",
    )
    return response


@router.post("/logout")
def logout(request: Request, csrf: Annotated[str, Form(max_length=256)] = "") -> Response:
    cookie = request.cookies.get(SESSION_COOKIE, "")
    user = principal_from_cookie(request)
    if user is not None and get_signer(request).check_csrf(cookie, csrf):
        # The cookie's login ends on the server too: a copy of the cookie is worth nothing.
        get_admins(request).close_login(user.token_id)
        _event_log(request).append(AuthEvent.LOGOUT, actor=user.actor)
    response = RedirectResponse("/login", status_code=http.HTTP_303_SEE_OTHER)
    response.delete_cookie(SESSION_COOKIE)
    return response


@router.get("/fleet")
def fleet_page(request: Request) -> Response:
    return _render(request, "fleet.html", "Fleet")


@router.get("/sessions")
def sessions_page(request: Request) -> Response:
    return _render(request, "sessions.html", "Sessions")


@router.get("/sessions/{session_id}")
def session_page(request: Request, session_id: uuid.UUID) -> Response:
    return _render(request, "session.html", "Session", session_id=str(session_id))


@router.get("/charts")
def charts_page(request: Request) -> Response:
    return _render(request, "charts.html", "Charts")


@router.get("/models")
def models_page(request: Request) -> Response:
    return _render(request, "models.html", "Models")


@router.get("/deployments")
def deployments_page(request: Request) -> Response:
    return _render(request, "deployments.html", "Deployments")


@router.get("/deployments/{deployment_id}")
def deployment_page(
    request: Request, deployment_id: Annotated[int, Path(ge=1, le=MAX_ROW_ID)]
) -> Response:
    return _render(request, "deployment.html", "Deployment", deployment_id=deployment_id)


@router.get("/devices/{device_id}")
def device_page(
    request: Request, device_id: Annotated[str, Path(pattern=DEVICE_ID_PATTERN.pattern)]
) -> Response:
    return _render(request, "device.html", "Device", device_id=device_id)


@router.get("/events")
def events_page(request: Request) -> Response:
    return _render(request, "events.html", "Events")


def mount_dashboard(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
