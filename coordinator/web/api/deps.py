"""Shared request dependencies, as `Annotated` aliases for route signatures."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session, sessionmaker

from coordinator.live import CoordinatorControl
from coordinator.replay import TokenDecoder, target_tokenizer
from coordinator.runtime.metrics import CoordinatorMetrics
from coordinator.web.auth import SESSION_COOKIE, AdminStore, CookieSigner, Principal
from core.settings import Settings

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CSRF_HEADER = "X-CSRF-Token"
BEARER_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def get_db(request: Request) -> Iterator[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    with sessions() as session:
        yield session


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_admins(request: Request) -> AdminStore:
    admins: AdminStore = request.app.state.admins
    return admins


def get_signer(request: Request) -> CookieSigner:
    signer: CookieSigner = request.app.state.signer
    return signer


def get_metrics(request: Request) -> CoordinatorMetrics:
    metrics: CoordinatorMetrics = request.app.state.metrics
    return metrics


def get_control(request: Request) -> CoordinatorControl | None:
    control: CoordinatorControl | None = getattr(request.app.state, "control", None)
    return control


def require_control(request: Request) -> CoordinatorControl:
    control = get_control(request)
    if control is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "no coordinator service is attached to this API process (start it with `specfleet up`)",
        )
    return control


def get_token_decoder(request: Request) -> TokenDecoder | None:
    """The target's tokenizer, loaded on first use; None when no target is built here."""
    state = request.app.state
    if not getattr(state, "token_decoder_loaded", False):
        settings: Settings = state.settings
        try:
            state.token_decoder = target_tokenizer(settings.resolved_models_dir, settings.target)
        except Exception as exc:  # the tokenizers library raises bare Exception
            # Token ids still show; a broken tokenizer file must not take the pages down.
            log.warning("no token text: the target's tokenizer did not load: %s", exc)
            state.token_decoder = None
        state.token_decoder_loaded = True
    decoder: TokenDecoder | None = state.token_decoder
    return decoder


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers=BEARER_CHALLENGE)


def principal_from_cookie(request: Request) -> Principal | None:
    """The dashboard login behind the request's cookie, if it is valid and fresh."""
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        return None
    token_id = get_signer(request).token_id_of(cookie)
    if token_id is None:
        return None
    return get_admins(request).principal_for_token_id(token_id)


def get_current_user(request: Request) -> Principal:
    """A bearer token (scripts) or the dashboard's login cookie (browsers); 401 otherwise."""
    header = request.headers.get("Authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("malformed Authorization header: expected 'Bearer TOKEN'")
        principal = get_admins(request).authenticate(token.strip())
        if principal is None:
            raise _unauthorized("invalid or revoked token")
        return principal
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        principal = principal_from_cookie(request)
        if principal is None:
            raise _unauthorized("the login has expired or was revoked: log in again")
        if request.method not in SAFE_METHODS:
            # A cookie rides along with cross-site requests; the CSRF token cannot.
            sent = request.headers.get(CSRF_HEADER, "")
            if not get_signer(request).check_csrf(cookie, sent):
                raise HTTPException(status.HTTP_403_FORBIDDEN, "missing or wrong CSRF token")
        return principal
    raise _unauthorized(
        "not authenticated: send 'Authorization: Bearer TOKEN' (tokens come from "
        "`specfleet admin create`)"
    )


def get_current_admin(user: Annotated[Principal, Depends(get_current_user)]) -> Principal:
    if not user.is_admin:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"{user.name!r} is a {user.role.value}: admins only"
        )
    return user


SessionDep = Annotated[Session, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
AdminsDep = Annotated[AdminStore, Depends(get_admins)]
SignerDep = Annotated[CookieSigner, Depends(get_signer)]
MetricsDep = Annotated[CoordinatorMetrics, Depends(get_metrics)]
ControlDep = Annotated[CoordinatorControl, Depends(require_control)]
OptionalControlDep = Annotated[CoordinatorControl | None, Depends(get_control)]
TokenDecoderDep = Annotated[TokenDecoder | None, Depends(get_token_decoder)]
CurrentUser = Annotated[Principal, Depends(get_current_user)]
CurrentAdmin = Annotated[Principal, Depends(get_current_admin)]
