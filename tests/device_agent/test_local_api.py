"""The agent's local HTTP API against a real running server: validation, routes and SSE framing."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from pathlib import Path
from typing import Any

import pytest
from agent_peer import BusPeer, Faults, TargetJudge, prompt_text, reference, running_agent

from broker.mosquitto import PrivateMosquitto, free_port
from device_agent.agent import Agent
from device_agent.local_api import (
    HOST,
    MAX_BODY_BYTES,
    ApiError,
    read_sse,
    request_json,
    stream_session,
    whole_session,
)
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer

TIMEOUT_S = 60.0
EVENT_BLOCK = re.compile(r"event: (session|text|done|error)\ndata: (\{.*\})\n\n")


def api_port(agent: Agent) -> int:
    assert agent.local_api is not None
    return agent.local_api.port


async def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are; read the whole answer (the server closes every connection)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), TIMEOUT_S)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, body


def post(body: bytes, path: str = "/v1/sessions") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def test_a_session_streams_as_server_sent_events(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    runtime, tokenizer = target
    body = {"prompt": prompt_text("summarize-01"), "max_tokens": 24, "draft": "lookup", "k": 3}

    async def scenario() -> tuple[int, dict[str, str], bytes]:
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id))
        device_id = f"api-{secrets.token_hex(3)}"
        async with peer.running(), running_agent(mosquitto.url, device_id, models_dir) as agent:
            return await raw_exchange(api_port(agent), post(json.dumps(body).encode()))

    status, headers, stream = asyncio.run(scenario())
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in headers
    text = stream.decode()
    blocks = EVENT_BLOCK.findall(text)
    # The whole body is event blocks and nothing else.
    assert "".join(f"event: {e}\ndata: {d}\n\n" for e, d in blocks) == text
    events = [(event, json.loads(data)) for event, data in blocks]
    assert events[0][0] == "session" and events[-1][0] == "done"
    assert {event for event, _ in events[1:-1]} == {"text"}
    summary = events[-1][1]
    expected = reference("summarize-01", target, 24)
    assert summary["token_ids"] == expected and summary["status"] == "finished"
    assert summary["session_id"] == events[0][1]["session_id"]
    assert "".join(d["delta"] for e, d in events if e == "text") == summary["text"]
    assert summary["text"] == tokenizer.decode(expected)
    assert summary["rounds"] == len(summary["accepted"]) == len(summary["drafted"])
    assert 0.0 <= summary["alpha"] <= 1.0 and summary["tokens_per_s"] > 0


def test_a_session_asked_for_whole_is_answered_once_with_its_summary(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    """`"stream": false`: one JSON answer when the session ends, the same summary the stream's
    `done` event carries (the target's tokens); a bad request is still refused with a reason."""
    runtime, tokenizer = target
    body = {"prompt": prompt_text("summarize-01"), "max_tokens": 24, "draft": "lookup", "k": 3}

    async def scenario() -> tuple[tuple[int, dict[str, str], bytes], dict[str, Any], ApiError]:
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id))
        device_id = f"api-{secrets.token_hex(3)}"
        async with peer.running(), running_agent(mosquitto.url, device_id, models_dir) as agent:
            raw = await raw_exchange(
                api_port(agent), post(json.dumps({**body, "stream": False}).encode())
            )
            summary = await whole_session(HOST, api_port(agent), body, TIMEOUT_S)
            with pytest.raises(ApiError) as refused:
                await whole_session(HOST, api_port(agent), {**body, "k": 65}, TIMEOUT_S)
            return raw, summary, refused.value

    (status, headers, answer), summary, refused = asyncio.run(scenario())
    assert status == 200 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(answer)
    document = json.loads(answer)
    expected = reference("summarize-01", target, 24)
    for whole in (document, summary):
        assert whole["status"] == "finished" and whole["token_ids"] == expected
        assert whole["text"] == tokenizer.decode(expected)
    assert document["session_id"] != summary["session_id"]
    assert refused.status == 400 and "k: Input should be less than or equal to 64" in refused.reason


BAD_BODIES: list[tuple[bytes, str]] = [
    (b"", "Invalid JSON"),
    (b"{not json", "Invalid JSON"),
    (b"[1, 2]", "object"),
    (b"{}", "prompt: Field required"),
    (b'{"prompt": ""}', "prompt: String should have at least 1 character"),
    (b'{"prompt": 7}', "prompt: Input should be a valid string"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens: Input should be greater than or equal"),
    (b'{"prompt": "hi", "max_tokens": "12"}', "max_tokens: Input should be a valid integer"),
    (b'{"prompt": "hi", "max_tokens": true}', "max_tokens: Input should be a valid integer"),
    (b'{"prompt": "hi", "temperature": -0.5}', "temperature: Input should be greater than"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p: Input should be greater than 0"),
    (b'{"prompt": "hi", "seed": -1}', "seed: Input should be greater than or equal to 0"),
    (b'{"prompt": "hi", "k": 65}', "k: Input should be less than or equal to 64"),
    (b'{"prompt": "hi", "colour": "red"}', "colour: Extra inputs are not permitted"),
    (b'{"prompt": "hi", "draft": "no-such-draft"}', "unknown drafter 'no-such-draft'"),
    (json.dumps({"prompt": "word " * 9000}).encode(), "prompt_ids: Tuple should have at most"),
]


def test_bad_session_requests_get_400_with_a_reason(
    mosquitto: PrivateMosquitto, models_dir: Path
) -> None:
    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        answers = []
        device_id = f"api-{secrets.token_hex(3)}"
        async with running_agent(mosquitto.url, device_id, models_dir) as agent:
            for body, _ in BAD_BODIES:
                status, _, payload = await raw_exchange(api_port(agent), post(body))
                answers.append((status, json.loads(payload)))
            # Refusals leave the server serving, with no session started.
            status, health = await request_json(HOST, api_port(agent), "GET", "/v1/health")
            answers.append((status, health))
        return answers

    answers = asyncio.run(scenario())
    for (body, reason), (status, document) in zip(BAD_BODIES, answers, strict=False):
        assert status == 400, body
        assert reason in document["error"], (body, document)
    status, health = answers[-1]
    assert status == 200 and health["connected"] and health["sessions_active"] == 0
    assert "lookup" in health["drafters"]


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (b"GET /v2/anything HTTP/1.1\r\n\r\n", 404, "no route /v2/anything"),
        (b"GET /v1/sessions/nope HTTP/1.1\r\n\r\n", 404, "no session nope"),
        (b"GET /v1/sessions/nope/logs HTTP/1.1\r\n\r\n", 404, "no route"),
        (b"DELETE /v1/health HTTP/1.1\r\n\r\n", 405, "use GET"),
        (b"PUT /v1/sessions HTTP/1.1\r\n\r\n", 405, "use GET, POST"),
        (b"HELLO\r\n\r\n", 400, "malformed request line"),
        (b"GET /v1/health HTTP/1.1\r\nno colon here\r\n\r\n", 400, "malformed header"),
        (
            b"POST /v1/sessions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "chunked",
        ),
        (b"POST /v1/sessions HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400, "Content-Length"),
        (
            f"POST /v1/sessions HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode(),
            413,
            "body over",
        ),
        (b"GET /v1/health HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431, "head over"),
        (b"POST /v1/sessions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}", 400, "shorter"),
    ],
)
def test_bad_http_is_refused_and_the_server_goes_on(
    mosquitto: PrivateMosquitto,
    models_dir: Path,
    request_bytes: bytes,
    status: int,
    reason: str,
) -> None:
    async def scenario() -> tuple[tuple[int, dict[str, str], bytes], int]:
        device_id = f"api-{secrets.token_hex(3)}"
        async with running_agent(mosquitto.url, device_id, models_dir) as agent:
            port = api_port(agent)
            if request_bytes.endswith(b"{}"):
                # A body shorter than announced: the client half-closes after sending it.
                reader, writer = await asyncio.open_connection(HOST, port)
                writer.write(request_bytes)
                writer.write_eof()
                answer = await reader.read()
                writer.close()
                head, _, body = answer.partition(b"\r\n\r\n")
                first = head.decode().split("\r\n")[0]
                refused: tuple[int, dict[str, str], bytes] = (int(first.split(" ")[1]), {}, body)
            else:
                refused = await raw_exchange(port, request_bytes)
            health, _ = await request_json(HOST, port, "GET", "/v1/health")
        return refused, health

    (got, headers, body), health = asyncio.run(scenario())
    assert got == status
    assert reason in json.loads(body)["error"]
    if status == 405:
        assert headers["allow"] == reason.removeprefix("use ")
    assert health == 200


def test_a_disconnected_agent_answers_503(models_dir: Path) -> None:
    async def scenario() -> tuple[int, Any, int, Any]:
        # Nothing listens on this port: the agent keeps trying, its local API still answers.
        dead_broker = f"mqtt://127.0.0.1:{free_port()}"
        from device_agent.settings import load_agent_settings

        agent = Agent(
            load_agent_settings(
                None,
                device_id="offline-1",
                broker_url=dead_broker,
                models_dir=models_dir,
                local_api_port=0,
                connect_wait_s=0.2,
            )
        )
        run = asyncio.create_task(agent.run())
        try:
            for _ in range(100):
                if agent.local_api is not None:
                    break
                await asyncio.sleep(0.02)
            port = api_port(agent)
            health_status, health = await request_json(HOST, port, "GET", "/v1/health")
            status, refusal = await request_json(
                HOST, port, "POST", "/v1/sessions", {"prompt": "hi"}
            )
        finally:
            await agent.stop()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
        return health_status, health, status, refusal

    health_status, health, status, refusal = asyncio.run(scenario())
    assert health_status == 200 and health["connected"] is False
    assert status == 503 and "not connected" in refusal["error"]


def test_a_session_asked_for_while_the_bus_reconnects_waits_for_it(
    models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    """A broker that comes up while the request waits (a reconnect, a take-over) delays the
    session instead of refusing it."""
    runtime, tokenizer = target
    port = free_port()
    body = {"prompt": prompt_text("math-01"), "max_tokens": 12, "draft": "lookup", "k": 3}

    async def scenario() -> dict[str, Any]:
        from device_agent.settings import load_agent_settings

        agent = Agent(
            load_agent_settings(
                None,
                device_id=f"late-{secrets.token_hex(3)}",
                broker_url=f"mqtt://127.0.0.1:{port}",
                models_dir=models_dir,
                local_api_port=0,
                connect_wait_s=TIMEOUT_S,
            )
        )
        run = asyncio.create_task(agent.run())
        try:
            while agent.local_api is None:
                await asyncio.sleep(0.02)

            async def collect() -> list[Any]:
                stream = stream_session(HOST, api_port(agent), body, TIMEOUT_S)
                return [event async for event in stream]

            asking = asyncio.create_task(collect())
            await asyncio.sleep(0.3)
            assert not asking.done()  # waiting for the bus, not refused
            with PrivateMosquitto(port=port) as mosquitto:
                peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id))
                async with peer.running():
                    events = await asyncio.wait_for(asking, TIMEOUT_S)
                    assert events[-1].event == "done", events[-1]
                    return dict(events[-1].data)
        finally:
            await agent.stop()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run

    summary = asyncio.run(scenario())
    assert summary["status"] == "finished"
    assert summary["token_ids"] == reference("math-01", (runtime, tokenizer), 12)


def test_sessions_can_be_listed_watched_cancelled_and_hung_up_on(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    runtime, tokenizer = target

    async def scenario() -> None:
        # The coordinator never answers, so sessions stay open until cancelled.
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id), Faults(silent=True))
        device_id = f"api-{secrets.token_hex(3)}"
        async with peer.running(), running_agent(mosquitto.url, device_id, models_dir) as agent:
            port = api_port(agent)
            events = stream_session(HOST, port, {"prompt": "Tell me a story.", "max_tokens": 8})
            first = await events.__anext__()
            assert first.event == "session"
            session_id = first.data["session_id"]

            status, listing = await request_json(HOST, port, "GET", "/v1/sessions")
            assert status == 200 and listing["count"] == 1
            assert listing["data"][0]["session_id"] == session_id

            # A second reader follows the same session from its start.
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(f"GET /v1/sessions/{session_id}/events HTTP/1.1\r\n\r\n".encode())
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            watcher = read_sse(reader)
            assert (await watcher.__anext__()).data == {"session_id": session_id}

            status, summary = await request_json(HOST, port, "DELETE", f"/v1/sessions/{session_id}")
            assert status == 200 and summary["status"] == "cancelled"
            last = [event async for event in events][-1]
            assert last.event == "error" and last.data["summary"]["status"] == "cancelled"
            assert (await watcher.__anext__()).event == "error"
            writer.close()

            # A client that hangs up cancels the session it started.
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(post(b'{"prompt": "Another one.", "max_tokens": 8}'))
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            opened = await read_sse(reader).__anext__()
            writer.close()
            hung_up = opened.data["session_id"]
            for _ in range(200):
                if len(peer.closes) == 2:
                    break
                await asyncio.sleep(0.02)
            assert [c.session_id for c in peer.closes] == [session_id, hung_up]
            status, summary = await request_json(HOST, port, "GET", f"/v1/sessions/{hung_up}")
            assert status == 200 and summary["status"] == "cancelled"
            assert "hung up" in summary["error"]

            # So does one that asked for the whole answer and hangs up before it comes.
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(post(b'{"prompt": "A third.", "max_tokens": 8, "stream": false}'))
            await writer.drain()
            for _ in range(200):
                if len(peer.opens) == 3:
                    break
                await asyncio.sleep(0.02)
            writer.close()
            for _ in range(200):
                if len(peer.closes) == 3:
                    break
                await asyncio.sleep(0.02)
            assert len(peer.closes) == 3 and peer.closes[2].session_id == peer.opens[2].session_id
            status, summary = await request_json(
                HOST, port, "GET", f"/v1/sessions/{peer.closes[2].session_id}"
            )
            assert status == 200 and summary["status"] == "cancelled"
            assert "hung up" in summary["error"]

    asyncio.run(scenario())
