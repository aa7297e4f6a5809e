"""Request bodies over HTTP on the real PostgreSQL, under uvicorn: an oversized body is refused
with 413 and an unauthenticated one with 401, in both cases before the client has sent it."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import uvicorn
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from broker.mosquitto import free_port
from coordinator.db.engine import make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from core.settings import Settings

SECRET = "a-test-secret-of-32-characters!!"
CHUNK = 64 * 1024
# What a client would send: 200 MB. The tests stop long before that, or fail.
CLAIMED = 200 * 1024 * 1024
# A client that got no answer after this much has had its body read (or buffered) whole.
SEND_BUDGET = 32 * 1024 * 1024
TAGS = "/api/v1/devices/pi-1/tags"


@contextmanager
def serve(app: FastAPI) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="limits-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass(frozen=True)
class Api:
    port: int
    token: str


def make_api(engine: Engine, **limits: int) -> Iterator[Api]:
    sessions = make_sessionmaker(engine)
    DeviceRegistry(sessions, hash_iterations=10).provision("pi-1", "pi")
    _, token = AdminStore(sessions).create("alice")
    settings = Settings(
        database_url=engine.url.render_as_string(hide_password=False),
        secret_key=SECRET,
        **limits,  # type: ignore[arg-type]
    )
    with serve(create_app(settings, engine)) as port:
        yield Api(port, token)


@pytest.fixture
def api(pg_clean_engine: Engine) -> Iterator[Api]:
    yield from make_api(pg_clean_engine)


@dataclass(frozen=True)
class Answer:
    status: int
    sent: int  # body bytes the client had sent when the answer came


def send_body(
    port: int, method: str, path: str, headers: dict[str, str], chunks: Iterator[bytes]
) -> Answer:
    """Send the head, then body chunks until the server answers (or the budget runs out)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            readable, _, _ = select.select([sock], [], [], 0.01)
            if readable or sent >= SEND_BUDGET:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        readable, _, _ = select.select([sock], [], [], 10)
        assert readable, f"no answer after {sent} body bytes"
        reply = sock.recv(65536)
    return Answer(int(reply.split(b" ", 2)[1]), sent)


def plain(total: int) -> Iterator[bytes]:
    for _ in range(total // CHUNK):
        yield b"x" * CHUNK


def chunked(total: int) -> Iterator[bytes]:
    for _ in range(total // CHUNK):
        yield f"{CHUNK:x}\r\n".encode() + b"x" * CHUNK + b"\r\n"
    yield b"0\r\n\r\n"


def bearer(api: Api) -> dict[str, str]:
    return {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}


def test_a_declared_oversized_body_is_refused_before_it_is_sent(api: Api) -> None:
    headers = bearer(api) | {"Content-Length": str(CLAIMED)}
    answer = send_body(api.port, "PUT", TAGS, headers, plain(CLAIMED))
    assert answer.status == 413
    assert answer.sent < SEND_BUDGET


def test_a_chunked_body_is_cut_off_at_the_limit(api: Api) -> None:
    headers = bearer(api) | {"Transfer-Encoding": "chunked"}
    answer = send_body(api.port, "PUT", TAGS, headers, chunked(CLAIMED))
    assert answer.status == 413
    assert answer.sent < SEND_BUDGET


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_an_unauthenticated_body_gets_401_before_it_is_read(
    pg_clean_engine: Engine, framing: str
) -> None:
    # Limits high enough that only authentication can stop this body early.
    for api in make_api(pg_clean_engine, http_max_body_bytes=CLAIMED * 2):
        headers = (
            {"Content-Length": str(CLAIMED)}
            if framing == "length"
            else {"Transfer-Encoding": "chunked"}
        )
        body = plain(CLAIMED) if framing == "length" else chunked(CLAIMED)
        answer = send_body(
            api.port, "PUT", TAGS, headers | {"Content-Type": "application/json"}, body
        )
        assert answer.status == 401
        assert answer.sent < SEND_BUDGET


def test_uploads_have_their_own_larger_limit(pg_clean_engine: Engine) -> None:
    body = b"x" * (256 * 1024)
    for api in make_api(
        pg_clean_engine, http_max_body_bytes=64 * 1024, http_max_upload_bytes=1024 * 1024
    ):
        headers = bearer(api) | {"Content-Length": str(len(body))}
        to_tags = send_body(api.port, "PUT", TAGS, headers, iter([body]))
        assert to_tags.status == 413
        # No route under /models takes a body yet: past the limit, the router says so.
        to_models = send_body(api.port, "PUT", "/api/v1/models/draft-x", headers, iter([body]))
        assert to_models.status in (404, 405)


def test_a_small_authenticated_body_still_works(api: Api) -> None:
    body = b'{"tags": ["lab"]}'
    headers = bearer(api) | {"Content-Length": str(len(body))}
    assert send_body(api.port, "PUT", TAGS, headers, iter([body])).status == 200
