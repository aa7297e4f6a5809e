"""The verifier's outbox: reports held for the next pass, every topic kept in order."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import secrets
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from broker.client import BrokerAddress, ConnectOptions, connect
from broker.messages import StreamStop
from broker.topics import DeviceChannel, VerifierChannel, device_topic, verifier_topic
from verifier import outbox as outbox_module
from verifier.outbox import Outbox

COORDINATOR = verifier_topic("v-1", VerifierChannel.RESULT)  # where its reports go
DEVICE = device_topic("pi", DeviceChannel.VERDICT)
SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
HOLD_S = 0.3  # the event loop held this long: long enough for a loopback broker's round trip


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


def test_an_encoded_payload_leaves_in_the_putters_step_and_a_message_after_it() -> None:
    """With the publisher idle, a verdict put as bytes is on the broker before its putter gives
    the event loop back: a subscriber on another thread has it while the loop is held. A
    message put to be encoded goes with the publisher's task, once the loop runs again, and
    both are acknowledged and gone from the box. A real Mosquitto, on the shared port."""
    root = f"specfleet-test/{secrets.token_hex(4)}"
    verdicts, results = f"{root}/dev/pi/verdict", f"{root}/verifier/v-1/result"
    received: queue.Queue[tuple[str, bytes]] = queue.Queue()
    subscriber = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sub-{secrets.token_hex(4)}")
    subscribed = threading.Event()
    subscriber.on_message = lambda _c, _u, message: received.put(
        (message.topic, bytes(message.payload))
    )
    subscriber.on_subscribe = lambda *_: subscribed.set()
    subscriber.connect("127.0.0.1", 1883)
    subscriber.loop_start()
    try:
        subscriber.subscribe(f"{root}/#", qos=1)
        assert subscribed.wait(10)

        async def body() -> tuple[list[str], list[str]]:
            options = ConnectOptions(client_id=f"outbox-{secrets.token_hex(4)}")
            async with connect(BrokerAddress.from_url(SHARED_MOSQUITTO), options) as client:
                box = Outbox()
                publishing = asyncio.create_task(box.publish(client, "test"))
                while box._live is None:  # the publisher is up and waiting
                    await asyncio.sleep(0.01)
                box.put(verdicts, b"verdict-0")
                time.sleep(HOLD_S)  # the loop held: only what left in this step can arrive
                during = _drain(received)
                box.put(results, StreamStop(request_id="r-1", session_id="s-1"))
                time.sleep(HOLD_S)
                during += _drain(received)
                async with asyncio.timeout(10):
                    while len(box):
                        await asyncio.sleep(0.01)
                    after: list[str] = []
                    while not after:
                        await asyncio.sleep(0.01)
                        after = _drain(received)
                publishing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await publishing
                return during, after

        during, after = asyncio.run(body())
    finally:
        subscriber.disconnect()
        subscriber.loop_stop()
    assert during == [verdicts]
    assert after == [results]


def _drain(received: queue.Queue[tuple[str, bytes]]) -> list[str]:
    topics = []
    while not received.empty():
        topics.append(received.get_nowait()[0])
    return topics
