"""Dashboard login over HTTP on the real PostgreSQL: the signed cookie, CSRF on cookie writes,
redirects, revocation, audit events, and the signing key's rules."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventLog
from coordinator.db.models import ApiToken, utcnow
from coordinator.db.registry import DeviceRegistry
from coordinator.web.api.main import create_app, signing_key
from coordinator.web.auth import (
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    AdminStore,
    CookieSigner,
    LoginThrottle,
)
from core.settings import Settings

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


def test_logout_ends_the_login_on_the_server(site: Site) -> None:
    _log_in(site)
    cookie = site.client.cookies[SESSION_COOKIE]
    csrf = _csrf(site.client.get("/fleet").text)
    assert site.client.post("/logout", data={"csrf": csrf}).status_code == 303
    # A copy of the cookie (another tab, a stolen one) is refused from now on.
    site.client.cookies.set(SESSION_COOKIE, cookie)
    assert site.client.get("/api/v1/me").status_code == 401
    assert site.client.get("/fleet").status_code == 303
    # The bearer token the login was made with still works, and logs in again.
    site.client.cookies.clear()
    assert site.client.get("/api/v1/me", headers=_bearer(site.token)).status_code == 200
    _log_in(site)
    assert site.client.get("/api/v1/me").status_code == 200


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _throttled_app(engine: Engine, **settings: float) -> tuple[FastAPI, str]:
    sessions = make_sessionmaker(engine)
    _, token = AdminStore(sessions).create("bob")
    app = create_app(
        Settings(
            database_url=engine.url.render_as_string(hide_password=False),
            secret_key=SECRET,
            **settings,  # type: ignore[arg-type]
        ),
        engine,
    )
    return app, token


def test_failed_logins_are_throttled_per_client_address(pg_clean_engine: Engine) -> None:
    app, token = _throttled_app(pg_clean_engine, login_max_failures=3, login_window_s=60)
    with (
        TestClient(app, follow_redirects=False, client=("10.0.0.1", 1000)) as guesser,
        TestClient(app, follow_redirects=False, client=("10.0.0.2", 1000)) as other,
    ):
        for attempt in range(3):
            wrong = guesser.post("/login", data={"token": f"sft_wrong-{attempt}"})
            assert wrong.status_code == 401
        refused = guesser.post("/login", data={"token": token})  # even the right one, for now
        assert refused.status_code == 429
        assert 0 < int(refused.headers["Retry-After"]) <= 60
        assert "Too many failed logins" in refused.text
        assert other.post("/login", data={"token": token}).status_code == 303


def test_failed_logins_are_throttled_per_token_tried(pg_clean_engine: Engine) -> None:
    app, token = _throttled_app(pg_clean_engine, login_max_failures=3, login_window_s=60)
    # Someone who knows a token's prefix (it shows in listings) guesses the rest from many
    # addresses: that token's logins are throttled, other tokens' are not.
    guess = token[:12] + "x" * 20
    for address in range(3):
        with TestClient(app, follow_redirects=False, client=(f"10.0.1.{address}", 1)) as c:
            assert c.post("/login", data={"token": guess}).status_code == 401
    with TestClient(app, follow_redirects=False, client=("10.0.2.1", 1)) as fresh:
        assert fresh.post("/login", data={"token": guess}).status_code == 429


def test_login_throttle_window_slides() -> None:
    now = [0.0]
    throttle = LoginThrottle(2, 10.0, clock=lambda: now[0])
    throttle.failed(["a"])
    now[0] = 4.0
    throttle.failed(["a"])
    assert throttle.retry_after(["a"]) == pytest.approx(6.0)
    assert throttle.retry_after(["b"]) == 0
    now[0] = 10.5  # the first failure has left the window
    assert throttle.retry_after(["a"]) == 0


def test_tokens_expire(pg_clean_engine: Engine) -> None:
    app, token = _throttled_app(pg_clean_engine, api_token_ttl_days=1)
    with TestClient(app) as client:
        assert client.get("/api/v1/me", headers=_bearer(token)).status_code == 200
        with pg_clean_engine.begin() as connection:
            connection.execute(sa.update(ApiToken).values(created_at=utcnow() - timedelta(days=1)))
        expired = client.get("/api/v1/me", headers=_bearer(token))
        assert expired.status_code == 401
        assert client.post("/login", data={"token": token}).status_code == 401
