"""A round's legs on the database, and persist-before-publish, with a real agent, verifier and
broker: no verdict leaves before its round and the session's tokens are committed, and each
next draft brings the downlink of the verdict before it.

The rounds are direct (the verifier holds the session's lease and answers the device itself),
so the verdicts are checked where they arrive: a client on the device's verdict topic asks the
database for the round of each verdict as it comes. The coordinator's own verdicts (none here,
unless a lease fails) are checked as it hands them to the bus."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, connect
from broker.topics import DeviceChannel, device_topic, parse_device_topic
from coordinator.db.models import DecodingSession, Round
from coordinator.runtime.service import Coordinator
from core.settings import Settings
from localfleet.demo import ask
from localfleet.fleet import VERIFIER_USER, AgentSpec, LocalFleet, local_fleet

AGENT = AgentSpec("legs-pi", "pi", "lookup", "none")
PROMPTS = ["List the days of the week.", "Count from one to twelve in words."]
MAX_TOKENS = 20


def test_verdicts_leave_persisted_and_the_next_draft_records_their_downlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published: list[m.Verdict] = []
    relayed: list[m.Verdict] = []  # verdicts the coordinator published
    unpersisted: list[str] = []
    publish = Coordinator.publish

    async def publish_once_persisted(
        self: Coordinator, topic: str, payload: bytes, retain: bool = False
    ) -> None:
        message = m.decode(payload)
        if isinstance(message, m.Verdict):
            # What the database holds at the moment the verdict is handed to the bus.
            check(self.sessions, message)
            relayed.append(published.pop())  # counted by the watcher when it arrives
        await publish(self, topic, payload, retain)

    monkeypatch.setattr(Coordinator, "publish", publish_once_persisted)

    def check(db_sessions: Any, message: m.Verdict) -> None:
        """What the database holds when the verdict is seen."""
        with db_sessions() as db:
            session_id = uuid.UUID(message.session_id)
            stored = db.scalar(
                sa.select(Round).where(
                    Round.session_id == session_id, Round.round_index == message.round
                )
            )
            session = db.get(DecodingSession, session_id)
            if stored is None or session is None:
                unpersisted.append(f"round {message.round} of {session_id}")
            elif session.committed_len < message.committed_len:
                unpersisted.append(f"tokens of round {message.round} of {session_id}")
        published.append(message)

    async def watch(fleet: LocalFleet) -> None:
        options = ConnectOptions(
            client_id=f"legs-watch-{uuid.uuid4().hex[:6]}",
            username=VERIFIER_USER,
            password=fleet.credentials[VERIFIER_USER],
        )
        async with connect(BrokerAddress.from_url(fleet.broker_url), options) as client:
            await client.subscribe(device_topic(AGENT.device_id, DeviceChannel.VERDICT))
            for channel in (DeviceChannel.DRAFT, DeviceChannel.DIRECT):
                await client.subscribe(device_topic(AGENT.device_id, channel))
            watching.set()
            async for incoming in client.messages():
                message = m.decode(incoming.payload)
                if isinstance(message, m.Draft):
                    parsed = parse_device_topic(incoming.topic)
                    assert parsed is not None
                    drafts[parsed.channel.value] += 1
                if isinstance(message, m.Verdict):
                    await asyncio.to_thread(check, fleet.coordinator.sessions, message)

    watching = asyncio.Event()
    drafts = {DeviceChannel.DRAFT.value: 0, DeviceChannel.DIRECT.value: 0}  # by topic

    async def main() -> list[dict[str, Any]]:
        settings = Settings(home=tmp_path / "home", coordinator_id=f"legs-{uuid.uuid4().hex[:8]}")
        async with local_fleet(
            settings, [AGENT], ["legs-verifier"], workdir=tmp_path / "fleet"
        ) as fleet:
            watcher = asyncio.create_task(watch(fleet))
            await asyncio.wait_for(watching.wait(), 30)
            async with httpx.AsyncClient() as client:
                answers = []
                for prompt in PROMPTS:
                    request = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
                    port = fleet.agent_ports[AGENT.device_id]
                    answers.append(await ask(client, port, request, AGENT.device_id, False))
            with fleet.coordinator.sessions() as db:
                for answer in answers:
                    answer["rounds_stored"] = db.scalars(
                        sa.select(Round)
                        .where(Round.session_id == uuid.UUID(answer["session_id"]))
                        .order_by(Round.round_index)
                    ).all()
            await asyncio.sleep(0.5)  # the last verdicts reach the watcher
            watcher.cancel()
            return answers

    answers = asyncio.run(main())
    assert not unpersisted, f"published before persisted: {unpersisted}"
    assert len(published) == sum(a["rounds"] for a in answers)
    # Direct rounds: the verifier answered every one, one bus round trip each.
    assert not relayed
    assert all(verdict.sent_at > 0 for verdict in published)
    # Each session's first window went where the coordinator hears it; every window after a
    # direct verdict went on the direct topic, which the coordinator does not read.
    assert all(verdict.direct for verdict in published)
    assert drafts == {"draft": len(PROMPTS), "direct": len(published) - len(PROMPTS)}, drafts
    for answer in answers:
        rounds: list[Round] = answer["rounds_stored"]
        assert answer["status"] == "finished" and len(rounds) >= 2
        # Every verdict but the last was followed by a draft that reported its downlink.
        downlinks = [r.t_downlink_ms for r in rounds]
        assert all(ms is not None and ms >= 0 for ms in downlinks[:-1]), downlinks
        assert downlinks[-1] is None
        assert all(r.t_uplink_ms is not None and r.t_verify_ms for r in rounds)
