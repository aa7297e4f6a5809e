"""The verifier's outbox: reports held for the next pass, every topic kept in order."""

from __future__ import annotations

import asyncio

import pytest

from broker.topics import DeviceChannel, VerifierChannel, device_topic, verifier_topic
from verifier import outbox as outbox_module
from verifier.outbox import Outbox

COORDINATOR = verifier_topic("v-1", VerifierChannel.RESULT)  # where its reports go
DEVICE = device_topic("pi", DeviceChannel.VERDICT)


async def _put_so_far(box: Outbox) -> list[tuple[str, bytes | object]]:
    """What has been put for the bus so far (without waiting for more)."""
    if len(box) == box.reports_held:  # nothing put yet
        return []
    items, _ = await box.since(box.first)
    return [(topic, payload) for _, topic, payload in items]


def test_a_report_waits_for_the_next_pass_and_a_verdict_goes_past_it() -> None:
    async def body() -> None:
        box = Outbox()
        box.report(COORDINATOR, b"done-0")
        box.put(DEVICE, b"verdict-1")
        assert await _put_so_far(box) == [(DEVICE, b"verdict-1")]
        assert box.reports_held == 1
        box.release_reports()  # the next pass went to the inference process
        assert await _put_so_far(box) == [(DEVICE, b"verdict-1"), (COORDINATOR, b"done-0")]
        assert box.reports_held == 0

    asyncio.run(body())


def test_a_message_for_the_reports_topic_lets_them_go_first() -> None:
    async def body() -> None:
        box = Outbox()
        box.report(COORDINATOR, b"done-0")
        box.report(COORDINATOR, b"done-1")
        box.put(COORDINATOR, b"lease-ack")
        assert await _put_so_far(box) == [
            (COORDINATOR, b"done-0"),
            (COORDINATOR, b"done-1"),
            (COORDINATOR, b"lease-ack"),
        ]
        assert box.reports_held == 0

    asyncio.run(body())


def test_a_report_goes_by_itself_when_no_pass_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox_module, "REPORT_HOLD_S", 0.05)

    async def body() -> None:
        box = Outbox()
        box.report(COORDINATOR, b"done-0")
        items, after = await asyncio.wait_for(box.since(0), timeout=5.0)
        assert [(topic, payload) for _, topic, payload in items] == [(COORDINATOR, b"done-0")]
        assert after == 1 and box.reports_held == 0
        box.release_reports()  # nothing held: nothing put twice
        assert box.first == 0 and len(box) == 1

    asyncio.run(body())
