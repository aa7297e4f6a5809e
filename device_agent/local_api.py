"""The agent's HTTP API for apps on the device, on loopback: start sessions and stream their text.

Plain asyncio streams keep the agent's footprint small (no web framework on a Pi). Routes:

- `GET /v1/health`: the agent, its bus link and its drafters.
- `POST /v1/sessions` with a JSON `SessionRequest`: a Server-Sent Events stream of the session,
  `event: session` (its id), `event: text` (`{"delta": ...}`) per committed piece of text, then
  `event: done` with the summary, or `event: error` when it failed or was cancelled. A client
  that hangs up cancels the session. In local mode (the coordinator out of reach) the agent
  generates alone: `event: provisional` (`{"delta", "tokens"}`) carries text that is not the
  target's yet, shown after the committed text; once the target has ruled on it,
  `event: reconciled` (`{"at", "provisional", "kept", "replaced", "replaced_text", "text"}`)
  says how many provisional tokens it kept and which ids it replaced, and `text` is the committed
  text so far (every `text` delta joined; the kept tokens have come as `text` before it).
  With `"stream": false` the answer is instead one JSON summary (as `done` carries, whatever
  the session's end: its `status` and `error` say which), sent when the session ends; a client
  that hangs up before then cancels it all the same.
- `GET /v1/sessions`: the running and recently ended sessions (sessions a restarted agent
  resumed from its journal included).
- `GET /v1/sessions/{id}`: one session's summary so far; `GET /v1/sessions/{id}/events`: its
  stream from the start (coordinator-started sessions too); `DELETE /v1/sessions/{id}`: cancel.

Every refusal is a JSON `{"error": reason}` with a 4xx status; nothing a client sends can stop
the server. The module also holds the small client that `specfleet-agent ask` and tests use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from device_agent.sessions import AgentSession, SessionBook, SessionError, SessionRequest

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 128 * 1024  # a 64 KiB prompt, JSON-escaped
READ_TIMEOUT_S = 10.0  # for the request line, headers and body
SSE_CONTENT_TYPE = "text/event-stream"


class HttpError(Exception):
    """A request refused with a status and a reason (sent as JSON)."""

    def __init__(self, status: HTTPStatus, reason: str, allow: str = "") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.allow = allow


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes


async def read_request(reader: asyncio.StreamReader) -> HttpRequest | None:
    """One HTTP/1.1 request; None when the client closed before sending one."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise HttpError(HTTPStatus.BAD_REQUEST, "incomplete request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise HttpError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"request head over {MAX_HEAD_BYTES} bytes"
        ) from None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(HTTPStatus.BAD_REQUEST, f"malformed header line {line[:40]!r}")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise HttpError(
            HTTPStatus.BAD_REQUEST, "chunked bodies are not supported; send Content-Length"
        )
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
    if length < 0:
        raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is negative")
    if length > MAX_BODY_BYTES:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise HttpError(HTTPStatus.BAD_REQUEST, "body shorter than Content-Length") from None
    return HttpRequest(method.upper(), target.split("?", 1)[0], headers, body)


def response_head(
    status: HTTPStatus, content_type: str, length: int | None, allow: str = ""
) -> bytes:
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        f"Content-Type: {content_type}",
        "Connection: close",
        "Cache-Control: no-cache",
    ]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if allow:
        lines.append(f"Allow: {allow}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_response(status: HTTPStatus, document: Any, allow: str = "") -> bytes:
    body = json.dumps(document).encode()
    return response_head(status, "application/json", len(body), allow) + body


def sse_event(event: str, document: Any) -> bytes:
    """One Server-Sent Event; JSON escapes newlines, so `data` is always one line."""
    return f"event: {event}\ndata: {json.dumps(document)}\n\n".encode()


class LocalApi:
    """The HTTP server on 127.0.0.1; `start()` binds, `close()` stops and drops open streams."""

    def __init__(
        self,
        book: SessionBook,
        health: Callable[[], dict[str, Any]],
        port: int,
        host: str = HOST,
        *,
        connected: asyncio.Event | None = None,
        connect_wait_s: float = 0.0,
    ) -> None:
        self.book = book
        self.health = health
        self.connected = connected
        self.connect_wait_s = connect_wait_s
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen; returns the port (the one bound when `port` was 0)."""
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEAD_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("local API on http://%s:%d", self.host, self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client left; a session it started is cancelled by the stream itself
        except Exception:
            log.exception("local API: request failed")
            with contextlib.suppress(ConnectionError):
                writer.write(
                    json_response(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error"})
                )
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(read_request(reader), READ_TIMEOUT_S)
            if request is None:
                return
            session = await self._route(request, writer)
        except asyncio.TimeoutError:
            writer.write(json_response(HTTPStatus.REQUEST_TIMEOUT, {"error": "request too slow"}))
            return
        except HttpError as exc:
            writer.write(json_response(exc.status, {"error": exc.reason}, exc.allow))
            await writer.drain()
            return
        if session is None:
            await writer.drain()
        elif session.whole:
            await self._whole(reader, writer, session.session)
        else:
            await self._stream(reader, writer, session.session, session.cancel_on_hangup)

    async def _route(self, request: HttpRequest, writer: asyncio.StreamWriter) -> _Answer | None:
        """Answer a plain request; return the session to answer with for a session's."""
        parts = [p for p in request.path.split("/") if p]
        if parts == ["v1", "health"]:
            _allow(request, "GET")
            writer.write(json_response(HTTPStatus.OK, self.health()))
            return None
        if parts == ["v1", "sessions"]:
            _allow(request, "GET", "POST")
            if request.method == "GET":
                sessions = [*self.book.active, *self.book.recent]
                listing = [_brief(s) for s in sessions]
                writer.write(json_response(HTTPStatus.OK, {"data": listing, "count": len(listing)}))
                return None
            return await self._start(request)
        if len(parts) in (3, 4) and parts[:2] == ["v1", "sessions"]:
            session = self.book.get(parts[2])
            if len(parts) == 4 and parts[3] != "events":
                raise HttpError(HTTPStatus.NOT_FOUND, f"no route {request.path}")
            if session is None:
                raise HttpError(HTTPStatus.NOT_FOUND, f"no session {parts[2]} on this device")
            if len(parts) == 4:
                _allow(request, "GET")
                return _Answer(session, cancel_on_hangup=False)
            _allow(request, "GET", "DELETE")
            if request.method == "DELETE":
                await session.cancel("cancelled by a local client")
            writer.write(json_response(HTTPStatus.OK, session.summary().to_json()))
            return None
        raise HttpError(HTTPStatus.NOT_FOUND, f"no route {request.path}")

    async def _start(self, request: HttpRequest) -> _Answer:
        try:
            body = SessionRequest.parse_json(request.body)
        except SessionError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        if not await self._bus_ready():
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "the agent is not connected to the bus")
        try:
            session = await self.book.start(body)
        except SessionError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        return _Answer(session, cancel_on_hangup=True, whole=not body.stream)

    async def _bus_ready(self) -> bool:
        """Connected now, or within `connect_wait_s`: a reconnect in progress (a broker
        take-over, a short drop) delays a new session instead of refusing it."""
        if self.connected is None:
            return bool(self.health()["connected"])
        if self.connected.is_set():
            return True
        try:
            await asyncio.wait_for(self.connected.wait(), self.connect_wait_s)
        except TimeoutError:
            return False
        return True

    async def _stream(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: AgentSession,
        cancel_on_hangup: bool,
    ) -> None:
        writer.write(response_head(HTTPStatus.OK, f"{SSE_CONTENT_TYPE}; charset=utf-8", None))
        writer.write(sse_event("session", {"session_id": session.session_id}))
        await writer.drain()

        async def forward() -> None:
            async for event in session.events():
                writer.write(sse_event(event.kind, event.data))
                await writer.drain()
            summary = session.summary()
            if summary.status == "finished":
                writer.write(sse_event("done", summary.to_json()))
            else:
                error = summary.error or summary.status
                writer.write(sse_event("error", {"error": error, "summary": summary.to_json()}))
            await writer.drain()

        await _until_hangup(reader, session, forward(), "stream", cancel_on_hangup)

    async def _whole(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: AgentSession
    ) -> None:
        """The session's summary as one JSON answer once it ends; a hangup first cancels it."""

        async def answer() -> None:
            summary = await session.wait()
            writer.write(json_response(HTTPStatus.OK, summary.to_json()))
            await writer.drain()

        await _until_hangup(reader, session, answer(), "wait", cancel_on_hangup=True)


async def _until_hangup(
    reader: asyncio.StreamReader,
    session: AgentSession,
    work: Coroutine[Any, Any, None],
    name: str,
    cancel_on_hangup: bool,
) -> None:
    """Run `work` (a session's answer) to its end, or until the client hangs up: then it stops,
    and with `cancel_on_hangup` (the client that started the session) the session too."""
    # The client sends nothing more, so a read that returns means it hung up.
    hangup = asyncio.create_task(reader.read(1), name="local-api-hangup")
    working = asyncio.create_task(work, name=f"local-api-{name}-{session.session_id}")
    try:
        await asyncio.wait({hangup, working}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not working.done():
            working.cancel()
            if cancel_on_hangup:
                await session.cancel("the local client hung up")
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await working


@dataclass(frozen=True)
class _Answer:
    """A route's answer that is a session's: its events as they come, or its summary at the end
    (`whole`); `cancel_on_hangup` for the client that started it."""

    session: AgentSession
    cancel_on_hangup: bool
    whole: bool = False


def _allow(request: HttpRequest, *methods: str) -> None:
    if request.method not in methods:
        allow = ", ".join(methods)
        raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"use {allow}", allow)


def _brief(session: AgentSession) -> dict[str, Any]:
    return {
        "session_id": session.session_id,
        "status": session.status,
        "prompt": session.spec.prompt[:200],
        "generated": len(session.drafter.generated),
        "rounds": len(session.drafter.records),
        "local": session.local,
        "provisional": len(session.drafter.provisional),
        "resumed": session.resumed,
    }


# -- the client side ---------------------------------------------------------------------------


class ApiError(Exception):
    """The local API refused a request (`status` 4xx/5xx) or could not be reached (`status` 0)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class SseEvent:
    event: str
    data: dict[str, Any]


async def _open(
    host: str, port: int, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise ApiError(0, f"no agent answers on {host}:{port} ({exc or 'timeout'})") from None


async def _send(writer: asyncio.StreamWriter, method: str, path: str, body: bytes | None) -> None:
    head = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Connection: close"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
    await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise ApiError(0, f"malformed response from the agent: {exc}") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ")[1])
    except (IndexError, ValueError):
        raise ApiError(0, f"malformed status line {lines[0][:60]!r}") from None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


def _error_reason(status: int, body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


async def request_json(
    host: str,
    port: int,
    method: str,
    path: str,
    document: Any = None,
    timeout_s: float = 5.0,
) -> tuple[int, Any]:
    """One JSON request; returns (status, decoded body)."""
    reader, writer = await _open(host, port, timeout_s)
    try:
        body = None if document is None else json.dumps(document).encode()
        await _send(writer, method, path, body)
        status, _ = await asyncio.wait_for(_read_head(reader), timeout_s)
        payload = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        raise ApiError(status, "the agent answered with something other than JSON") from None


async def whole_session(
    host: str, port: int, document: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """POST /v1/sessions with `"stream": false`: the session's summary once it has ended (within
    `timeout_s`, the session's time included); ApiError on a refusal."""
    request = {**document, "stream": False}
    status, summary = await request_json(host, port, "POST", "/v1/sessions", request, timeout_s)
    if status == HTTPStatus.OK and isinstance(summary, dict):
        return summary
    reason = summary.get("error") if isinstance(summary, dict) else None
    raise ApiError(status, str(reason) if reason else f"HTTP {status}")


async def stream_session(
    host: str, port: int, document: dict[str, Any], timeout_s: float = 5.0
) -> AsyncIterator[SseEvent]:
    """POST /v1/sessions and yield its events until the stream ends; ApiError on a refusal."""
    body = json.dumps(document).encode()
    async for event in _events(host, port, "POST", "/v1/sessions", body, timeout_s):
        yield event


async def watch_session(
    host: str, port: int, session_id: str, timeout_s: float = 5.0
) -> AsyncIterator[SseEvent]:
    """GET /v1/sessions/{id}/events: the session's stream from its start, until it ends (a
    caller re-attaching, e.g. after the agent restarted and resumed the session)."""
    path = f"/v1/sessions/{session_id}/events"
    async for event in _events(host, port, "GET", path, None, timeout_s):
        yield event


async def _events(
    host: str, port: int, method: str, path: str, body: bytes | None, timeout_s: float
) -> AsyncIterator[SseEvent]:
    reader, writer = await _open(host, port, timeout_s)
    try:
        await _send(writer, method, path, body)
        status, headers = await _read_head(reader)
        if status != HTTPStatus.OK or not headers.get("content-type", "").startswith(
            SSE_CONTENT_TYPE
        ):
            raise ApiError(status, _error_reason(status, await reader.read()))
        async for event in read_sse(reader):
            yield event
    finally:
        writer.close()


async def read_sse(reader: asyncio.StreamReader) -> AsyncIterator[SseEvent]:
    """Server-Sent Events as the local API writes them: `event:` and one JSON `data:` line."""
    event, data = "message", ""
    while True:
        raw = await reader.readline()
        if not raw:
            return
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield SseEvent(event, json.loads(data))
            event, data = "message", ""
        elif line.startswith("event:"):
            event = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data += line[len("data:") :].strip()
