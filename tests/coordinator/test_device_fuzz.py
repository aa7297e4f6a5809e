"""Fuzzing every channel a device may publish on: 10,000 hostile payloads decoded in-process, and
1,000 more delivered to a running coordinator over a real Mosquitto, with PostgreSQL behind it.
Nothing raises past the boundary, the coordinator logs no traceback, and every refusal says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator_rig import raw_device, rig_settings, running_coordinator, tracebacks
from device_payloads import BAD_VALUES, DOCUMENTS, device_payloads, seeded_payloads
from hypothesis import HealthCheck, given, settings
from sqlalchemy.engine import Engine

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel
from coordinator.runtime import verifiers

DECODE_CASES = 10_000
BUS_CASES = 1_000
# Channels where the coordinator answers a refused payload (status, acks and telemetry have
# nowhere to; `direct` it does not read: a verifier holding the device's session refuses there).
ANSWERED = {DeviceChannel.SESSION, DeviceChannel.DRAFT}
MAX_REASON = 1024  # an ErrorReply's reason


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[PrivateMosquitto]:
    with PrivateMosquitto() as broker:
        yield broker


def _decoded_or_refused(payload: bytes) -> m.Message | m.BusError:
    try:
        return m.decode(payload)
    except m.BusError as exc:
        return exc


@given(device_payloads())
@settings(
    max_examples=DECODE_CASES,
    deadline=None,
    derandomize=True,  # the same 10,000 cases every run: a bounded, repeatable test
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_hostile_payloads_decode_or_are_refused_with_a_reason(
    case: tuple[DeviceChannel, bytes],
) -> None:
    _, payload = case
    outcome = _decoded_or_refused(payload)  # anything else raised fails the test
    if isinstance(outcome, m.BusError):
        assert outcome.reason.strip()
        assert len(outcome.reason) <= MAX_REASON


@pytest.mark.parametrize("bad", [v for v in BAD_VALUES if v != 1], ids=repr)
@pytest.mark.parametrize("channel", sorted(DOCUMENTS, key=lambda c: c.value))
def test_a_bad_version_is_refused_on_every_channel(channel: DeviceChannel, bad: object) -> None:
    payload = json.dumps({**DOCUMENTS[channel][0], "v": bad}).encode()
    with pytest.raises(m.UnsupportedVersion) as refused:
        m.decode(payload)
    assert "unsupported schema version" in refused.value.reason
    assert len(refused.value.reason) <= MAX_REASON


def test_hostile_payloads_over_the_bus_leave_no_traceback_and_every_refusal_says_why(
    tmp_path: Path,
    pg_clean_engine: Engine,
    mosquitto: PrivateMosquitto,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A draft of a session that opened waits this long for a verifier (there is none here).
    monkeypatch.setattr(verifiers, "NO_VERIFIER_WAIT_S", 0.2)
    cases = seeded_payloads(BUS_CASES, seed=14)
    refused_here = sum(
        1
        for channel, payload in cases
        if channel in ANSWERED and isinstance(_decoded_or_refused(payload), m.BusError)
    )
    assert refused_here > BUS_CASES // 4  # the cases are hostile enough to matter
    settings_ = rig_settings(tmp_path, pg_clean_engine, mosquitto.url)

    async def main() -> list[m.Message]:
        async with (
            running_coordinator(settings_, pg_clean_engine) as coordinator,
            raw_device(mosquitto.url, "fuzz-dev") as device,
        ):
            for channel, payload in cases:
                await device.send(channel, payload)
            replies = await device.drain(quiet_s=2.0)
            assert coordinator.connected.is_set()
            return replies

    with caplog.at_level(logging.INFO):
        replies = asyncio.run(main())
    assert tracebacks(caplog.records) == []
    errors = [r for r in replies if isinstance(r, m.ErrorReply)]
    assert len(errors) >= refused_here
    assert all(e.reason.strip() for e in errors)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert len(refusals) >= refused_here
    assert all(line.rsplit(": ", 1)[-1].strip() for line in refusals)
