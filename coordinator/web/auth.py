"""Admins, their bearer tokens, and the signed cookie that keeps a dashboard login."""

from __future__ import annotations

import base64
import builtins
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db.events import append_event
from coordinator.db.models import Admin, AdminRole, ApiToken, utcnow

TOKEN_PREFIX = "sft_"
TOKEN_BYTES = 32
ADMIN_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,47}$")
# Seen-times are written at most this often per token, so reads do not turn into writes.
LAST_USED_RESOLUTION = timedelta(minutes=1)
# A dashboard login lasts this long; the token behind it can be revoked sooner.
SESSION_MAX_AGE_S = 12 * 3600
SESSION_COOKIE = "specfleet_session"
# A bearer token works this long after it was issued (Settings.api_token_ttl_days).
DEFAULT_TOKEN_TTL = timedelta(days=90)
# Each dashboard login is a token row of its own (with this prefix, no usable plaintext), so
# that logging out revokes that login on the server, not just the browser's cookie.
LOGIN_TOKEN_PREFIX = "login"


class AuthEvent(str, Enum):
    """Event kinds written by authentication and admin management."""

    ADMIN_CREATED = "admin.created"
    TOKEN_ISSUED = "admin.token_issued"
    TOKENS_REVOKED = "admin.tokens_revoked"
    LOGIN = "auth.login"
    LOGIN_FAILED = "auth.login_failed"
    LOGOUT = "auth.logout"


class AdminError(Exception):
    """A refused admin operation; the message says why."""


class AdminExistsError(AdminError):
    def __init__(self, name: str) -> None:
        super().__init__(f"admin {name!r} already exists")
        self.name = name


class AdminNotFoundError(AdminError, LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no admin {name!r}")
        self.name = name


def validate_admin_name(name: str) -> str:
    if not ADMIN_NAME_PATTERN.fullmatch(name):
        raise AdminError(
            f"invalid admin name {name!r}: 1-48 of a-z 0-9 . _ -, starting with a letter or digit"
        )
    return name


def actor_of(name: str) -> str:
    """How an admin appears in the event log, distinct from `cli` or `coordinator`."""
    return f"user:{name}"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def token_digest(token: str) -> str:
    # A slow password hash buys nothing for 256 random bits, and a digest can be looked up.
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is making a request, and through which token."""

    admin_id: int
    name: str
    role: AdminRole
    token_id: int

    @property
    def actor(self) -> str:
        return actor_of(self.name)

    @property
    def is_admin(self) -> bool:
        return self.role is AdminRole.ADMIN


class AdminStore:
    """Admins and tokens in the database; every change appends its event in the same commit."""

    def __init__(
        self, sessions: sessionmaker[Session], *, token_ttl: timedelta = DEFAULT_TOKEN_TTL
    ) -> None:
        self._sessions = sessions
        self._token_ttl = token_ttl

    def create(
        self, name: str, role: AdminRole | str = AdminRole.ADMIN, *, actor: str = "cli"
    ) -> tuple[Admin, str]:
        """A new admin and its first token; the plaintext token is returned here only."""
        validate_admin_name(name)
        admin_role = AdminRole(role)
        token = new_token()
        with self._sessions.begin() as session:
            if session.scalar(sa.select(Admin).where(Admin.name == name)) is not None:
                raise AdminExistsError(name)
            admin = Admin(name=name, role=admin_role, created_at=utcnow())
            session.add(admin)
            try:
                session.flush()
            except sa.exc.IntegrityError as exc:  # created concurrently
                raise AdminExistsError(name) from exc
            self._add_token(session, admin, token, label="initial")
            append_event(
                session,
                AuthEvent.ADMIN_CREATED,
                actor=actor,
                detail={"name": name, "role": admin_role.value},
            )
        return admin, token

    def issue_token(self, name: str, *, label: str = "", actor: str = "cli") -> str:
        token = new_token()
        with self._sessions.begin() as session:
            admin = self._load(session, name)
            self._add_token(session, admin, token, label=label)
            append_event(
                session,
                AuthEvent.TOKEN_ISSUED,
                actor=actor,
                detail={"name": name, "label": label, "prefix": token[:12]},
            )
        return token

    def revoke_tokens(self, name: str, *, actor: str = "cli") -> int:
        """Revoke every live token of `name` (and so every dashboard login made with them)."""
        now = utcnow()
        with self._sessions.begin() as session:
            admin = self._load(session, name)
            result = session.execute(
                sa.update(ApiToken)
                .where(ApiToken.admin_id == admin.id, ApiToken.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            revoked = int(getattr(result, "rowcount", 0) or 0)
            append_event(
                session,
                AuthEvent.TOKENS_REVOKED,
                actor=actor,
                detail={"name": name, "revoked": revoked},
            )
        return revoked

    def open_login(self, principal: Principal) -> int:
        """A dashboard login of `principal`: its own token row, which the cookie names."""
        now = utcnow()
        with self._sessions.begin() as session:
            # Logins that ended or aged out are of no further use; keep the table small.
            session.execute(
                sa.delete(ApiToken).where(
                    ApiToken.admin_id == principal.admin_id,
                    ApiToken.prefix == LOGIN_TOKEN_PREFIX,
                    sa.or_(
                        ApiToken.revoked_at.is_not(None),
                        ApiToken.created_at < now - timedelta(seconds=SESSION_MAX_AGE_S),
                    ),
                )
            )
            row = ApiToken(
                admin_id=principal.admin_id,
                token_sha256=token_digest(new_token()),  # never handed out
                prefix=LOGIN_TOKEN_PREFIX,
                label="dashboard",
                created_at=now,
            )
            session.add(row)
            session.flush()
            return row.id

    def close_login(self, token_id: int) -> bool:
        """Revoke one dashboard login; False if it was not a live login."""
        with self._sessions.begin() as session:
            result = session.execute(
                sa.update(ApiToken)
                .where(
                    ApiToken.id == token_id,
                    ApiToken.prefix == LOGIN_TOKEN_PREFIX,
                    ApiToken.revoked_at.is_(None),
                )
                .values(revoked_at=utcnow())
            )
            return bool(getattr(result, "rowcount", 0))

    def list(self) -> builtins.list[tuple[Admin, int]]:
        """Every admin with its number of live tokens (dashboard logins aside), by name."""
        live = (
            sa.select(ApiToken.admin_id, sa.func.count().label("n"))
            .where(ApiToken.revoked_at.is_(None), ApiToken.prefix != LOGIN_TOKEN_PREFIX)
            .group_by(ApiToken.admin_id)
            .subquery()
        )
        with self._sessions() as session:
            rows = session.execute(
                sa.select(Admin, sa.func.coalesce(live.c.n, 0))
                .outerjoin(live, live.c.admin_id == Admin.id)
                .order_by(Admin.name)
            )
            return [(admin, int(n)) for admin, n in rows]

    def authenticate(self, token: str) -> Principal | None:
        """The principal behind a bearer token; None if unknown, revoked or disabled."""
        if not token.startswith(TOKEN_PREFIX) or len(token) > 128:
            return None
        return self._principal(ApiToken.token_sha256 == token_digest(token))

    def principal_for_token_id(self, token_id: int) -> Principal | None:
        """The principal of a dashboard login (which remembers the token it was made with)."""
        return self._principal(ApiToken.id == token_id)

    def _principal(self, where: sa.ColumnElement[bool]) -> Principal | None:
        now = utcnow()
        with self._sessions() as session:
            row = session.execute(
                sa.select(ApiToken, Admin)
                .join(Admin, Admin.id == ApiToken.admin_id)
                .where(
                    where,
                    ApiToken.revoked_at.is_(None),
                    ApiToken.created_at > now - self._token_ttl,
                    Admin.disabled_at.is_(None),
                )
            ).first()
            if row is None:
                return None
            token_row, admin = row
            principal = Principal(admin.id, admin.name, admin.role, token_row.id)
            seen = token_row.last_used_at
            if seen is None or now - seen >= LAST_USED_RESOLUTION:
                session.execute(
                    sa.update(ApiToken).where(ApiToken.id == token_row.id).values(last_used_at=now)
                )
                session.commit()
        return principal

    @staticmethod
    def _load(session: Session, name: str) -> Admin:
        admin = session.scalar(sa.select(Admin).where(Admin.name == name))
        if admin is None:
            raise AdminNotFoundError(name)
        return admin

    @staticmethod
    def _add_token(session: Session, admin: Admin, token: str, *, label: str) -> None:
        session.add(
            ApiToken(
                admin_id=admin.id,
                token_sha256=token_digest(token),
                prefix=token[:12],
                label=label[:64],
                created_at=utcnow(),
            )
        )


class LoginThrottle:
    """Failed logins counted per key (client address, the token prefix tried) over a sliding
    window; a key at `max_failures` is refused until its oldest failure leaves the window.

    Kept in memory: one coordinator's count, reset by a restart. Called from the threads of
    sync routes, hence the lock.
    """

    # Keys beyond this are dropped oldest first, so a spray of addresses cannot grow it forever.
    MAX_KEYS = 100_000

    def __init__(
        self,
        max_failures: int,
        window_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, keys: Iterable[str]) -> float:
        """Seconds until every key may try again; 0 when none is throttled."""
        now = self._clock()
        wait = 0.0
        with self._lock:
            for key in keys:
                times = self._recent(key, now)
                if len(times) >= self.max_failures:
                    wait = max(wait, times[0] + self.window_s - now)
        return wait

    def failed(self, keys: Iterable[str]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                times = self._recent(key, now)
                times.append(now)
                self._failures[key] = times
                while len(times) > self.max_failures:
                    times.popleft()
            while len(self._failures) > self.MAX_KEYS:
                del self._failures[next(iter(self._failures))]

    def _recent(self, key: str, now: float) -> deque[float]:
        times = self._failures.pop(key, deque())  # re-inserted by `failed`: newest last
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if times:
            self._failures[key] = times
        return times


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class CookieSigner:
    """HMAC-SHA256 signed values for the login cookie and the CSRF token derived from it."""

    def __init__(self, secret_key: str) -> None:
        if not secret_key:
            raise ValueError("a signing key is required")
        # Separate keys per purpose, so a value signed for one is never valid for another.
        root = secret_key.encode()
        self._session_key = hmac.new(root, b"specfleet/session", hashlib.sha256).digest()
        self._csrf_key = hmac.new(root, b"specfleet/csrf", hashlib.sha256).digest()

    def dumps(self, claims: Mapping[str, int | str]) -> str:
        body = _b64(json.dumps(dict(claims), separators=(",", ":"), sort_keys=True).encode())
        signature = _b64(hmac.new(self._session_key, body.encode(), hashlib.sha256).digest())
        return f"{body}.{signature}"

    def loads(self, value: str) -> dict[str, int | str] | None:
        """The claims of a value this signer made; None if tampered with or malformed."""
        body, dot, signature = value.partition(".")
        if not dot or len(value) > 1024:
            return None
        expected = _b64(hmac.new(self._session_key, body.encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected, signature):
            return None
        try:
            claims = json.loads(_unb64(body))
        except ValueError:
            return None
        return claims if isinstance(claims, dict) else None

    def login_cookie(self, token_id: int, *, now: float | None = None) -> str:
        issued = int(time.time() if now is None else now)
        return self.dumps({"tid": token_id, "iat": issued, "n": secrets.token_hex(8)})

    def token_id_of(
        self, cookie: str, *, now: float | None = None, max_age_s: int = SESSION_MAX_AGE_S
    ) -> int | None:
        """The token id a login cookie stands for, while it is fresh."""
        claims = self.loads(cookie)
        if claims is None:
            return None
        token_id, issued = claims.get("tid"), claims.get("iat")
        if not isinstance(token_id, int) or not isinstance(issued, int):
            return None
        age = (time.time() if now is None else now) - issued
        if not 0 <= age <= max_age_s:
            return None
        return token_id

    def csrf_token(self, cookie: str) -> str:
        return _b64(hmac.new(self._csrf_key, cookie.encode(), hashlib.sha256).digest())

    def check_csrf(self, cookie: str, token: str) -> bool:
        return hmac.compare_digest(self.csrf_token(cookie), token)
