"""Lightweight agents for `specfleet bench fleet`: real MQTT clients, one connection per device,
many per asyncio loop, speaking the device protocol of `broker.messages`, and drafting from
recorded target answers (`bench.recorded`) instead of a model. A load tool.

One process runs a swarm; the parent (`bench.fleet`) starts several and steers them on
`bench/fleet/...` topics, outside the fleet's own tree:

    python -m bench.fleet_agents --broker-url URL --plan PLAN.json --out RESULT.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.recorded import RecordedAnswer, draft_along, load_answers
from broker import messages as m
from broker.client import (
    BrokerAddress,
    BusClient,
    BusConnectionError,
    ConnectOptions,
    Incoming,
    Will,
    connect,
)
from broker.topics import DeviceChannel, device_topic

log = logging.getLogger(__name__)

CONTROL_ROOT = "bench/fleet"
GO_TOPIC = f"{CONTROL_ROOT}/go"
STOP_TOPIC = f"{CONTROL_ROOT}/stop"
REPLY_TIMEOUT_S = 60.0
# A verdict this late is asked for again (SessionOpen with resume=retry), at most MAX_RETRIES
# times a round; an agent's own retry comes after a similar wait.
RETRY_AFTER_S = 10.0
MAX_RETRIES = 3
# Connecting is the broker's and our CPU's busiest moment: this many handshakes at once.
CONNECT_CONCURRENCY = 32
# Each agent's keepalive, on its MQTT connection and in its status (a device sets both). These
# agents send no telemetry, so their presence is the retained status and the Last Will: the
# coordinator marks a device offline after 1.5 keepalives of silence, and with a phone's 10 s
# it marked all 1,000 offline 15 s into a run, one database write each, in the middle of the
# rounds being measured. Ten minutes covers a run (and spares 1,000 clients' pings).
KEEPALIVE_S = 600
DRAFT_MODEL = "recorded"
# The swarm's own event loop is probed this often while its sessions run: how late a timer
# fires is how long any of its callbacks (a verdict's included) waits for the loop and the CPU.
LAG_PROBE_S = 0.01


def ready_topic(swarm: str) -> str:
    return f"{CONTROL_ROOT}/ready/{swarm}"


def done_topic(swarm: str) -> str:
    return f"{CONTROL_ROOT}/done/{swarm}"


@dataclass(frozen=True)
class SessionPlan:
    device_id: str
    answer_index: int
    seed: int  # of the drafts
    session_id: str  # unique to the run, so that a rerun with the same seed is not refused


@dataclass(frozen=True)
class SwarmPlan:
    swarm: str
    device_ids: list[str]
    sessions: list[SessionPlan]
    answers: str
    k: int
    alpha: float
    max_tokens: int
    # The device's own turn between a verdict and its next draft (drafting, the link): each
    # session offers a round every this many ms; 0 sends the next draft at once (saturation).
    round_interval_ms: float = 0.0

    @classmethod
    def read(cls, path: Path) -> SwarmPlan:
        raw = json.loads(path.read_text())
        raw["sessions"] = [SessionPlan(**s) for s in raw["sessions"]]
        return cls(**raw)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


@dataclass
class SessionRecord:
    """What one session saw, for the report and the database check."""

    session_id: str
    device_id: str
    opened: bool = False
    finished: bool = False
    rounds: list[int] = field(default_factory=list)  # round indices answered, in order
    latencies_ms: list[float] = field(default_factory=list)  # draft sent -> its verdict
    # Per answered round, as `rounds`: the verdict's `sent_at` (coordinator clock, this host's)
    # to the session reading it, and of that, the time it sat read in this process's queue.
    downlink_ms: list[float] = field(default_factory=list)
    agent_wait_ms: list[float] = field(default_factory=list)
    committed: int = 0  # answer tokens committed
    # Each answered round's verdict as (committed_len, next_token): one that comes again must
    # be the same (a draft sent again gets the stored verdict).
    verdicts: dict[int, tuple[int, int | None]] = field(default_factory=dict)


@dataclass
class SwarmResult:
    swarm: str
    connected: int = 0
    connect_failures: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    timeouts: int = 0
    # A verdict of a round already answered: the same one again (seen after a takeover: the
    # stored verdict of a round the session drafted again once told its state), or a different
    # one, which would be a round answered twice.
    duplicate_verdicts: int = 0
    conflicting_verdicts: int = 0
    retries: int = 0  # rounds asked for again after RETRY_AFTER_S of silence
    resyncs: int = 0  # session states that moved a session on (a new owner, a retry's answer)
    first_sent: float = 0.0
    last_answer: float = 0.0
    sessions: list[SessionRecord] = field(default_factory=list)
    # How late each LAG_PROBE_S timer fired while the sessions ran (ms, 0.01 ms resolution).
    loop_lag_ms: list[float] = field(default_factory=list)


class Agent:
    """One device: its connection, its verdict topic's messages in a queue, each with the
    perf_counter at which the client handed it over."""

    def __init__(self, device_id: str, client: BusClient) -> None:
        self.device_id = device_id
        self.client = client
        self.inbox: asyncio.Queue[tuple[float, Incoming]] = asyncio.Queue()

    async def pump(self) -> None:
        with contextlib.suppress(BusConnectionError):
            async for incoming in self.client.messages():
                self.inbox.put_nowait((time.perf_counter(), incoming))

    async def send(self, channel: DeviceChannel, message: m.Message) -> None:
        await self.client.publish(device_topic(self.device_id, channel), m.encode(message))


@contextlib.asynccontextmanager
async def connected_agent(address: BrokerAddress, device_id: str) -> AsyncIterator[Agent]:
    status = device_topic(device_id, DeviceChannel.STATUS)
    offline = m.Status(device_id=device_id, state=m.DeviceState.OFFLINE, at=time.time())
    options = ConnectOptions(
        client_id=device_id,
        will=Will(status, m.encode(offline), retain=True),
        keepalive_s=KEEPALIVE_S,
        protocol="3.1.1",
    )
    async with connect(address, options) as client:
        await client.subscribe(device_topic(device_id, DeviceChannel.VERDICT))
        online = m.Status(
            device_id=device_id,
            state=m.DeviceState.ONLINE,
            at=time.time(),
            drafts=(DRAFT_MODEL,),
            keepalive_s=KEEPALIVE_S,
        )
        await client.publish(status, m.encode(online), retain=True)
        yield Agent(device_id, client)


class SessionRun:
    """One greedy session spoken by hand: open, draft every round from the recording, close."""

    def __init__(
        self, agent: Agent, plan: SessionPlan, answer: RecordedAnswer, swarm: SwarmPlan,
        result: SwarmResult,
    ) -> None:  # fmt: skip
        self.agent = agent
        self.answer = answer
        self.swarm = swarm
        self.result = result
        self.rng = random.Random(plan.seed)
        self.record = SessionRecord(session_id=plan.session_id, device_id=agent.device_id)
        # Of the last reply `_reply` returned: when the client handed it to this process.
        self.handed_at = 0.0
        result.sessions.append(self.record)

    async def run(self) -> None:
        max_tokens = min(self.swarm.max_tokens, len(self.answer.answer_ids))
        opening = m.SessionOpen(
            session_id=self.record.session_id,
            prompt="recorded",
            prompt_ids=self.answer.prompt_ids,
            max_tokens=max_tokens,
            draft_model=DRAFT_MODEL,
            k=self.swarm.k,
        )
        self.result.first_sent = self.result.first_sent or time.time()
        await self.agent.send(DeviceChannel.SESSION, opening)
        try:
            state = await self._reply((m.SessionState,), REPLY_TIMEOUT_S)
        except _Refused:
            return
        if not isinstance(state, m.SessionState):
            self.result.timeouts += 1
            return
        self.record.opened = True
        committed, round_index, k = state.committed_len, state.next_round, self.swarm.k
        prompt_len = len(self.answer.prompt_ids)
        retries = 0
        interval_s = self.swarm.round_interval_ms / 1000.0
        # A paced session starts at a random phase, so that sessions opened together do not
        # draft in step; each round is offered `interval_s` after the previous one was.
        next_at = time.monotonic() + self.rng.uniform(0.0, interval_s)
        while True:
            if interval_s:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at + interval_s, time.monotonic())
            generated = committed - prompt_len
            tokens = draft_along(self.answer, generated, k, self.swarm.alpha, self.rng)
            draft = m.Draft(
                session_id=self.record.session_id,
                round=round_index,
                base_len=committed,
                tokens=tokens,
                draft_model=DRAFT_MODEL,
                timings=m.DraftTimings(sent_at=time.time()),
            )
            sent = time.perf_counter()
            await self.agent.send(DeviceChannel.DRAFT, draft)
            try:
                reply = await self._reply((m.Verdict, m.SessionState), RETRY_AFTER_S, round_index)
                if reply is None:
                    # Silence, as when a coordinator dies: ask where the session stands, as an
                    # agent does, and go on from the answer.
                    if retries == MAX_RETRIES:
                        self.result.timeouts += 1
                        return
                    retries += 1
                    self.result.retries += 1
                    retry = opening.model_copy(update={"resume": m.ResumeReason.RETRY})
                    await self.agent.send(DeviceChannel.SESSION, retry)
                    reply = await self._reply((m.SessionState,), REPLY_TIMEOUT_S)
            except _Refused:
                return
            if reply is None:
                self.result.timeouts += 1
                return
            if isinstance(reply, m.SessionState):  # a resync: another owner, or a retry's answer
                self.result.resyncs += 1
                if reply.status != "active":
                    self.record.finished = reply.status == "finished"
                    break
                committed, round_index = reply.committed_len, reply.next_round
                continue
            assert isinstance(reply, m.Verdict)
            read_at = time.perf_counter()
            self.record.latencies_ms.append((read_at - sent) * 1000.0)
            self.record.downlink_ms.append(max(0.0, (time.time() - reply.sent_at) * 1000.0))
            self.record.agent_wait_ms.append((read_at - self.handed_at) * 1000.0)
            self.record.rounds.append(reply.round)
            self.record.verdicts[reply.round] = (reply.committed_len, reply.next_token)
            self.result.last_answer = time.time()
            committed, round_index = reply.committed_len, reply.round + 1
            self.record.committed = committed - prompt_len
            if reply.policy is not None and reply.policy.k > 0:
                k = reply.policy.k
            if reply.finished:
                self.record.finished = True
                break
        # An ended session is not closed, as a device agent does not close one (it closes only
        # what it cancels). A close here went to the coordinator of the device's shard: one
        # SIGKILLed before the session ended never answered it, and the swarm waited a minute.

    async def _reply(
        self, kinds: tuple[type[m.Message], ...], timeout_s: float, round_index: int | None = None
    ) -> m.Message | None:
        """The next message of `kinds` about this session (a Verdict: of `round_index`); None
        after `timeout_s` of silence; _Refused, counted, for an error reply."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.handed_at, incoming = await asyncio.wait_for(self.agent.inbox.get(), left)
            except (asyncio.TimeoutError, TimeoutError):
                break
            reply = m.decode(incoming.payload)
            if getattr(reply, "session_id", None) != self.record.session_id:
                continue
            if isinstance(reply, m.ErrorReply):
                self.result.refusals.append(f"{reply.refused_type}: {reply.reason}")
                raise _Refused
            if isinstance(reply, m.Verdict) and reply.round in self.record.verdicts:
                first = self.record.verdicts[reply.round]
                if first == (reply.committed_len, reply.next_token):
                    self.result.duplicate_verdicts += 1
                else:
                    self.result.conflicting_verdicts += 1
                continue
            if isinstance(reply, m.Verdict) and reply.round != round_index:
                continue
            if isinstance(reply, kinds):
                return reply
        return None


class _Refused(Exception):
    """The coordinator refused the session's message (counted in the result)."""


async def _probe_loop_lag(lags_ms: list[float]) -> None:
    """How late a LAG_PROBE_S sleep wakes, over and over: this swarm's own queueing."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        late_ms = (time.perf_counter() - asked - LAG_PROBE_S) * 1000.0
        lags_ms.append(round(max(0.0, late_ms), 2))


async def _connect_all(
    address: BrokerAddress, device_ids: list[str], stack: contextlib.AsyncExitStack,
    result: SwarmResult,
) -> dict[str, Agent]:  # fmt: skip
    agents: dict[str, Agent] = {}
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    lock = asyncio.Lock()

    async def one(device_id: str) -> None:
        async with gate:
            try:
                agent = await stack.enter_async_context(connected_agent(address, device_id))
            except BusConnectionError as exc:
                result.connect_failures.append(f"{device_id}: {exc}")
                return
        async with lock:
            agents[device_id] = agent

    await asyncio.gather(*(one(d) for d in device_ids))
    return agents


async def run_swarm(broker_url: str, plan: SwarmPlan, out: Path) -> None:
    address = BrokerAddress.from_url(broker_url)
    answers = load_answers(Path(plan.answers))
    result = SwarmResult(plan.swarm)
    control_options = ConnectOptions(client_id=f"bench-fleet-{plan.swarm}", protocol="3.1.1")
    async with contextlib.AsyncExitStack() as stack:
        control = await stack.enter_async_context(connect(address, control_options))
        await control.subscribe(GO_TOPIC)
        await control.subscribe(STOP_TOPIC)
        control_messages = control.messages()
        agents = await _connect_all(address, plan.device_ids, stack, result)
        result.connected = len(agents)
        pumps = [
            asyncio.create_task(a.pump(), name=f"pump-{d}") for d in agents for a in [agents[d]]
        ]
        await control.publish(
            ready_topic(plan.swarm), json.dumps({"connected": len(agents)}).encode()
        )
        async for incoming in control_messages:
            if incoming.topic == GO_TOPIC:
                break
        runs = [
            SessionRun(agents[s.device_id], s, answers[s.answer_index % len(answers)], plan, result)
            for s in plan.sessions
            if s.device_id in agents
        ]
        probe = asyncio.create_task(_probe_loop_lag(result.loop_lag_ms), name="loop-lag")
        try:
            await asyncio.gather(*(r.run() for r in runs))
        finally:
            probe.cancel()
        out.write_text(json.dumps(asdict(result)))
        await control.publish(done_topic(plan.swarm), b"{}")
        async for incoming in control_messages:
            if incoming.topic == STOP_TOPIC:
                break
        for pump in pumps:
            pump.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_swarm(args.broker_url, SwarmPlan.read(args.plan), args.out))


if __name__ == "__main__":
    main()
