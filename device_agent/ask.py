"""`specfleet-agent ask`: one prompt through the running agent's local API, or a one-shot link.

When an agent answers on the local API port, the session runs there and its text streams back
over Server-Sent Events. Otherwise `ask` connects to the bus itself, as the same device but
without presence or a Will, runs the one session and leaves. Mosquitto binds client ids to
usernames, so there the one-shot link takes the device's connection from an agent that runs
without its local API; the embedded broker keeps both.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from pydantic import ValidationError

from device_agent.local_api import HOST, ApiError, request_json, stream_session
from device_agent.sessions import SessionError, SessionRequest, SessionSummary, validation_reason
from device_agent.settings import AgentSettings, LocalSettings

# How long `ask` waits for a local agent to answer before connecting on its own.
PROBE_TIMEOUT_S = 1.0
# How long a one-shot connection may take to reach the broker.
CONNECT_TIMEOUT_S = 15.0


class AskError(Exception):
    """A refusal worth one line on stderr; `exit_code` 2 for bad input, 1 for a failed run."""

    def __init__(self, reason: str, exit_code: int = 2) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


@dataclass(frozen=True)
class AskOutput:
    stdout: TextIO
    stderr: TextIO
    json: bool  # print the summary as JSON instead of streaming the text


def build_request(**fields: Any) -> SessionRequest:
    """The session request from flags (None meaning unset); AskError with the reason if bad."""
    try:
        return SessionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise AskError(validation_reason(exc)) from None


def summary_line(summary: dict[str, Any]) -> str:
    alpha = summary["alpha"]
    rate = summary["tokens_per_s"]
    return (
        f"{len(summary['token_ids'])} tokens in {summary['elapsed_s']:.2f} s"
        f" ({'-' if rate is None else f'{rate:.1f}'} tok/s), {summary['rounds']} rounds,"
        f" alpha {'-' if alpha is None else f'{alpha:.2f}'},"
        f" proactive {summary['proactive_hits']} hits / {summary['proactive_misses']} misses;"
        f" session {summary['session_id']} {summary['status']}"
    )


def _finish(summary: dict[str, Any], output: AskOutput) -> int:
    if output.json:
        print(json.dumps(summary, indent=2), file=output.stdout)
    else:
        output.stdout.write("\n")
        output.stdout.flush()
        print(summary_line(summary), file=output.stderr)
    if summary["status"] != "finished":
        error = summary["error"] or summary["status"]
        reason = f"the session ended {summary['status']}: {error}"
        print(f"specfleet-agent ask: {reason}", file=output.stderr)
        return 1
    return 0


def _write(output: AskOutput, text: str) -> None:
    if not output.json:
        output.stdout.write(text)
        output.stdout.flush()


async def local_agent_answers(port: int) -> bool:
    """Whether a specfleet agent serves the local API on this port."""
    try:
        status, health = await request_json(
            HOST, port, "GET", "/v1/health", timeout_s=PROBE_TIMEOUT_S
        )
    except (ApiError, asyncio.TimeoutError, ConnectionError):
        return False
    return status == 200 and isinstance(health, dict) and "device_id" in health


async def ask_local_api(port: int, request: SessionRequest, output: AskOutput) -> int:
    document = request.model_dump(exclude_none=True)
    try:
        async for event in stream_session(HOST, port, document):
            if event.event == "text":
                _write(output, str(event.data["delta"]))
            elif event.event == "done":
                return _finish(event.data, output)
            elif event.event == "error":
                return _finish(event.data["summary"], output)
    except ApiError as exc:
        code = 2 if 400 <= exc.status < 500 else 1
        raise AskError(f"the local agent refused: {exc.reason}", code) from None
    raise AskError("the local agent closed the stream before the session ended", 1)


async def ask_one_shot(settings: AgentSettings, request: SessionRequest, output: AskOutput) -> int:
    from device_agent.agent import Agent

    agent = Agent(settings, announce=False)
    running = asyncio.create_task(agent.run(), name="ask-agent")
    try:
        connected = asyncio.create_task(agent.connected.wait(), name="ask-connected")
        done, _ = await asyncio.wait(
            {running, connected}, timeout=CONNECT_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        connected.cancel()
        if running in done:
            running.result()  # raises what stopped it
        if not agent.connected.is_set():
            raise AskError(f"cannot reach the broker at {settings.broker_url}", 1)
        try:
            session = await agent.sessions.start(request)
        except SessionError as exc:
            raise AskError(str(exc)) from None
        async for delta in session.text_deltas():
            _write(output, delta)
        summary: SessionSummary = await session.wait()
        return _finish(summary.to_json(), output)
    finally:
        await agent.stop()
        await running


async def ask(
    local: LocalSettings,
    agent_settings: AgentSettings | None,
    request: SessionRequest,
    output: AskOutput,
    settings_error: str = "",
) -> int:
    """Run one session through a local agent if one answers, else over a one-shot connection."""
    if local.local_api and local.local_api_port and await local_agent_answers(local.local_api_port):
        return await ask_local_api(local.local_api_port, request, output)
    if agent_settings is None:
        where = f"on {HOST}:{local.local_api_port}" if local.local_api_port else "locally"
        raise AskError(
            f"no agent answers {where}, and a one-shot connection needs {settings_error}"
        )
    return await ask_one_shot(agent_settings, request, output)


def default_output(json_output: bool) -> AskOutput:
    return AskOutput(stdout=sys.stdout, stderr=sys.stderr, json=json_output)
