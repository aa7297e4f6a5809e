"""The presence sweep on both databases: a device silent past 1.5 keepalives is marked offline,
one heard from recently is not, and in a shared fleet a peer's device is left to its owner."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventLog
from coordinator.db.models import DeviceStatus, utcnow
from coordinator.db.registry import DeviceRegistry
from coordinator.runtime.fleet import Fleet
from coordinator.runtime.quotas import Quotas

QUOTAS = Quotas(32, 4096, 5.0, 32, 1.0, 10, 1.0, 10)


async def _no_publish(topic: str, payload: bytes) -> None:
    raise AssertionError(f"the sweep published on {topic}")


def test_the_sweep_marks_only_its_own_silent_devices_offline(db_engine: Engine) -> None:
    sessions = make_sessionmaker(db_engine)
    registry = DeviceRegistry(sessions, hash_iterations=10)
    now = utcnow()
    seen = {"silent-mine": now - timedelta(seconds=60), "silent-peers": now - timedelta(seconds=60),
            "heard-mine": now}  # fmt: skip
    for device_id, at in seen.items():
        registry.provision(device_id, "pi")
        registry.mark_online(device_id, at)
    fleet = Fleet(registry, EventLog(sessions), _no_publish, accept_unknown_devices=False,
                  default_keepalive_s=10, quotas=QUOTAS, telemetry_queue_size=16)  # fmt: skip
    fleet.acts_for = lambda device_id: device_id.endswith("-mine")

    asyncio.run(fleet.sweep())

    status = {device_id: registry.get(device_id).status for device_id in seen}
    assert status == {
        "silent-mine": DeviceStatus.OFFLINE,  # 60 s > 1.5 x 10 s
        "silent-peers": DeviceStatus.ONLINE,  # another coordinator's to judge
        "heard-mine": DeviceStatus.ONLINE,
    }
