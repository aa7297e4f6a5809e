"""Dashboard login over HTTP on the real PostgreSQL: the signed cookie, CSRF on cookie writes,
redirects, revocation, audit events, and the signing key's rules."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.engine import Engine

from coordinator.api.main import create_app, signing_key
from coordinator.auth import SESSION_COOKIE, SESSION_MAX_AGE_S, AdminStore, CookieSigner
from coordinator.db.engine import make_sessionmaker
from coordinator.events import EventLog
from coordinator.registry import DeviceRegistry
from coordinator.settings import Settings

SECRET = "a-test-secret-of-32-characters!!"


@dataclass(frozen=True)
class Site:
    client: TestClient
    token: str
    store: AdminStore
    events: EventLog


@pytest.fixture
def site(pg_clean_engine: Engine) -> Iterator[Site]:
    sessions = make_sessionmaker(pg_clean_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision("pi-1", "pi")
    store = AdminStore(sessions)
    _, token = store.create("alice")
    settings = Settings(
        database_url=pg_clean_engine.url.render_as_string(hide_password=False),
        secret_key=SECRET,
    )
    with TestClient(create_app(settings, pg_clean_engine), follow_redirects=False) as client:
        yield Site(client, token, store, EventLog(sessions))


def _log_in(site: Site, next_page: str = "/fleet") -> str:
    response = site.client.post("/login", data={"token": site.token, "next": next_page})
    assert response.status_code == 303
    return response.headers["location"]


def _csrf(page_html: str) -> str:
    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page_html)
    assert match, page_html[:500]
    return match.group(1)


@pytest.mark.parametrize("page", ["/fleet", "/sessions", "/charts", "/models", "/events"])
def test_pages_send_strangers_to_the_login_page(site: Site, page: str) -> None:
    response = site.client.get(page + "?x=1")
    assert response.status_code == 303
    assert response.headers["location"] == f"/login?next={page.replace('/', '%2F')}%3Fx%3D1"


def test_logging_in_sets_a_signed_http_only_cookie_and_is_audited(site: Site) -> None:
    assert _log_in(site, "/models") == "/models"
    cookie = site.client.cookies[SESSION_COOKIE]
    assert CookieSigner(SECRET).token_id_of(cookie) is not None
    page = site.client.get("/models")
    assert page.status_code == 200
    assert 'data-testid="user-name">alice<' in page.text
    assert site.client.get("/api/v1/me").json() == {"name": "alice", "role": "admin"}
    (event,) = site.events.list(kind="auth.login")
    assert event.actor == "user:alice"
    assert event.detail["via"] == "dashboard"


def test_the_cookie_is_http_only_and_same_site(site: Site) -> None:
    response = site.client.post("/login", data={"token": site.token})
    header = response.headers["set-cookie"].lower()
    assert "httponly" in header
    assert "samesite=lax" in header
    assert f"max-age={SESSION_MAX_AGE_S}" in header


def test_a_wrong_token_is_refused_and_logged(site: Site) -> None:
    response = site.client.post("/login", data={"token": "sft_wrong"})
    assert response.status_code == 401
    assert "That token is not valid." in response.text
    assert SESSION_COOKIE not in site.client.cookies
    (event,) = site.events.list(kind="auth.login_failed")
    assert event.actor == "anonymous"


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example", "/\\evil", ""])
def test_login_never_redirects_off_site(site: Site, target: str) -> None:
    assert _log_in(site, target) == "/fleet"


def test_cookie_writes_need_the_csrf_token_of_the_page(site: Site) -> None:
    _log_in(site)
    url, body = "/api/v1/devices/pi-1/tags", {"tags": ["lab"]}
    refused = site.client.put(url, json=body)
    assert refused.status_code == 403
    assert refused.json() == {"detail": "missing or wrong CSRF token"}
    wrong = site.client.put(url, json=body, headers={"X-CSRF-Token": "forged"})
    assert wrong.status_code == 403
    csrf = _csrf(site.client.get("/fleet").text)
    accepted = site.client.put(url, json=body, headers={"X-CSRF-Token": csrf})
    assert accepted.status_code == 200
    (event,) = site.events.list(kind="device.tagged")
    assert event.actor == "user:alice"


def test_a_tampered_or_revoked_login_is_401(site: Site) -> None:
    _log_in(site)
    cookie = site.client.cookies[SESSION_COOKIE]
    body, signature = cookie.split(".")
    site.client.cookies.clear()
    site.client.cookies.set(SESSION_COOKIE, body + "." + signature[::-1])
    response = site.client.get("/api/v1/devices")
    assert response.status_code == 401
    assert "log in again" in response.json()["detail"]
    assert site.client.get("/fleet").status_code == 303

    site.client.cookies.clear()
    site.client.cookies.set(SESSION_COOKIE, cookie)
    assert site.client.get("/api/v1/devices").status_code == 200
    site.store.revoke_tokens("alice")
    assert site.client.get("/api/v1/devices").status_code == 401


def test_logout_clears_the_cookie_and_is_audited(site: Site) -> None:
    _log_in(site)
    csrf = _csrf(site.client.get("/fleet").text)
    response = site.client.post("/logout", data={"csrf": csrf})
    assert response.status_code == 303
    assert response.headers["location"] == "/login"
    assert SESSION_COOKIE not in site.client.cookies
    assert site.client.get("/fleet").status_code == 303
    assert [e.actor for e in site.events.list(kind="auth.logout")] == ["user:alice"]


def test_static_assets_are_served_from_the_app(site: Site) -> None:
    for path, kind in (
        ("/static/app.css", "text/css"),
        ("/static/app.js", "javascript"),
        ("/static/session.js", "javascript"),
    ):
        response = site.client.get(path)
        assert response.status_code == 200
        assert kind in response.headers["content-type"]
    # No page refers to anything outside the app (no CDN: there may be no internet).
    site.client.post("/login", data={"token": site.token})
    for page in ("/fleet", "/sessions", "/charts", "/models", "/events", "/login"):
        html = site.client.get(page).text
        assert not re.search(r"""(src|href)=["']https?://""", html), page


@pytest.mark.parametrize(
    ("claims_age_s", "valid"),
    [(0, True), (SESSION_MAX_AGE_S - 1, True), (SESSION_MAX_AGE_S + 1, False)],
)
def test_login_cookies_expire(claims_age_s: int, valid: bool) -> None:
    signer = CookieSigner(SECRET)
    cookie = signer.login_cookie(42, now=1_000_000.0)
    assert (signer.token_id_of(cookie, now=1_000_000.0 + claims_age_s) == 42) is valid
    assert CookieSigner("another-secret-of-32-characters!").token_id_of(cookie) is None


def test_the_signing_key_rules() -> None:
    assert signing_key(Settings(secret_key=SECRET)) == SECRET
    generated = signing_key(Settings())  # quickstart without a key: random per process
    assert len(generated) >= 32 and generated != signing_key(Settings())
    with pytest.raises(ValidationError, match="SPECFLEET_SECRET_KEY"):
        Settings(environment="production", secret_key="")
    with pytest.raises(ValidationError, match="SPECFLEET_SECRET_KEY"):
        Settings(environment="production", secret_key="changeme")
