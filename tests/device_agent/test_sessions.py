"""Agent sessions over a real Mosquitto, answered per docs/protocol.md with the real target."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
from agent_peer import BusPeer, Faults, TargetJudge, prompt_text, reference, running_agent

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from device_agent import drafting
from device_agent.sessions import SessionRequest, SessionSummary
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer

MAX_TOKENS = 32
TIMEOUT_S = 60.0


def device() -> str:
    return f"dev-{secrets.token_hex(4)}"


async def run_session(
    broker: PrivateMosquitto,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    request: SessionRequest,
    faults: Faults | None = None,
    **settings: object,
) -> tuple[SessionSummary, str, BusPeer]:
    runtime, tokenizer = target
    peer = BusPeer(broker.url, TargetJudge(runtime, tokenizer.eos_id), faults)
    async with (
        peer.running(),
        running_agent(broker.url, device(), models_dir, **settings) as agent,
    ):
        session = await agent.sessions.start(request)
        streamed = [delta async for delta in session.text_deltas()]
        summary = await asyncio.wait_for(session.wait(), TIMEOUT_S)
    return summary, "".join(streamed), peer


@pytest.mark.parametrize("proactive", [False, True])
def test_a_greedy_session_streams_the_target_s_own_answer(
    mosquitto: PrivateMosquitto,
    models_dir: Path,
    target: tuple[OnnxRuntime, ChatTokenizer],
    proactive: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(drafting, "PROACTIVE_MIN_HIT_RATE", 0.0)  # draft ahead every round
    request = SessionRequest(
        prompt=prompt_text("summarize-01"), max_tokens=MAX_TOKENS, proactive=proactive
    )
    summary, streamed, peer = asyncio.run(run_session(mosquitto, models_dir, target, request))
    _, tokenizer = target
    expected = reference("summarize-01", target, MAX_TOKENS)
    assert summary.status == "finished" and summary.error == ""
    assert summary.token_ids == expected
    assert streamed == summary.text == tokenizer.decode(expected)
    # The open carried the chat-templated prompt; every round went out exactly once.
    (opened,) = peer.opens
    assert list(opened.prompt_ids) == tokenizer.apply_chat_template(request.prompt)
    assert opened.session_id == summary.session_id and opened.max_tokens == MAX_TOKENS
    assert [d.round for d in peer.drafts] == list(range(summary.rounds))
    assert summary.drafted == [len(d.tokens) for d in peer.drafts]
    assert sum(summary.accepted) + summary.rounds == len(expected)
    assert summary.proactive is proactive
    if proactive:
        assert summary.proactive_hits > 0
    else:
        assert summary.proactive_hits == summary.proactive_misses == 0
    assert summary.verifiers == ["judge"] and summary.tokens_per_s is not None
    assert summary.tokens == len(expected)
    # One wait per round, one turnaround per round that a next draft followed.
    assert len(summary.wait_ms) == summary.rounds
    assert len(summary.turnaround_ms) == summary.rounds - 1
    assert min(summary.wait_ms) > 0 and min(summary.turnaround_ms) >= 0


def test_lost_and_repeated_verdicts_neither_stall_nor_double_commit(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    request = SessionRequest(prompt=prompt_text("code-01"), max_tokens=24)
    faults = Faults(drop_verdicts={1, 4}, repeat_verdicts=True)
    summary, streamed, peer = asyncio.run(
        run_session(mosquitto, models_dir, target, request, faults, round_timeout_s=0.3)
    )
    assert summary.status == "finished"
    assert summary.token_ids == reference("code-01", target, 24)
    assert streamed == summary.text
    rounds = [d.round for d in peer.drafts]
    # Rounds 1 and 4 went out twice (their first verdict was lost); the rest once.
    assert sorted(rounds) == sorted([*range(summary.rounds), 1, 4])
    assert summary.rounds == len(set(rounds))


def test_sampled_sessions_are_reproducible_from_the_seed(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    answers = []
    for proactive in (False, True):
        request = SessionRequest(
            prompt=prompt_text("chat-02"),
            max_tokens=16,
            temperature=0.9,
            seed=5,
            proactive=proactive,
        )
        summary, _, peer = asyncio.run(run_session(mosquitto, models_dir, target, request))
        assert summary.status == "finished"
        assert all(d.q_ids is not None for d in peer.drafts if d.tokens)
        assert peer.opens[0].sampling == m.SamplingSpec(temperature=0.9, seed=5)
        answers.append(summary.token_ids)
    assert answers[0] == answers[1]


def test_a_refused_open_fails_the_session_with_the_reason(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    request = SessionRequest(prompt="Hello", max_tokens=8)
    faults = Faults(refuse_opens="device is retired")
    summary, streamed, peer = asyncio.run(
        run_session(mosquitto, models_dir, target, request, faults)
    )
    assert summary.status == "failed" and "device is retired" in summary.error
    assert streamed == "" and peer.drafts == []


def test_a_silent_coordinator_fails_the_session_after_its_retries(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    import device_agent.sessions as sessions

    request = SessionRequest(prompt="Hello", max_tokens=8)
    saved = sessions.OPEN_TIMEOUT_S
    sessions.OPEN_TIMEOUT_S = 0.1
    try:
        summary, _, peer = asyncio.run(
            run_session(
                mosquitto, models_dir, target, request, Faults(silent=True), round_retries=2
            )
        )
    finally:
        sessions.OPEN_TIMEOUT_S = saved
    assert summary.status == "failed" and "no answer" in summary.error
    assert len(peer.opens) == 3  # the first open and two retries


def test_commands_start_and_cancel_sessions(
    mosquitto: PrivateMosquitto, models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    runtime, tokenizer = target

    async def scenario() -> None:
        faults = Faults()
        peer = BusPeer(mosquitto.url, TargetJudge(runtime, tokenizer.eos_id), faults)
        device_id = device()
        async with peer.running(), running_agent(mosquitto.url, device_id, models_dir) as agent:
            # A session the coordinator starts runs on the device to the end.
            await peer.command(
                device_id,
                m.CommandName.START_SESSION,
                session_id="coord-1",
                prompt=prompt_text("code-01"),
                task_type="code",
                max_tokens=12,
                sampling={"temperature": 0.0, "top_p": 1.0, "seed": 0},
                draft_model="lookup",
                k=3,
            )
            ack = await asyncio.wait_for(peer.acks.get(), TIMEOUT_S)
            assert ack.ok and ack.result["session_id"] == "coord-1"
            session = agent.sessions.get("coord-1")
            assert session is not None
            summary = await asyncio.wait_for(session.wait(), TIMEOUT_S)
            assert summary.status == "finished"
            assert summary.token_ids == reference("code-01", target, 12)
            assert peer.opens[0].task_type == "code" and peer.opens[0].k == 3

            # Bad arguments are refused in the ack, not by a crash.
            await peer.command(device_id, m.CommandName.START_SESSION, session_id="x y")
            ack = await asyncio.wait_for(peer.acks.get(), TIMEOUT_S)
            assert not ack.ok and "session_id" in ack.error
            await peer.command(device_id, m.CommandName.CANCEL_SESSION, session_id="nope")
            ack = await asyncio.wait_for(peer.acks.get(), TIMEOUT_S)
            assert not ack.ok and "no session" in ack.error

            # A session cancelled while it waits for the coordinator closes on the bus.
            faults.silent = True
            await peer.command(
                device_id,
                m.CommandName.START_SESSION,
                session_id="coord-2",
                prompt="Hello",
                max_tokens=8,
            )
            ack = await asyncio.wait_for(peer.acks.get(), TIMEOUT_S)
            assert ack.ok
            await peer.command(device_id, m.CommandName.CANCEL_SESSION, session_id="coord-2")
            ack = await asyncio.wait_for(peer.acks.get(), TIMEOUT_S)
            assert ack.ok and ack.result["status"] == "cancelled"
            for _ in range(100):
                if peer.closes:
                    break
                await asyncio.sleep(0.02)
            assert [c.session_id for c in peer.closes] == ["coord-2"]

    asyncio.run(scenario())


def test_a_session_survives_a_broker_restart_mid_round(
    models_dir: Path, target: tuple[OnnxRuntime, ChatTokenizer]
) -> None:
    # A broker of its own: the restart must not disturb the other tests' broker.
    with PrivateMosquitto() as broker:
        faults = Faults(restart_at_round=3, restart=broker.restart)
        request = SessionRequest(prompt=prompt_text("chat-01"), max_tokens=20)
        summary, streamed, peer = asyncio.run(
            run_session(broker, models_dir, target, request, faults)
        )
    assert summary.status == "finished"
    assert summary.token_ids == reference("chat-01", target, 20)
    assert streamed == summary.text
    # Round 3 was committed by the peer but its verdict never came: the agent learnt it from
    # the SessionState after reconnecting, and went on from round 4.
    assert summary.resyncs == 1 and len(peer.opens) >= 2
    assert 3 not in [d.round for d in peer.drafts[4:]]
    assert summary.rounds == len({d.round for d in peer.drafts}) - 1
