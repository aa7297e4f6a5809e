"""A device's quarantined drafts and its memory (the MB free, the drafts over it) reach its
telemetry snapshot, which the device page shows."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coordinator_rig import raw_device, rig_settings, running_coordinator
from sqlalchemy.engine import Engine

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel
from coordinator.db.registry import DeviceNotFoundError
from coordinator.runtime.service import Coordinator

WAIT_S = 10.0


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    with PrivateMosquitto() as broker:
        yield broker


async def snapshot_after(
    coordinator: Coordinator, device: Any, telemetry: m.Telemetry
) -> dict[str, Any]:
    """Send one telemetry message; the device's stored snapshot once it carries its cpu reading."""
    await device.send(DeviceChannel.TELEMETRY, telemetry)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            stored = coordinator.registry.get(device.device_id).telemetry
        except DeviceNotFoundError:  # enrolled with its first message, which may still be queued
            stored = None
        if stored and stored.get("cpu_percent") == telemetry.cpu_percent:
            return dict(stored)
        await asyncio.sleep(0.05)
    raise AssertionError(f"telemetry of {device.device_id} was not stored within {WAIT_S}s")


def test_quarantined_drafts_are_kept_with_the_device_s_telemetry_and_cleared_with_it(
    tmp_path: Path, pg_clean_engine: Engine, mosquitto: PrivateMosquitto
) -> None:
    settings = rig_settings(tmp_path, pg_clean_engine, mosquitto.url)

    async def main() -> list[dict[str, Any]]:
        async with (
            running_coordinator(settings, pg_clean_engine) as coordinator,
            raw_device(mosquitto.url, f"dev-{secrets.token_hex(4)}") as device,
        ):
            snapshots = []
            for cpu, quarantined, over in (
                (10.0, ("draft-l1", "draft-l2-tflite"), ("draft-l2",)),
                (11.0, None, None),
            ):
                telemetry = m.Telemetry(
                    device_id=device.device_id,
                    at=time.time(),
                    cpu_percent=cpu,
                    quarantined_drafts=quarantined,
                    memory_available_mb=100.0 if over else None,
                    drafts_over_memory=over,
                )
                snapshots.append(await snapshot_after(coordinator, device, telemetry))
            return snapshots

    quarantined, cleared = asyncio.run(main())
    assert quarantined["quarantined_drafts"] == "draft-l1, draft-l2-tflite"
    assert quarantined["memory_available_mb"] == 100.0
    assert quarantined["drafts_over_memory"] == "draft-l2"
    for key in ("quarantined_drafts", "memory_available_mb", "drafts_over_memory"):
        assert key not in cleared  # the snapshot is the latest report only


def test_telemetry_refuses_a_malformed_quarantine_list() -> None:
    fields: dict[str, Any] = {"device_id": "dev-1", "at": 1.0}
    with pytest.raises(m.SchemaViolation, match="quarantined_drafts"):
        m.decode(m.encode(m.Telemetry(**fields)).replace(b"}", b',"quarantined_drafts":[""]}'))
    with pytest.raises(m.SchemaViolation, match="quarantined_drafts"):
        too_many = ",".join(f'"d{i}"' for i in range(17))
        payload = m.encode(m.Telemetry(**fields)).replace(
            b"}", f',"quarantined_drafts":[{too_many}]}}'.encode()
        )
        m.decode(payload)
