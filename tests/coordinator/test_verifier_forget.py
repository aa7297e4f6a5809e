"""A verifier offline for `verifier_forget_after_s` is forgotten: dropped from the coordinator's
list and its retained status cleared on a private Mosquitto, so that a coordinator started later
does not list it either (verifiers with a new id at each start would otherwise pile up there
for good). A peer's clear makes a coordinator forget it too; one that is online stays."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from coordinator_rig import rig_settings, running_coordinator
from sqlalchemy.engine import Engine

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, connect
from broker.mosquitto import PrivateMosquitto
from broker.topics import VerifierChannel, verifier_topic

FORGET_AFTER_S = 1.0
WAIT_S = 15.0


def _status(verifier_id: str, state: m.DeviceState) -> bytes:
    return m.encode(m.VerifierStatus(verifier_id=verifier_id, state=state, at=time.time(),
                                     max_batch=8, heartbeat_s=1.0))  # fmt: skip


async def _retained(broker_url: str, topic: str, wait_s: float = 1.0) -> list[bytes]:
    """What the broker hands a new subscriber of `topic` within `wait_s`."""
    got: list[bytes] = []
    async with connect(BrokerAddress.from_url(broker_url), ConnectOptions(client_id="peek")) as c:
        await c.subscribe(topic)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                async for incoming in c.messages():
                    got.append(incoming.payload)
    return got


async def _scenario(tmp_path: Path, engine: Engine, broker_url: str) -> dict[str, object]:
    gone, alive = "v-long-gone", "v-still-here"
    async with connect(BrokerAddress.from_url(broker_url), ConnectOptions(client_id="old")) as c:
        # What a dead verifier's Will leaves behind, and a verifier that heartbeats.
        await c.publish(verifier_topic(gone, VerifierChannel.STATUS),
                        _status(gone, m.DeviceState.OFFLINE), retain=True)  # fmt: skip
        await c.publish(verifier_topic(alive, VerifierChannel.STATUS),
                        _status(alive, m.DeviceState.ONLINE), retain=True)  # fmt: skip
        settings = rig_settings(tmp_path, engine, broker_url,
                                verifier_forget_after_s=FORGET_AFTER_S)  # fmt: skip
        async with running_coordinator(settings, engine) as coordinator:
            pool = coordinator.verifiers
            async with asyncio.timeout(WAIT_S):
                while {gone, alive} - set(pool.verifiers):
                    await asyncio.sleep(0.05)
            listed = sorted(pool.verifiers)
            async with asyncio.timeout(WAIT_S):
                while gone in pool.verifiers:
                    # The live one keeps its heartbeat (the pool would declare it dead else).
                    await c.publish(verifier_topic(alive, VerifierChannel.STATUS),
                                    _status(alive, m.DeviceState.ONLINE), retain=True)  # fmt: skip
                    await asyncio.sleep(0.25)
            after = sorted(pool.verifiers)
            # A peer coordinator clears another long-gone verifier: this one forgets it too.
            peer_gone = "v-cleared-by-a-peer"
            await c.publish(verifier_topic(peer_gone, VerifierChannel.STATUS),
                            _status(peer_gone, m.DeviceState.OFFLINE), retain=True)  # fmt: skip
            async with asyncio.timeout(WAIT_S):
                while peer_gone not in pool.verifiers:
                    await asyncio.sleep(0.05)
            await c.publish(verifier_topic(peer_gone, VerifierChannel.STATUS), b"", retain=True)
            async with asyncio.timeout(WAIT_S):
                while peer_gone in pool.verifiers:
                    await asyncio.sleep(0.05)
    return {
        "listed": listed,
        "after": after,
        "retained_gone": await _retained(broker_url, verifier_topic(gone, VerifierChannel.STATUS)),
        "retained_alive": await _retained(
            broker_url, verifier_topic(alive, VerifierChannel.STATUS)
        ),
    }


def test_a_long_offline_verifier_is_forgotten_and_its_status_cleared(
    tmp_path: Path, sqlite_engine: Engine
) -> None:
    with PrivateMosquitto() as broker:
        seen = asyncio.run(_scenario(tmp_path, sqlite_engine, broker.url))
    assert seen["listed"] == ["v-long-gone", "v-still-here"]
    assert seen["after"] == ["v-still-here"]
    assert seen["retained_gone"] == []
    assert len(seen["retained_alive"]) == 1  # type: ignore[arg-type]
