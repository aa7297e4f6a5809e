"""Drafts re-sent, out of order, malformed or for unknown sessions never double-commit anything."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from broker import messages as m
from broker.client import BrokerAddress, BusClient, ConnectOptions, Incoming, connect
from broker.topics import DeviceChannel, device_topic
from coordinator.db.models import DecodingSession, Round
from core.settings import Settings
from inference.tokenizer import ChatTokenizer
from localfleet.fleet import local_fleet
from modelbuild.target_build import ensure_target

DEVICE = "raw-device"
REPLY_TIMEOUT_S = 60.0


class RawDevice:
    """A device speaking the protocol by hand, so a test can send what no agent would."""

    def __init__(self, client: BusClient) -> None:
        self.client = client
        self._messages: AsyncIterator[Incoming] = client.messages()

    async def send(self, channel: DeviceChannel, payload: bytes) -> None:
        await self.client.publish(device_topic(DEVICE, channel), payload)

    async def reply(self) -> Any:
        # The embedded broker may deliver retained messages of other topics; only ours count.
        while True:
            incoming = await asyncio.wait_for(anext(self._messages), REPLY_TIMEOUT_S)
            if incoming.topic == device_topic(DEVICE, DeviceChannel.VERDICT):
                return m.decode(incoming.payload)


def _draft(session_id: str, round_index: int, base_len: int, tokens: list[int]) -> bytes:
    return m.encode(
        m.Draft(
            session_id=session_id,
            round=round_index,
            base_len=base_len,
            tokens=tuple(tokens),
            draft_model="lookup",
        )
    )


def same_verdict(one: m.Message, other: m.Message) -> bool:
    """The same stored verdict; only each send's time is its own (for its downlink)."""
    if not isinstance(one, m.Verdict) or not isinstance(other, m.Verdict):
        return False
    return one.model_copy(update={"sent_at": 0.0}) == other.model_copy(update={"sent_at": 0.0})


def test_duplicate_out_of_order_unknown_and_malformed_drafts(tmp_path: Path) -> None:
    tokenizer = ChatTokenizer.load(ensure_target())
    prompt_ids = tokenizer.apply_chat_template("Count from one to ten.")

    async def main() -> tuple[list[int], list[Round], DecodingSession]:
        settings = Settings(home=tmp_path / "home")
        async with local_fleet(
            settings, [], ["idem-verifier"], workdir=tmp_path / "fleet"
        ) as fleet:
            address = BrokerAddress.from_url(fleet.broker_url)
            options = ConnectOptions(client_id=f"dev-{DEVICE}", protocol="3.1.1")
            async with connect(address, options) as client:
                await client.subscribe(device_topic(DEVICE, DeviceChannel.VERDICT))
                device = RawDevice(client)
                session_id = str(uuid.uuid4())

                # A draft for a session nobody opened.
                await device.send(DeviceChannel.DRAFT, _draft(session_id, 0, len(prompt_ids), [5]))
                refused = await device.reply()
                assert isinstance(refused, m.ErrorReply) and "unknown session" in refused.reason

                # Malformed bytes on the draft topic: refused with a reason, nothing breaks.
                await device.send(DeviceChannel.DRAFT, b"\x00not json")
                refused = await device.reply()
                assert isinstance(refused, m.ErrorReply) and "JSON" in refused.reason

                await device.send(
                    DeviceChannel.SESSION,
                    m.encode(
                        m.SessionOpen(
                            session_id=session_id,
                            prompt="Count from one to ten.",
                            prompt_ids=tuple(prompt_ids),
                            max_tokens=16,
                            draft_model="lookup",
                            k=4,
                        )
                    ),
                )
                state = await device.reply()
                assert isinstance(state, m.SessionState) and state.next_round == 0

                # Round 0, then the very same draft again: the stored verdict, not a new round.
                first = _draft(session_id, 0, len(prompt_ids), [504, 3575, 282, 7])
                await device.send(DeviceChannel.DRAFT, first)
                verdict0 = await device.reply()
                await device.send(DeviceChannel.DRAFT, first)
                again = await device.reply()
                assert same_verdict(again, verdict0)

                # Out of order (round 5) and a wrong base_len: refused, with the state.
                committed = verdict0.committed_len
                await device.send(DeviceChannel.DRAFT, _draft(session_id, 5, committed, [1]))
                refused = await device.reply()
                assert isinstance(refused, m.ErrorReply) and "expected round 1" in refused.reason
                assert isinstance(await device.reply(), m.SessionState)
                await device.send(DeviceChannel.DRAFT, _draft(session_id, 1, committed - 1, [1]))
                refused = await device.reply()
                assert isinstance(refused, m.ErrorReply) and "base_len" in refused.reason
                assert isinstance(await device.reply(), m.SessionState)

                # Round 1 sent twice at once: one commit, two identical verdicts.
                second = _draft(session_id, 1, committed, [2, 2])
                await device.send(DeviceChannel.DRAFT, second)
                await device.send(DeviceChannel.DRAFT, second)
                replies = [await device.reply(), await device.reply()]
                assert same_verdict(replies[0], replies[1])
                generated = list(state.generated_ids)

            def read() -> tuple[list[Round], DecodingSession]:
                with fleet.coordinator.sessions() as db:
                    rounds = list(
                        db.scalars(
                            sa.select(Round)
                            .where(Round.session_id == uuid.UUID(session_id))
                            .order_by(Round.round_index)
                        )
                    )
                    row = db.get(DecodingSession, uuid.UUID(session_id))
                    assert row is not None
                    return rounds, row

            rounds, row = await asyncio.to_thread(read)
            return generated, rounds, row

    generated, rounds, row = asyncio.run(main())
    assert generated == []
    assert [r.round_index for r in rounds] == [0, 1]
    rebuilt: list[int] = []
    for r in rounds:
        rebuilt += [*r.draft_tokens[: r.n_accepted], r.next_token]
    assert rebuilt == row.committed_ids
    assert row.committed_len == len(row.prompt_ids) + len(rebuilt)
