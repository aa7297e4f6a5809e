"""What a verifier sends: results, verdicts, lease acks and round reports waiting for the bus,
and its heartbeat."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from broker.client import BusClient, BusConnectionError
from broker.messages import BusError, Message, encode
from core.aio import TaskGroup, task_group

log = logging.getLogger(__name__)

# The longest a report is held when no pass is handed to the inference process meanwhile (an
# idle verifier): a device's turn with a neural drafter takes a few ms here, tens on a Pi.
REPORT_HOLD_S = 0.025


class Outbox:
    """Messages waiting for the bus, numbered in order. One leaves only once its publish is
    acknowledged, so a dropped connection loses none: the next one sends what is left again (the
    coordinator takes a result it already has for a late one and drops it). A message is encoded
    by the task that publishes it, while the next pass computes, not between two passes.

    A report (a direct round's RoundDone: the round is persisted and its verdict is on its way)
    waits until the next pass is handed to the inference process (`release_reports`), or
    REPORT_HOLD_S. Between a pass and the next is when a round's path runs: the verdict to the
    device, its next draft back, the pass to the target. On a host whose control plane shares a
    core with the verifier's bus side, the coordinator handling the report at once took that
    core from the path (`bench e2e`, fixed drafter at one session: the bus and the agent's share
    of a round, 1.8-2.1 ms p50 with reports held against 2.45-2.8 sent at once). A message put for a
    report's topic lets the reports waiting for it go first, so that each topic keeps its order;
    one for another topic (a device's verdict) goes past them.

    A payload put already encoded (a verdict) while the publisher has started everything before
    it is written in the caller's step (`BusClient.start_publish`), not a loop turn or two later
    by the publishing task, behind the rest of the caller's step (the round's report, built after
    its verdict) and whatever else is ready by then: 0.13 ms p50 of a direct round at one
    session on this project's 2-vCPU host (`bench e2e`, stamps). Its acknowledgement is awaited
    by the publisher's task group as any other's."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[str, bytes | Message]] = {}  # by number, in order
        self._next = 0  # the number of the next item put
        self._ready = asyncio.Event()
        self._reports: list[tuple[str, bytes | Message]] = []
        self._report_topics: set[str] = set()  # the topics of the reports held
        self._report_timer: asyncio.TimerHandle | None = None
        # While `publish` runs: its client and task group, and the number of the first item
        # it has not started yet.
        self._live: tuple[BusClient, TaskGroup, str] | None = None
        self._cursor = 0

    def put(self, topic: str, payload: bytes | Message) -> None:
        if topic in self._report_topics:
            self.release_reports()
        self._put(topic, payload)

    def _put(self, topic: str, payload: bytes | Message) -> None:
        number = self._next
        self._items[number] = (topic, payload)
        self._next += 1
        live = self._live
        if live is not None and self._cursor == number and isinstance(payload, bytes):
            client, group, name = live
            try:
                publishing = client.start_publish(topic, payload)
            except BusConnectionError:  # the publisher ends; the next connection sends it
                pass
            else:
                self._cursor = number + 1
                group.create_task(
                    self._acknowledged(client, number, topic, publishing),
                    name=f"{name}-out-{number}",
                )
                return
        self._ready.set()

    def report(self, topic: str, payload: bytes | Message) -> None:
        """Put `payload` once the next pass is under way, or REPORT_HOLD_S from now."""
        self._reports.append((topic, payload))
        self._report_topics.add(topic)
        if self._report_timer is None:
            loop = asyncio.get_running_loop()
            self._report_timer = loop.call_later(REPORT_HOLD_S, self.release_reports)

    def release_reports(self) -> None:
        """The reports held, put now (in the order they came)."""
        if not self._reports:  # after every pass: most often none (the timer comes with one)
            return
        if self._report_timer is not None:
            self._report_timer.cancel()
            self._report_timer = None
        reports, self._reports = self._reports, []
        self._report_topics.clear()
        for topic, payload in reports:
            self._put(topic, payload)

    @property
    def reports_held(self) -> int:
        return len(self._reports)

    @property
    def first(self) -> int:
        """The number of the oldest item still waiting (the next one put, when none waits)."""
        return next(iter(self._items), self._next)

    async def since(self, number: int) -> tuple[list[tuple[int, str, bytes | Message]], int]:
        """The waiting items numbered `number` on, once there is one; and the number after."""
        while self._next <= number:
            self._ready.clear()
            await self._ready.wait()
        return self._waiting(number), self._next

    async def _unstarted(self) -> list[tuple[int, str, bytes | Message]]:
        """The waiting items `publish` has not started, once there is one (those `_put`
        started itself are past the cursor already)."""
        while self._cursor >= self._next:
            self._ready.clear()
            await self._ready.wait()
        items = self._waiting(self._cursor)
        self._cursor = self._next
        return items

    def _waiting(self, number: int) -> list[tuple[int, str, bytes | Message]]:
        """The items still waiting, numbered `number` on."""
        return [(n, *self._items[n]) for n in range(number, self._next) if n in self._items]

    def sent(self, number: int) -> None:
        self._items.pop(number, None)

    def __len__(self) -> int:
        return len(self._items) + len(self._reports)

    async def publish(self, client: BusClient, name: str) -> None:
        """Publish on `client` until cancelled: each item goes out as soon as it is put, never
        behind the PUBACKs of the ones before it (each publish is started in order); those a
        lost connection left unacknowledged go out again first."""
        self._cursor = self.first
        try:
            async with task_group() as publishing:
                self._live = (client, publishing, name)
                while True:
                    for item, topic, payload in await self._unstarted():
                        publishing.create_task(
                            self._publish_one(client, item, topic, payload),
                            name=f"{name}-out-{item}",
                        )
        finally:
            self._live = None

    async def _publish_one(
        self, client: BusClient, item: int, topic: str, payload: bytes | Message
    ) -> None:
        if not isinstance(payload, bytes):
            try:
                payload = encode(payload)
            except BusError as exc:  # nothing to resend: it can never go out
                log.error("dropped a message for %s: %s", topic, exc.reason)
                self.sent(item)
                return
        await self._acknowledged(client, item, topic, client.start_publish(topic, payload))

    async def _acknowledged(
        self, client: BusClient, item: int, topic: str, publishing: asyncio.Future[object]
    ) -> None:
        await client.published(topic, publishing)
        self.sent(item)


async def heartbeat(
    client: BusClient, topic: str, status: Callable[[], bytes], beat_s: float
) -> None:
    """A status every `beat_s`, on a fixed beat: at QoS 0, so that a broker slow to acknowledge
    (a host at full load) never stretches the beat past what the coordinator counts as dead.
    Each is retained; the Will says offline."""
    loop = asyncio.get_running_loop()
    due = loop.time()
    while True:
        # After a stall the next beat goes at once, and the beat does not try to catch up.
        due = max(due + beat_s, loop.time())
        await asyncio.sleep(due - loop.time())
        await client.publish(topic, status(), qos=0, retain=True)
