"""The coordinator process: one bus connection, its subscriptions, and the handlers behind them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from sqlalchemy.engine import Engine

from broker import messages as m
from broker.client import (
    BrokerAddress,
    BusClient,
    BusConnectionError,
    ConnectOptions,
    run_with_reconnect,
)
from broker.topics import (
    VERIFIER_ROOT,
    DeviceChannel,
    VerifierChannel,
    device_subscription,
    device_topic,
    parse_device_topic,
    parse_verifier_topic,
    verifier_subscription,
    verifier_topic,
)
from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventLog
from coordinator.db.models import SessionStatus
from coordinator.db.registry import DeviceRegistry
from coordinator.runtime.draft_fetches import DraftFetches
from coordinator.runtime.draft_wants import deliverable_drafts
from coordinator.runtime.fleet import Fleet
from coordinator.runtime.foreign_closes import ForeignCloses
from coordinator.runtime.quotas import Quotas
from coordinator.runtime.session_state import LiveSession
from coordinator.runtime.sessions import SessionBook
from coordinator.runtime.shards import ShardLeases, shard_of
from coordinator.runtime.verifiers import VerifierPool
from core.aio import task_group
from core.settings import Settings
from inference.artifacts import TargetIdentity

log = logging.getLogger(__name__)

DEVICE_CHANNELS = (
    DeviceChannel.STATUS,
    DeviceChannel.TELEMETRY,
    DeviceChannel.ACK,
    DeviceChannel.SESSION,
    DeviceChannel.DRAFT,
)
VERIFIER_CHANNELS = (VerifierChannel.STATUS, VerifierChannel.RESULT)

# Which message each device channel carries; anything else on it is refused.
EXPECTED_ON_DEVICE_CHANNEL: dict[DeviceChannel, tuple[type[Any], ...]] = {
    DeviceChannel.STATUS: (m.Status,),
    DeviceChannel.TELEMETRY: (m.Telemetry,),
    DeviceChannel.ACK: (m.CommandAck,),
    DeviceChannel.SESSION: (m.SessionOpen, m.SessionClose),
    DeviceChannel.DRAFT: (m.Draft,),
}

DeviceHandler = Callable[[str, Any], Awaitable[None]]

# A close sent on to the session's owner (a shared fleet): how long its answer is waited for
# before this coordinator closes the session itself (no coordinator held the device's shard).
FORWARDED_CLOSE_WAIT_S = 5.0
# A shared fleet's coordinator keeps the last status of each device of other shards, for the
# day it takes their shard over; at most this many (one a device: far more than a fleet).
MAX_FOREIGN_STATUSES = 250_000


def configured_target(settings: Settings) -> TargetIdentity | None:
    """The settings' target (SmolLM2 unless `target` names another) from its manifest in the
    models directory; None where this host has no build of it (verifiers then announce it)."""
    from inference.artifacts import ArtifactError
    from modelbuild.target_build import load_target_identity

    try:
        return load_target_identity(settings.resolved_models_dir, settings.target)
    except ArtifactError as exc:
        log.info("no target manifest here (%s); verifiers will announce the target", exc)
        return None


def _heartbeats_first(topic: str) -> int:
    """The verifiers' heartbeats are read before the device messages that came earlier: a burst
    of those (a thousand statuses as a fleet reconnects, each a database write here, or a wave
    of session opens) must not hold a live verifier's heartbeats back until it is declared
    dead. Nothing else jumps the queue: a direct round's report must come after its draft,
    which the coordinator would otherwise take, its session finished, for one to answer again."""
    heartbeat = topic.startswith(_VERIFIER_PREFIX) and topic.endswith(_STATUS_SUFFIX)
    return 0 if heartbeat else 1


# Every incoming message is ranked: string tests, not the topic's regular expression.
_VERIFIER_PREFIX = f"{VERIFIER_ROOT}/"
_STATUS_SUFFIX = f"/{VerifierChannel.STATUS.value}"


class Coordinator:
    """Presence, telemetry and commands now; sessions and verifiers plug in through handlers."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        client_id: str | None = None,
        accept_unknown_devices: bool | None = None,
        target: TargetIdentity | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """`target`: the target's identity from its manifest (EOS, vocabulary), for when no
        verifier has announced it yet; `vocab_size` defaults to its vocabulary's."""
        self.settings = settings
        self.sessions = make_sessionmaker(engine)
        self.registry = DeviceRegistry(self.sessions)
        self.events = EventLog(self.sessions)
        self.client_id = client_id or settings.coordinator_id
        self._client: BusClient | None = None
        self.connected = asyncio.Event()
        if accept_unknown_devices is None:
            accept_unknown_devices = settings.environment == "quickstart"
        quotas = Quotas.from_settings(settings)
        self.fleet = Fleet(
            self.registry,
            self.events,
            self.publish,
            accept_unknown_devices=accept_unknown_devices,
            default_keepalive_s=settings.device_keepalive_s,
            quotas=quotas,
            telemetry_queue_size=settings.telemetry_queue_size,
        )
        self.verifiers = VerifierPool(
            self.publish,
            forget_after_s=settings.verifier_forget_after_s,
            clear_status=self._clear_verifier_status,
        )
        self.book = SessionBook(
            self.sessions,
            self.verifiers,
            self.publish,
            target=target,
            admit=self.fleet.admitted,
            quotas=quotas,
            idle_timeout_s=settings.session_idle_timeout_s,
            vocab_size=vocab_size
            if vocab_size is not None or target is None
            else target.vocab_size,
        )
        self.fleet.rtt_observers.append(self.book.policy.observe_rtt)
        self.fleet.drafts_observers.append(self.book.policy.set_device_drafts)
        self.fleet.telemetry_observers.append(self.book.policy.observe_telemetry)
        self.fleet.kind_observers.append(self.book.policy.wants.kinds.__setitem__)
        # What drafts on demand can send, for the policy to rate on devices that lack it.
        self.book.policy.wants.deliverable = deliverable_drafts(
            settings.home, settings.resolved_models_dir
        )
        self.book.fetches = DraftFetches(
            settings.home,
            settings.resolved_models_dir,
            settings.artifact_base_url
            or f"http://{settings.http_host}:{settings.http_port}/api/v1",
            self.fleet.send_command,
            self.book.policy,
        )
        self.device_handlers: dict[type[Any], DeviceHandler] = {
            m.Status: self.fleet.on_status,
            m.Telemetry: self.fleet.on_telemetry,
            m.CommandAck: self.fleet.on_ack,
            m.SessionOpen: self.book.on_session_open,
            m.SessionClose: self.book.on_session_close,
            m.Draft: self.book.on_draft,
        }
        # Drafts wait for a verifier; they run as tasks so the bus keeps flowing meanwhile.
        # A close may wait for a verifier to give the session back, whose answer comes here.
        self.concurrent_handlers: set[type[Any]] = {m.Draft, m.SessionOpen, m.SessionClose}
        self.verifier_handlers: dict[type[Any], Callable[[str, Any], Awaitable[None]]] = {
            m.VerifierStatus: self.verifiers.on_status,
            m.VerifyResult: self.verifiers.on_result,
            m.VerifyResults: self.verifiers.on_results,
            m.LeaseAck: self.verifiers.on_lease_ack,
            m.RoundDone: self.book.on_round_done,
        }
        # A direct round's report may take the session back (a host mode), waiting for an
        # answer that comes through this same loop: it runs as a task.
        self.concurrent_verifier_handlers: set[type[Any]] = {m.RoundDone}
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = [
            self.fleet.run_sweeper,
            self.verifiers.watch,
            self.book.run_writer,
            self.book.run_sweeper,
            self.fleet.run_telemetry_writer,
        ]
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._rebuilt: list[LiveSession] = []
        # The last status payload of each device of another coordinator's shard, kept raw (it is
        # validated when handled, if ever): a takeover handles those of its new shards.
        self._foreign_statuses: dict[str, bytes] = {}
        self._foreign_statuses_full = False
        self._foreign_closes = ForeignCloses()
        self._connections = 0
        # A shared fleet: this coordinator answers only the devices of the shards it holds.
        self.shards: ShardLeases | None = None
        if settings.shared_fleet:
            self.shards = ShardLeases(
                settings.database_url,
                on_gained=self._take_shards,
                on_released=self._hand_back_shards,
            )
            self.book.acts_for = self.shards.owns
            self.fleet.acts_for = self.shards.owns
            self.verifier_handlers[m.RoundDone] = self._on_round_done
            self.verifiers.shared = True
            self.background.append(self._run_shards)

    async def _clear_verifier_status(self, verifier_id: str) -> None:
        """An empty retained message: the broker forgets the verifier's last status."""
        await self.publish(verifier_topic(verifier_id, VerifierChannel.STATUS), b"", retain=True)

    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        client = self._client
        if client is None:
            raise ConnectionError("the coordinator is not connected to the broker")
        await client.publish(topic, payload, retain=retain)

    def connect_options(self) -> ConnectOptions:
        return ConnectOptions(
            client_id=self.client_id,
            username=self.settings.broker_username,
            password=self.settings.broker_password,
            keepalive_s=10,
            # Persistent: drafts published while the coordinator restarts wait at the broker.
            persistent=True,
            protocol=self.settings.mqtt_protocol,
            priority=_heartbeats_first,
        )

    async def run(self) -> None:
        address = BrokerAddress.from_url(self.settings.broker_url)
        # A restart: the database holds every session that was running; they resume here. A
        # shared fleet's sessions come back shard by shard, as their locks are taken.
        if self.shards is None:
            self._rebuilt = await self.book.rebuild()
        if self._rebuilt:
            await asyncio.to_thread(
                self.events.append,
                "coordinator.sessions_rebuilt",
                detail={
                    "sessions": len(self._rebuilt),
                    "session_ids": [live.id for live in self._rebuilt[:100]],
                },
            )
        async with task_group() as tasks:
            for job in self.background:
                tasks.create_task(job(), name=f"coordinator-{getattr(job, '__name__', 'job')}")
            await run_with_reconnect(
                address,
                self.connect_options(),
                self._bus_session,
                on_disconnect=self._on_disconnect,
            )

    async def _on_disconnect(self, exc: Exception) -> None:
        self._client = None
        self.connected.clear()

    async def _bus_session(self, client: BusClient) -> None:
        for channel in DEVICE_CHANNELS:
            await client.subscribe(device_subscription(channel))
        for vchannel in VERIFIER_CHANNELS:
            await client.subscribe(verifier_subscription(vchannel))
        self._client = client
        self.connected.set()
        if self._connections:
            # A reconnect: drafts, opens and results may have been lost while we were away.
            self.verifiers.reroute_all("the coordinator's bus connection dropped")
            waiting = [s for s in self.book.live.values() if s.status is SessionStatus.ACTIVE]
        else:  # the first connection: devices may wait on a verdict lost with the old process
            waiting, self._rebuilt = self._rebuilt, []
        self._connections += 1
        if waiting:
            task = asyncio.create_task(
                self.book.announce(waiting, quiet_since=time.monotonic()),
                name="announce-sessions",
            )
            self._handler_tasks.add(task)
            task.add_done_callback(self._handler_tasks.discard)
        async for incoming in client.messages():
            await self.dispatch(incoming.topic, incoming.payload)

    async def dispatch(self, topic: str, payload: bytes) -> None:
        """Validate one message at the boundary and hand it to its handler; never raise."""
        try:
            await self._dispatch(topic, payload)
        except Exception:
            log.exception("handler failed for a message on %s", topic)

    async def _dispatch(self, topic: str, payload: bytes) -> None:
        device = parse_device_topic(topic)
        if device is not None:
            await self._dispatch_device(device.device_id, device.channel, payload)
            return
        verifier = parse_verifier_topic(topic)
        if verifier is not None:
            if not payload and verifier.channel is VerifierChannel.STATUS:
                self.verifiers.forget(verifier.verifier_id)  # its retained status, cleared
                return
            try:
                message = m.decode(payload)
            except m.BusError as exc:
                log.warning(
                    "refused a payload from verifier %s: %s", verifier.verifier_id, exc.reason
                )
                return
            handler = self.verifier_handlers.get(type(message))
            if handler is None:
                log.warning("unexpected %s from verifier %s", message.type, verifier.verifier_id)
                return
            if type(message) in self.concurrent_verifier_handlers:
                task = asyncio.create_task(
                    self._guarded(handler, verifier.verifier_id, message),
                    name=f"{message.type}-{verifier.verifier_id}",
                )
                self._handler_tasks.add(task)
                task.add_done_callback(self._handler_tasks.discard)
                return
            await handler(verifier.verifier_id, message)
            return
        log.warning("message on an unknown topic %s", topic)

    async def _dispatch_device(
        self, device_id: str, channel: DeviceChannel, payload: bytes
    ) -> None:
        shared_out = self.shards is not None and not self.shards.owns(device_id)
        if channel is DeviceChannel.STATUS:
            self._foreign_statuses.pop(device_id, None)
            if shared_out:
                self._keep_foreign_status(device_id, payload)
                return
        if shared_out and channel is not DeviceChannel.ACK:
            # Another coordinator's device; acks answer whoever sent the command.
            if channel is DeviceChannel.SESSION:
                self._foreign_closes.keep(device_id, payload)
            return
        try:
            message = m.decode(payload)
            if not isinstance(message, EXPECTED_ON_DEVICE_CHANNEL[channel]):
                raise m.BusError(f"{message.type} is not allowed on {channel.value}")
            claimed = getattr(message, "device_id", device_id)
            if claimed != device_id:
                raise m.BusError(f"device {device_id} spoke as {claimed}")
        except m.BusError as exc:
            log.warning("refused a payload from %s on %s: %s", device_id, channel.value, exc.reason)
            await self._refuse(device_id, channel, payload, exc.reason)
            return
        handler = self.device_handlers.get(type(message))
        if handler is None:
            await self._refuse(device_id, channel, payload, f"{message.type} is not served here")
            return
        if type(message) in self.concurrent_handlers:
            task = asyncio.create_task(
                self._guarded(handler, device_id, message), name=f"{message.type}-{device_id}"
            )
            self._handler_tasks.add(task)
            task.add_done_callback(self._handler_tasks.discard)
        else:
            await handler(device_id, message)

    # --- a shared fleet -------------------------------------------------------------------------

    async def _run_shards(self) -> None:
        assert self.shards is not None
        await self.shards.run(ready=self.connected)

    def _keep_foreign_status(self, device_id: str, payload: bytes) -> None:
        if not payload:  # a retained status cleared
            return
        if len(self._foreign_statuses) >= MAX_FOREIGN_STATUSES:
            if not self._foreign_statuses_full:  # said once: a fleet that large floods the log
                log.warning(
                    "more than %d devices of other shards: their statuses are no longer kept "
                    "(a takeover learns of them from their next status)",
                    MAX_FOREIGN_STATUSES,
                )
                self._foreign_statuses_full = True
            return
        self._foreign_statuses[device_id] = payload

    async def _take_shards(self, shards: frozenset[int]) -> None:
        """Shards just locked: their active sessions come back from the database and their
        devices are told where each stands (a draft sent to the old owner is re-sent); then
        their devices' presence, from the last status each sent while another coordinator
        held the shard. (It was asked of the broker again: a new subscription brought back the
        retained status of every device of the fleet, this coordinator's own included, handled
        one by one on the bus loop with the drafts waiting behind them.)"""
        # Drafts of the new shards' sessions are answered from now on: their devices need no
        # state (it would only make them send again a draft being answered).
        since = time.monotonic()

        def taken(device_id: str) -> bool:
            return shard_of(device_id) in shards

        rebuilt = await self.book.rebuild(taken, heard_at=since)
        rebuilt = await self._foreign_closes.close_rebuilt(self.book, rebuilt, taken)
        if rebuilt:
            log.info("took over %d sessions with %d shards", len(rebuilt), len(shards))
            await self.book.announce(rebuilt, quiet_since=since)
        statuses = [device_id for device_id in self._foreign_statuses if taken(device_id)]
        for device_id in statuses:
            # Gone when a newer status came meanwhile (handled as it came).
            payload = self._foreign_statuses.pop(device_id, None)
            if payload is not None:
                await self.dispatch(device_topic(device_id, DeviceChannel.STATUS), payload)
        if statuses:
            log.info("took the presence of %d devices with %d shards", len(statuses), len(shards))

    async def close_session(self, device_id: str, close: m.SessionClose) -> None:
        """A close asked of this coordinator (the API's cancel), made by the session's owner:
        in a shared fleet, the owner of another shard's device hears it on the device's session
        topic, as if the device had closed it, so its copy in memory goes too (closing only the
        row here left the owner answering drafts). Closed here after FORWARDED_CLOSE_WAIT_S if
        the row is still active (no coordinator held the shard)."""
        if self.shards is None or self.shards.owns(device_id):
            await self.book.on_session_close(device_id, close)
            return
        await self.publish(device_topic(device_id, DeviceChannel.SESSION), m.encode(close))
        deadline = time.monotonic() + FORWARDED_CLOSE_WAIT_S
        while time.monotonic() < deadline:
            stored = await asyncio.to_thread(self.book.store.load, close.session_id)
            if stored is None or stored.status is not SessionStatus.ACTIVE:
                return
            await asyncio.sleep(0.1)
        log.warning("no owner closed session %s of %s; closed here", close.session_id, device_id)
        await self.book.on_session_close(device_id, close)

    async def _hand_back_shards(self, shards: frozenset[int]) -> None:
        """Before their locks go: let each session's round in flight finish, then forget it
        (the database has it; the next owner rebuilds it)."""
        for live in [s for s in self.book.live.values() if shard_of(s.device_id) in shards]:
            async with live.lock:
                self.book.live.pop(live.id, None)

    async def _on_round_done(self, verifier_id: str, done: m.RoundDone) -> None:
        if done.session_id in self.book.live:  # else another coordinator's session
            await self.book.on_round_done(verifier_id, done)

    async def _guarded(self, handler: DeviceHandler, device_id: str, message: Any) -> None:
        try:
            await handler(device_id, message)
        except (ConnectionError, BusConnectionError) as exc:
            # The link dropped, or the coordinator stopped, before a reply's PUBACK came back
            # (it can wait behind a flood of inbound messages). Nothing is lost: the sender asks
            # again when no answer comes, and a reconnect resynchronises the sessions.
            log.warning(
                "%s from %s: the reply may not have gone out: %s", message.type, device_id, exc
            )
        except Exception:
            log.exception("%s from %s failed", message.type, device_id)

    async def _refuse(
        self, device_id: str, channel: DeviceChannel, payload: bytes, reason: str
    ) -> None:
        """Tell the device why, where it has somewhere to hear it; status and acks have none."""
        if channel in (DeviceChannel.STATUS, DeviceChannel.ACK, DeviceChannel.TELEMETRY):
            return
        reply = m.ErrorReply(refused_type=m.Refused(channel.value), reason=reason[:1024])
        try:
            await self.publish(device_topic(device_id, DeviceChannel.VERDICT), m.encode(reply))
        except (ConnectionError, BusConnectionError, m.BusError) as exc:
            log.warning("could not send an error reply to %s: %s", device_id, exc)
