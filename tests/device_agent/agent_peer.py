"""The far side of docs/protocol.md for agent tests: coordinator and verifier decisions, no DB.

`TargetJudge` makes the decisions the protocol gives the coordinator and the verifier (session
state, round checks, idempotent verdicts, stop rules) with the real target model in this
process. `BusPeer` speaks them over a real broker to a real agent, and can lose or repeat
verdicts on purpose, so the agent's recovery paths run against the real bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker import messages as m
from broker.client import BrokerAddress, BusClient, ConnectOptions, run_with_reconnect
from broker.topics import DeviceChannel, device_subscription, device_topic, parse_device_topic
from core.aio import task_group
from device_agent.settings import load_agent_settings
from inference.onnx_runtime import OnnxRuntime
from inference.runtime import KVCache, Runtime
from inference.sampling import (
    RngStream,
    SamplingParams,
    SparseDraftProbs,
    rejection_sample,
    round_rng,
)
from inference.speculative import decode_target
from inference.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from device_agent.agent import Agent

CONNECT_TIMEOUT_S = 10.0
SHARED_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "bench" / "prompts.jsonl"
PolicyRule = Callable[[int], m.Policy | None]  # round -> the policy sent with its verdict


@dataclass
class JudgedSession:
    open: m.SessionOpen
    committed: list[int]
    cache: KVCache
    next_round: int = 0
    status: str = "active"
    verdicts: dict[int, m.Verdict] = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        return self.committed[len(self.open.prompt_ids) :]

    def state(self, policy: m.Policy | None = None) -> m.SessionState:
        return m.SessionState(
            session_id=self.open.session_id,
            prompt_len=len(self.open.prompt_ids),
            generated_ids=tuple(self.generated),
            next_round=self.next_round,
            status=self.status,
            policy=policy,
        )


class TargetJudge:
    """Sessions and verdicts as the protocol defines them, verified by the real target."""

    def __init__(self, target: Runtime, eos_id: int, policy: PolicyRule | None = None) -> None:
        self.target = target
        self.eos_id = eos_id
        self.policy = policy or (lambda round_index: None)
        self.sessions: dict[str, JudgedSession] = {}

    def open(self, message: m.SessionOpen) -> m.SessionState:
        session = self.sessions.get(message.session_id)
        if session is None:
            cache = self.target.new_cache()
            prompt = list(message.prompt_ids)
            if len(prompt) > 1:
                self.target.forward(prompt[:-1], cache)
            session = JudgedSession(open=message, committed=prompt, cache=cache)
            self.sessions[message.session_id] = session
        return session.state()

    def close(self, message: m.SessionClose) -> None:
        session = self.sessions.get(message.session_id)
        if session is not None and session.status == "active":
            session.status = "cancelled"

    def judge(self, draft: m.Draft) -> m.Verdict | tuple[m.ErrorReply, m.SessionState]:
        session = self.sessions.get(draft.session_id)
        if session is None:
            reason = f"unknown session {draft.session_id}"
            error = m.ErrorReply(refused_type="draft", session_id=draft.session_id, reason=reason)
            return error, m.SessionState(
                session_id=draft.session_id,
                prompt_len=1,
                generated_ids=(),
                next_round=0,
                status="failed",
            )
        if draft.round in session.verdicts:
            return session.verdicts[draft.round]  # idempotent
        if (
            session.status != "active"
            or draft.round != session.next_round
            or draft.base_len != len(session.committed)
        ):
            reason = (
                f"round {draft.round} base_len {draft.base_len} does not follow round "
                f"{session.next_round} at {len(session.committed)} ({session.status})"
            )
            error = m.ErrorReply(
                refused_type="draft", session_id=draft.session_id, round=draft.round, reason=reason
            )
            return error, session.state()
        return self._verify(session, draft)

    def _verify(self, session: JudgedSession, draft: m.Draft) -> m.Verdict:
        spec = session.open.sampling
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed)
        q = None
        if draft.q_ids is not None and draft.q_probs is not None:
            q = _dense_rows(draft.q_ids, draft.q_probs)
        base_len = len(session.committed)
        logits = self.target.forward([session.committed[-1], *draft.tokens], session.cache)
        result = rejection_sample(
            list(draft.tokens),
            q,
            logits,
            params,
            round_rng(spec.seed, draft.round, RngStream.VERIFY),
        )
        session.cache.trim(base_len + result.n_accepted)
        proposed = [*draft.tokens[: result.n_accepted], result.next_token]
        # The stop rules of the target-only decoder: first eos (kept) or max_tokens.
        room = session.open.max_tokens - len(session.generated)
        kept = proposed[:room]
        if self.eos_id in kept:
            kept = kept[: kept.index(self.eos_id) + 1]
        n_accepted = min(result.n_accepted, len(kept))
        next_token = kept[n_accepted] if len(kept) > n_accepted else None
        session.committed += kept
        finished = self.eos_id in kept or len(session.generated) >= session.open.max_tokens
        if finished:
            session.status = "finished"
        verdict = m.Verdict(
            session_id=draft.session_id,
            round=draft.round,
            base_len=base_len,
            n_accepted=n_accepted,
            next_token=next_token,
            committed_len=len(session.committed),
            finished=finished,
            policy=self.policy(draft.round),
            verifier_id="judge",
        )
        session.verdicts[draft.round] = verdict
        session.next_round += 1
        return verdict


def _dense_rows(
    q_ids: tuple[tuple[int, ...], ...], q_probs: tuple[tuple[float, ...], ...]
) -> SparseDraftProbs:
    import numpy as np

    width = max(len(row) for row in q_ids)
    ids = np.zeros((len(q_ids), width), dtype=np.int64)
    probs = np.zeros((len(q_ids), width), dtype=np.float64)
    for i, (row_ids, row_probs) in enumerate(zip(q_ids, q_probs, strict=True)):
        ids[i, : len(row_ids)] = row_ids
        probs[i, : len(row_probs)] = row_probs
    return SparseDraftProbs(ids=ids, probs=probs)


@dataclass
class Faults:
    """Misbehaviour of the bus side, to drive the agent's recovery paths."""

    drop_verdicts: set[int] = field(default_factory=set)  # rounds whose first verdict is lost
    repeat_verdicts: bool = False  # every verdict is published twice
    silent: bool = False  # answer no open and no draft
    verdict_delays: dict[int, float] = field(default_factory=dict)  # round -> seconds held back
    refuse_opens: str = ""  # refuse every SessionOpen with this reason
    # Judge this round's draft, then restart the broker before its verdict goes out: the
    # round is committed on this side and the agent must learn it from the SessionState.
    restart_at_round: int | None = None
    restart: Callable[[], None] | None = None


class BusPeer:
    """A coordinator stand-in on a real broker: answers opens and drafts with `TargetJudge`."""

    def __init__(self, broker_url: str, judge: TargetJudge, faults: Faults | None = None) -> None:
        self.address = BrokerAddress.from_url(broker_url)
        self.judge = judge
        self.faults = faults or Faults()
        self.drafts: list[m.Draft] = []
        self.opens: list[m.SessionOpen] = []
        self.closes: list[m.SessionClose] = []
        self.acks: asyncio.Queue[m.CommandAck] = asyncio.Queue()
        self.statuses: list[m.Status] = []
        self.client: BusClient | None = None
        self._dropped: set[int] = set()

    async def send(self, device_id: str, message: m.Message) -> None:
        assert self.client is not None
        await self.client.publish(device_topic(device_id, DeviceChannel.VERDICT), m.encode(message))

    async def command(self, device_id: str, name: m.CommandName, **args: object) -> str:
        assert self.client is not None
        command_id = secrets.token_hex(6)
        command = m.Command(command_id=command_id, name=name, args=dict(args))
        await self.client.publish(device_topic(device_id, DeviceChannel.COMMAND), m.encode(command))
        return command_id

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[BusPeer]:
        """Connected (and reconnecting after a broker restart) until the block ends."""
        options = ConnectOptions(client_id=f"peer-{secrets.token_hex(4)}")
        connected = asyncio.Event()

        async def serve(client: BusClient) -> None:
            for channel in (
                DeviceChannel.SESSION,
                DeviceChannel.DRAFT,
                DeviceChannel.ACK,
                DeviceChannel.STATUS,
            ):
                await client.subscribe(device_subscription(channel))
            self.client = client
            connected.set()
            await self._receive(client)

        async with task_group() as tasks:
            link = tasks.create_task(
                run_with_reconnect(self.address, options, serve), name="peer-link"
            )
            try:
                await asyncio.wait_for(connected.wait(), CONNECT_TIMEOUT_S)
                yield self
            finally:
                link.cancel()

    async def _receive(self, client: BusClient) -> None:
        async for incoming in client.messages():
            parsed = parse_device_topic(incoming.topic)
            assert parsed is not None
            message = m.decode(incoming.payload)
            if isinstance(message, m.CommandAck):
                self.acks.put_nowait(message)
            elif isinstance(message, m.Status):
                self.statuses.append(message)
            else:
                await self._answer(parsed.device_id, message)

    async def _answer(self, device_id: str, message: m.Message) -> None:
        if isinstance(message, m.SessionOpen):
            self.opens.append(message)
            if self.faults.refuse_opens:
                refusal = m.ErrorReply(
                    refused_type=message.type,
                    session_id=message.session_id,
                    reason=self.faults.refuse_opens,
                )
                await self.send(device_id, refusal)
            elif not self.faults.silent:
                await self.send(device_id, self.judge.open(message))
        elif isinstance(message, m.SessionClose):
            self.closes.append(message)
            self.judge.close(message)
        elif isinstance(message, m.Draft):
            self.drafts.append(message)
            if self.faults.silent:
                return
            answer = self.judge.judge(message)
            if isinstance(answer, tuple):
                for reply in answer:
                    await self.send(device_id, reply)
                return
            if message.round in self.faults.drop_verdicts and message.round not in self._dropped:
                self._dropped.add(message.round)
                return
            if message.round == self.faults.restart_at_round and self.faults.restart is not None:
                self.faults.restart_at_round = None
                self.faults.restart()
                return
            delay = self.faults.verdict_delays.pop(message.round, 0.0)
            if delay:
                await asyncio.sleep(delay)
            await self.send(device_id, answer)
            if self.faults.repeat_verdicts:
                await self.send(device_id, answer)


@contextlib.asynccontextmanager
async def running_agent(
    broker_url: str, device_id: str, models_dir: Path, **settings: Any
) -> AsyncIterator[Agent]:
    """A real agent on the broker, connected, with the local API on a free port unless told,
    and no session journal unless told (it would live in the user's home)."""
    from device_agent.agent import Agent

    values: dict[str, Any] = {"local_api_port": 0, "journal": False, **settings}
    agent = Agent(
        load_agent_settings(
            None, device_id=device_id, broker_url=broker_url, models_dir=models_dir, **values
        )
    )
    run = asyncio.create_task(agent.run(), name=f"agent-{device_id}")
    try:
        await asyncio.wait_for(agent.connected.wait(), CONNECT_TIMEOUT_S)
        yield agent
    finally:
        await agent.stop()
        await asyncio.wait_for(run, CONNECT_TIMEOUT_S)


@functools.cache
def prompt_text(prompt_id: str) -> str:
    for line in SHARED_PROMPTS.read_text().splitlines():
        if line.strip() and json.loads(line)["id"] == prompt_id:
            return str(json.loads(line)["prompt"])
    raise KeyError(prompt_id)


_REFERENCES: dict[tuple[str, int], list[int]] = {}


def reference(
    prompt_id: str, target: tuple[OnnxRuntime, ChatTokenizer], max_tokens: int
) -> list[int]:
    """The target's own greedy answer (computed once per prompt and length)."""
    key = (prompt_id, max_tokens)
    if key not in _REFERENCES:
        runtime, tokenizer = target
        prompt_ids = tokenizer.apply_chat_template(prompt_text(prompt_id))
        result = decode_target(
            runtime, prompt_ids, max_tokens, SamplingParams(), eos=tokenizer.eos_id
        )
        _REFERENCES[key] = result.tokens
    return _REFERENCES[key]
