"""Device presence, telemetry and commands: what the coordinator knows of each device."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from broker import messages as m
from broker.client import BusConnectionError
from broker.topics import DeviceChannel, device_topic
from coordinator.db.events import EventLog
from coordinator.db.models import DeviceKind, DeviceStatus
from coordinator.db.registry import (
    DeviceNotFoundError,
    DeviceRegistry,
    DeviceRetiredError,
    TelemetryValue,
)
from coordinator.runtime.quotas import Quotas, RateLimiter

log = logging.getLogger(__name__)

# A device silent for this many keepalives is offline even if its Last Will never came.
SILENCE_KEEPALIVES = 1.5
SWEEP_INTERVAL_S = 0.5
COMMAND_TIMEOUT_S = 10.0
# A device over its telemetry quota hears why at most this often.
REFUSAL_REPLY_INTERVAL_S = 5.0
# Dropped telemetry is logged at most this often (the count says how much).
DROP_LOG_INTERVAL_S = 10.0

Publish = Callable[[str, bytes], Awaitable[None]]
RttObserver = Callable[[str, float], None]  # (device id, RTT in ms)
DraftsObserver = Callable[[str, Sequence[str]], None]  # (device id, drafts installed)
TelemetryObserver = Callable[[str, m.Telemetry], None]  # (device id, its latest telemetry)
KindObserver = Callable[[str, str], None]  # (device id, its class: Status.kind)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


TelemetryWrite = Callable[[str, datetime, m.Telemetry], Awaitable[None]]


class TelemetryQueue:
    """The latest telemetry of each device waiting for the writer, in bounded memory.

    A device's newer message replaces the one still waiting (the registry keeps only the latest
    anyway); past `capacity` devices waiting, another device's message is dropped. Both are
    counted, and drops are logged.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._waiting: dict[str, tuple[datetime, m.Telemetry]] = {}
        self._ready = asyncio.Event()
        self.coalesced = 0
        self.dropped = 0
        self.written = 0
        self._drop_logged_at = 0.0

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, device_id: str, at: datetime, telemetry: m.Telemetry) -> bool:
        """Queue it; False when dropped (the queue is full of other devices' telemetry)."""
        if device_id in self._waiting:
            self.coalesced += 1
        elif len(self._waiting) >= self.capacity:
            self.dropped += 1
            now = time.monotonic()
            if now - self._drop_logged_at >= DROP_LOG_INTERVAL_S:
                self._drop_logged_at = now
                log.warning(
                    "telemetry queue full (%d devices waiting): dropped telemetry of %s "
                    "(%d dropped so far)",
                    len(self._waiting),
                    device_id,
                    self.dropped,
                )
            return False
        self._waiting[device_id] = (at, telemetry)
        self._ready.set()
        return True

    async def run(self, write: TelemetryWrite) -> None:
        """Write what waits, oldest device first, one at a time, until cancelled."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._waiting:
                device_id = next(iter(self._waiting))
                at, telemetry = self._waiting.pop(device_id)
                try:
                    await write(device_id, at, telemetry)
                except Exception:
                    # The database may be briefly away; the device's next telemetry follows.
                    log.exception("telemetry of %s was not written", device_id)
                self.written += 1


class CommandFailed(Exception):
    """A device answered a command with an error, or did not answer in time."""


class Fleet:
    """Presence from retained status messages and Last Wills, telemetry, and device commands.

    Every `at` handed to the registry is the coordinator's clock, never a device's: device
    clocks drift, and ordering a Last Will against a reconnect needs one clock.
    """

    def __init__(
        self,
        registry: DeviceRegistry,
        events: EventLog,
        publish: Publish,
        *,
        accept_unknown_devices: bool,
        default_keepalive_s: int,
        quotas: Quotas,
        telemetry_queue_size: int,
    ) -> None:
        self.registry = registry
        self.events = events
        self._publish = publish
        self.accept_unknown_devices = accept_unknown_devices
        self.default_keepalive_s = default_keepalive_s
        self._keepalive_s: dict[str, int] = {}
        # One status of a device at a time, in the order they are taken up: a takeover handles
        # the statuses it kept beside the bus loop's, and an older one must not be written over
        # a newer (one lock per device that spoke, as the keepalives above).
        self._status_locks: dict[str, asyncio.Lock] = {}
        # A shared fleet's presence: the devices whose statuses this coordinator takes (its
        # shards'). The sweep leaves the others to theirs: it knows neither their keepalive
        # nor when they last spoke, and marked a peer's devices offline at the default.
        self.acts_for: Callable[[str], bool] = lambda _device_id: True
        self._pending_commands: dict[str, asyncio.Future[m.CommandAck]] = {}
        # Who else learns from presence and telemetry (the adaptive policy).
        self.rtt_observers: list[RttObserver] = []
        self.drafts_observers: list[DraftsObserver] = []
        self.kind_observers: list[KindObserver] = []
        self.telemetry_observers: list[TelemetryObserver] = []
        self.telemetry_limit = RateLimiter(quotas.telemetry_per_s, quotas.telemetry_burst)
        self._refusal_replies = RateLimiter(1.0 / REFUSAL_REPLY_INTERVAL_S, 1)
        self.telemetry_refused = 0
        self.status_limit = RateLimiter(quotas.status_per_s, quotas.status_burst)
        self.status_refused = 0
        self.telemetry = TelemetryQueue(telemetry_queue_size)

    async def on_status(self, device_id: str, status: m.Status) -> None:
        """Presence and installed drafts, within the device's quota (each costs the registry a
        write; a device that floods loses only its own presence, which the sweep restores)."""
        async with self._status_locks.setdefault(device_id, asyncio.Lock()):
            await self._take_status(device_id, status)

    async def _take_status(self, device_id: str, status: m.Status) -> None:
        if not self.status_limit.allow(device_id):
            self.status_refused += 1
            await self._refuse(
                device_id, DeviceChannel.STATUS, self.status_limit, self.status_refused
            )
            return
        now = utcnow()
        if status.state is m.DeviceState.ONLINE:
            if not await self.admit(device_id, status.kind):
                return
            self._keepalive_s[device_id] = status.keepalive_s or self.default_keepalive_s
            detail = {"agent_version": status.agent_version, "runtimes": list(status.runtimes)}
            await self._registry_call(
                self.registry.mark_online,
                device_id,
                now,
                detail=detail,
                installed_models=status.drafts or None,
            )
            for observe_kind in self.kind_observers:
                observe_kind(device_id, status.kind)
            # None installed is news too: the policy then knows every release is missing there.
            for observe_drafts in self.drafts_observers:
                observe_drafts(device_id, status.drafts)
        else:
            await self._registry_call(
                self.registry.mark_offline, device_id, now, status.reason or "offline"
            )

    async def on_telemetry(self, device_id: str, telemetry: m.Telemetry) -> None:
        """Within the device's quota, echo a probe at once and queue the rest for the writer:
        the dispatch loop never waits on the database for telemetry."""
        if not self.telemetry_limit.allow(device_id):
            await self._refuse_telemetry(device_id)
            return
        for observe in self.telemetry_observers:  # in memory: heat and power, for the policy
            observe(device_id, telemetry)
        if telemetry.probe_nonce is not None:
            # Echo first: the device measures the RTT to us, not to our database.
            echo = m.Command(
                command_id=secrets.token_hex(8),
                name=m.CommandName.ECHO,
                args={"nonce": telemetry.probe_nonce},
                issued_at=time.time(),
            )
            await self._publish(device_topic(device_id, DeviceChannel.COMMAND), m.encode(echo))
        self.telemetry.put(device_id, utcnow(), telemetry)

    async def run_telemetry_writer(self) -> None:
        await self.telemetry.run(self._write_telemetry)

    async def _write_telemetry(self, device_id: str, at: datetime, telemetry: m.Telemetry) -> None:
        if not await self.admit(device_id):
            return
        if telemetry.rtt_ms is not None:
            for observe_rtt in self.rtt_observers:
                observe_rtt(device_id, telemetry.rtt_ms)
        await self._registry_call(
            self.registry.record_telemetry,
            device_id,
            at,
            rtt_ms=telemetry.rtt_ms,
            cpu_percent=telemetry.cpu_percent,
            memory_percent=telemetry.memory_percent,
            battery_percent=telemetry.battery_percent,
            thermal_c=telemetry.thermal_c,
            extra=_snapshot_extra(telemetry),
        )
        # Telemetry proves the device is alive; if presence had timed out, it is back.
        await self._registry_call(self.registry.mark_online, device_id, at)

    async def _refuse_telemetry(self, device_id: str) -> None:
        self.telemetry_refused += 1
        await self._refuse(
            device_id, DeviceChannel.TELEMETRY, self.telemetry_limit, self.telemetry_refused
        )

    async def _refuse(
        self, device_id: str, channel: DeviceChannel, limit: RateLimiter, refused: int
    ) -> None:
        """Over quota: dropped and counted; the device hears why, at most once a few seconds
        (a reply to every refused message would double the flood)."""
        if not self._refusal_replies.allow(device_id):
            return
        reason = (
            f"{channel.value} over quota ({limit.rate:g}/s, burst {limit.burst}): dropped "
            f"({refused} refused from all devices so far)"
        )
        log.warning("refused %s from %s: %s", channel.value, device_id, reason)
        reply = m.ErrorReply(refused_type=m.Refused(channel.value), reason=reason)
        try:
            await self._publish(device_topic(device_id, DeviceChannel.VERDICT), m.encode(reply))
        except (ConnectionError, BusConnectionError) as exc:
            log.warning("could not send an error reply to %s: %s", device_id, exc)

    async def on_ack(self, device_id: str, ack: m.CommandAck) -> None:
        future = self._pending_commands.pop(ack.command_id, None)
        if future is None:
            log.info("late or unknown ack %s from %s", ack.command_id, device_id)
            return
        if not future.done():
            future.set_result(ack)

    async def send_command(
        self,
        device_id: str,
        name: m.CommandName,
        args: dict[str, Any] | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> m.CommandAck:
        """Send a command and wait for the device's acknowledgement."""
        command = m.Command(
            command_id=secrets.token_hex(8),
            name=name,
            args=args or {},
            issued_at=time.time(),
        )
        future: asyncio.Future[m.CommandAck] = asyncio.get_running_loop().create_future()
        self._pending_commands[command.command_id] = future
        try:
            await self._publish(device_topic(device_id, DeviceChannel.COMMAND), m.encode(command))
            ack = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise CommandFailed(
                f"{device_id} did not answer {name.value} in {timeout_s}s"
            ) from None
        finally:
            self._pending_commands.pop(command.command_id, None)
        if not ack.ok:
            raise CommandFailed(f"{device_id} refused {name.value}: {ack.error}")
        return ack

    async def sweep(self) -> None:
        """Mark offline every online device silent for SILENCE_KEEPALIVES keepalives."""
        now = utcnow()
        online = await asyncio.to_thread(self.registry.online_last_seen)
        for device_id, last_seen in online:
            keepalive = self._keepalive_s.get(device_id, self.default_keepalive_s)
            if last_seen is None or not self.acts_for(device_id):
                continue
            if now - last_seen > timedelta(seconds=SILENCE_KEEPALIVES * keepalive):
                await self._registry_call(
                    self.registry.mark_offline, device_id, now, "silent past its keepalive"
                )

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await self.sweep()
            except Exception:
                # The database may be briefly away; presence resumes with it.
                log.exception("presence sweep failed")

    async def admit(self, device_id: str, kind: str = "other") -> bool:
        """Whether the device is registered; in the quickstart, unknown devices are enrolled."""
        return await asyncio.to_thread(self.admitted, device_id, kind)

    def admitted(self, device_id: str, kind: str = "other") -> bool:
        """`admit` in the calling thread (blocking): for work that reads the database in one
        hop to a thread, the registry's lookup, and an enrolment or refusal, among it."""
        try:
            device = self.registry.get(device_id)
        except DeviceNotFoundError:
            if not self.accept_unknown_devices:
                log.warning("refused unregistered device %s", device_id)
                self.events.append(
                    "device.refused", device_id=device_id, detail={"reason": "not registered"}
                )
                return False
            device_kind = kind if kind in {k.value for k in DeviceKind} else DeviceKind.OTHER
            self.registry.provision(device_id, device_kind, ("quickstart",), actor="coordinator")
            log.info("enrolled quickstart device %s", device_id)
            return True
        return device.status is not DeviceStatus.RETIRED

    async def _registry_call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            await asyncio.to_thread(method, *args, **kwargs)
        except (DeviceNotFoundError, DeviceRetiredError) as exc:
            log.warning("ignored a message for %s", exc)


def _snapshot_extra(telemetry: m.Telemetry) -> dict[str, TelemetryValue] | None:
    """What the device page shows beside the standard readings, for the telemetry snapshot: the
    drafts the device quarantined, the memory a new load may take, the drafts that do not fit."""
    extra: dict[str, TelemetryValue] = {}
    if telemetry.quarantined_drafts:
        extra["quarantined_drafts"] = ", ".join(telemetry.quarantined_drafts)
    if telemetry.memory_available_mb is not None:
        extra["memory_available_mb"] = telemetry.memory_available_mb
    if telemetry.drafts_over_memory:
        extra["drafts_over_memory"] = ", ".join(telemetry.drafts_over_memory)
    return extra or None
