"""A reply that cannot go out because the coordinator's connection is gone (it stopped, or the
link dropped, while the reply's PUBACK was still on its way) is a one-line warning, not a
handler's traceback, and loses nothing: the request's own work is done and the sender asks
again. Real Mosquitto and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from coordinator_rig import rig_settings, running_coordinator, tracebacks
from sqlalchemy.engine import Engine

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import DecodingSession


def test_a_reply_after_the_connection_is_gone_is_a_warning_and_the_open_is_kept(
    tmp_path: Path, pg_clean_engine: Engine, caplog: Any
) -> None:
    device_id = f"dev-{uuid.uuid4().hex[:8]}"
    request = m.SessionOpen(
        session_id=str(uuid.uuid4()), prompt="hi", prompt_ids=(1, 2, 3), draft_model="lookup"
    )

    async def main() -> None:
        with PrivateMosquitto() as mosquitto:
            settings = rig_settings(tmp_path, pg_clean_engine, mosquitto.url)
            async with running_coordinator(settings, pg_clean_engine) as coordinator:
                pass
            # Stopped: its bus session has ended and the connection is marked lost, as it is
            # when a stop (or a drop) overtakes a handler still waiting on its reply's PUBACK.
            await coordinator._dispatch_device(device_id, DeviceChannel.SESSION, m.encode(request))
            await asyncio.gather(*coordinator._handler_tasks)

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert tracebacks(caplog.records) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"session_open from {device_id}: the reply may not have gone out" in w for w in warnings
    ), warnings
    # The open itself was done: the session is stored, and the device's next open finds it.
    with make_sessionmaker(pg_clean_engine)() as session:
        stored = session.scalar(
            sa.select(DecodingSession).where(DecodingSession.id == uuid.UUID(request.session_id))
        )
    assert stored is not None and stored.device_id == device_id
