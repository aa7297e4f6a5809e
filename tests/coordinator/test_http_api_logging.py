"""Serving the HTTP API leaves the process's logging as it was.

uvicorn's default log config runs logging.config.dictConfig, which closes every handler of the
process; absl's handler (TensorFlow's, in any process that exported a TFLite draft) closes the
stream it writes to when closed, and that stream was sys.stderr: pytest's capture file in a test
worker, whose every later test then failed at setup. `http_api` passes no log config.
"""

from __future__ import annotations

import asyncio
import io
import logging

import httpx
from fastapi import FastAPI

from broker.mosquitto import free_port
from coordinator.stack import http_api


class ClosesItsStream(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that, as absl's does, closes the stream it writes to when it is closed."""

    def close(self) -> None:
        self.stream.close()
        super().close()


def test_serving_the_api_closes_no_handler_of_the_process() -> None:
    stream = io.StringIO()
    handler = ClosesItsStream(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"pong": "yes"}

    async def serve_once() -> int:
        port = free_port()
        async with http_api(app, "127.0.0.1", port), httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/ping")
            return response.status_code

    try:
        assert asyncio.run(serve_once()) == 200
        assert not stream.closed
        logging.getLogger("specfleet.test").warning("still written")
        assert "still written" in stream.getvalue()
    finally:
        root.removeHandler(handler)
