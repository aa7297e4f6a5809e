"""The coordinator takes the target's EOS and vocabulary from a manifest or from its verifiers'
heartbeats, never from a constant, and refuses at open a session of another vocabulary; on a
running coordinator over a real Mosquitto with PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coordinator_rig import REPLY_TIMEOUT_S, raw_device, rig_settings, running_coordinator
from sqlalchemy.engine import Engine

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, connect
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel, VerifierChannel, verifier_topic
from coordinator.runtime.book_core import UnknownTarget
from coordinator.runtime.service import Coordinator, configured_target
from core.settings import Settings
from inference.artifacts import TargetIdentity
from modelbuild.target_build import ensure_target, load_target_identity

MANIFEST_VOCAB = "a" * 64
ANNOUNCED_VOCAB = "b" * 64
MANIFEST_TARGET = TargetIdentity("from-manifest", "1" * 64, MANIFEST_VOCAB, 1000, 7)


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    with PrivateMosquitto() as broker:
        yield broker


async def _open(device: Any, vocab: str) -> m.Message:
    request = m.SessionOpen(
        session_id=str(uuid.uuid4()),
        prompt="hi",
        prompt_ids=(1, 2, 3),
        draft_model="lookup",
        vocab=vocab,
    )
    await device.send(DeviceChannel.SESSION, request)
    return await device.reply(
        REPLY_TIMEOUT_S, accept=lambda r: getattr(r, "session_id", None) == request.session_id
    )


async def _announce(broker_url: str, coordinator: Coordinator, eos_id: int, vocab: str) -> None:
    """A verifier's heartbeat naming its target, as `specfleet verifier` sends it."""
    status = m.VerifierStatus(
        verifier_id="identity-verifier",
        state=m.DeviceState.ONLINE,
        at=time.time(),
        heartbeat_s=60.0,
        eos_id=eos_id,
        vocab=vocab,
    )
    options = ConnectOptions(client_id=f"verifier-{uuid.uuid4().hex[:6]}")
    async with connect(BrokerAddress.from_url(broker_url), options) as client:
        topic = verifier_topic("identity-verifier", VerifierChannel.STATUS)
        await client.publish(topic, m.encode(status))
    for _ in range(100):
        if coordinator.verifiers.announced_target() is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the coordinator never heard the verifier's heartbeat")


def _run(tmp_path: Path, engine: Engine, broker_url: str, body: Any, **kwargs: Any) -> None:
    settings = rig_settings(tmp_path, engine, broker_url)

    async def main() -> None:
        async with (
            running_coordinator(settings, engine, **kwargs) as coordinator,
            raw_device(broker_url, f"dev-{uuid.uuid4().hex[:8]}") as device,
        ):
            await body(coordinator, device)

    asyncio.run(main())


def test_a_session_of_another_vocabulary_is_refused_at_open(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        assert coordinator.book.eos_id == MANIFEST_TARGET.eos_id
        reply = await _open(device, "c" * 64)
        assert isinstance(reply, m.ErrorReply) and reply.refused_type == "session_open"
        assert "is not the target's" in reply.reason and "cccccccccccc" in reply.reason
        assert isinstance(await _open(device, MANIFEST_VOCAB), m.SessionState)
        # An agent that predates vocabulary hashes sends none: its session opens as before.
        assert isinstance(await _open(device, ""), m.SessionState)

    _run(tmp_path, pg_clean_engine, mosquitto.url, body, target=MANIFEST_TARGET)


def test_the_verifiers_announced_target_outranks_the_manifest(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        await _announce(mosquitto.url, coordinator, eos_id=11, vocab=ANNOUNCED_VOCAB)
        assert coordinator.book.eos_id == 11
        reply = await _open(device, MANIFEST_VOCAB)
        assert isinstance(reply, m.ErrorReply) and "is not the target's" in reply.reason
        assert isinstance(await _open(device, ANNOUNCED_VOCAB), m.SessionState)

    _run(tmp_path, pg_clean_engine, mosquitto.url, body, target=MANIFEST_TARGET)


def test_without_a_manifest_or_a_verifier_the_eos_is_unknown(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto, caplog: Any
) -> None:
    async def body(coordinator: Coordinator, device: Any) -> None:
        with pytest.raises(UnknownTarget, match="EOS is unknown"):
            _ = coordinator.book.eos_id
        # Sessions still open (they wait for a verifier, which will announce the target).
        assert isinstance(await _open(device, MANIFEST_VOCAB), m.SessionState)
        await _announce(mosquitto.url, coordinator, eos_id=3, vocab=ANNOUNCED_VOCAB)
        assert coordinator.book.eos_id == 3

    with caplog.at_level(logging.INFO):
        _run(tmp_path, pg_clean_engine, mosquitto.url, body)


def test_the_configured_target_is_read_from_its_manifest(tmp_path: Path) -> None:
    assert configured_target(Settings(home=tmp_path)) is None  # an empty models directory
    here = Settings(home=tmp_path, models_dir=ensure_target().parent)
    assert configured_target(here) == load_target_identity(here.resolved_models_dir)
    assert configured_target(here.model_copy(update={"target": "absent"})) is None
