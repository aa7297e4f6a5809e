"""`specfleet-agent ask`: argument errors, through a running agent's local API, and one-shot."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from pathlib import Path

import pytest
from agent_peer import BusPeer, TargetJudge, prompt_text, reference, running_agent

from broker import messages as m
from broker.mosquitto import PrivateMosquitto, free_port
from device_agent.cli import main
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0


@pytest.fixture
def no_agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPECFLEET_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--max-tokens", "0"], "max_tokens: Input should be greater than or equal to 1"),
        (["--temperature", "-1"], "temperature: Input should be greater than or equal to 0"),
        (["--top-p", "0"], "top_p: Input should be greater than 0"),
        (["--seed", "-3"], "seed: Input should be greater than or equal to 0"),
        (["--k", "65"], "k: Input should be less than or equal to 64"),
        (["--local-api-port", "70000"], "local_api_port: Input should be less than or equal"),
        ([], "a one-shot connection needs a device id"),
        (["--device-id", "no/slashes"], "invalid device id"),
    ],
)
def test_ask_refuses_bad_arguments_in_one_line(
    no_agent_env: None, capsys: pytest.CaptureFixture[str], flags: list[str], reason: str
) -> None:
    # Nothing listens on the local API port, so only the one-shot path is left.
    argv = ["ask", "Hello", "--local-api-port", str(free_port()), *flags]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("specfleet-agent ask: ") and reason in line


def test_ask_without_a_prompt_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ask"])
    assert exit_info.value.code == 2
    assert "prompt" in capsys.readouterr().err


async def run_ask(*argv: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "device_agent.cli",
        "ask",
        *argv,
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def test_ask_streams_through_the_running_agent(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    runtime, tokenizer = target
    prompt = prompt_text("code-01")

    async def scenario() -> tuple[tuple[int, str, str], tuple[int, str, str], int]:
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id))
        device_id = f"ask-{secrets.token_hex(3)}"
        async with peer.running(), running_agent(mosquitto.url, device_id, models_dir) as agent:
            assert agent.local_api is not None
            port = str(agent.local_api.port)
            text = await run_ask(prompt, "--max-tokens", "16", "--local-api-port", port)
            as_json = await run_ask(
                prompt, "--max-tokens", "16", "--local-api-port", port, "--json", "--k", "3"
            )
        return text, as_json, len(peer.opens)

    (code, out, err), (json_code, json_out, _), opens = asyncio.run(scenario())
    expected = reference("code-01", target, 16)
    assert code == 0, err
    assert out == tokenizer.decode(expected) + "\n"
    assert "16 tokens" in err and "finished" in err
    assert json_code == 0
    summary = json.loads(json_out)
    assert summary["token_ids"] == expected and summary["k"] == 3
    assert opens == 2  # both went through the agent's own bus connection


def test_ask_runs_a_one_shot_connection_when_no_agent_answers(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    runtime, tokenizer = target
    device_id = f"ask-{secrets.token_hex(3)}"

    async def scenario() -> tuple[tuple[int, str, str], BusPeer]:
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id))
        async with peer.running():
            result = await run_ask(
                prompt_text("chat-01"),
                "--max-tokens",
                "12",
                "--json",
                "--device-id",
                device_id,
                "--broker-url",
                mosquitto.url,
                "--models-dir",
                str(models_dir),
                "--local-api-port",
                str(free_port()),
            )
        return result, peer

    (code, out, err), peer = asyncio.run(scenario())
    assert code == 0, err
    summary = json.loads(out)
    assert summary["status"] == "finished"
    assert summary["token_ids"] == reference("chat-01", target, 12)
    assert [o.session_id for o in peer.opens] == [summary["session_id"]]
    # A one-shot connection never announces the device (no presence, no Will).
    assert not [s for s in peer.statuses if s.device_id == device_id]
    assert all(isinstance(d, m.Draft) for d in peer.drafts)
