"""Request bodies are bounded and, where the API needs a login, authenticated before they are read.

A pure ASGI middleware, so nothing reads a body before it has decided: a declared
Content-Length over the limit is refused with 413 at once, a chunked body is counted as it
arrives and refused with 413 the moment it passes the limit, and a request to a route behind a
login is answered 401 before a byte of its body is read.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The gate returns None to let a request through, or the refusal to send instead:
# (status, detail, extra headers).
Refusal = tuple[int, str, dict[str, str]]
Gate = Callable[[Scope], Awaitable[Refusal | None]]


class BodyTooLargeError(Exception):
    """Raised into the app when a streamed body passes its limit (the 413 is already sent)."""


@dataclass(frozen=True)
class BodyLimits:
    """The default limit, and larger ones for path prefixes that take uploads."""

    default_bytes: int
    uploads: Sequence[tuple[str, int]] = ()

    def for_path(self, path: str) -> int:
        for prefix, limit in self.uploads:
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return limit
        return self.default_bytes


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


async def _refuse(send: Send, refusal: Refusal) -> None:
    status, detail, headers = refusal
    body = json.dumps({"detail": detail}).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        # The client may still be sending: tell it this connection ends here.
        (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def too_large(limit: int) -> Refusal:
    return 413, f"request body larger than {limit} bytes", {}


class RequestBodyGuard:
    """Refuse oversized bodies (413) and, through `gate`, unauthenticated ones (401) unread."""

    def __init__(self, app: ASGIApp, *, limits: BodyLimits, gate: Gate | None = None) -> None:
        self.app = app
        self.limits = limits
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.for_path(scope["path"])
        declared = _header(scope, b"content-length")
        has_body = _header(scope, b"transfer-encoding") is not None or declared not in (None, b"0")
        if has_body and self.gate is not None:
            refusal = await self.gate(scope)
            if refusal is not None:
                await _refuse(send, refusal)
                return
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _refuse(send, (400, "Content-Length is not a number", {}))
                return
            if length > limit:
                await _refuse(send, too_large(limit))
                return
        await self._capped(scope, receive, send, limit)

    async def _capped(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """Pass the request on, counting its body; past `limit` answer 413 and stop reading."""
        received = 0
        started = False
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if not started and not refused:
                        refused = True
                        await _refuse(send, too_large(limit))
                    raise BodyTooLargeError(f"body passed {limit} bytes")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; what the app makes of the error is not sent
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLargeError:
            if not refused:
                raise
