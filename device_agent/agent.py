"""The agent's life on the bus: presence, telemetry with RTT probes, commands and sessions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from broker import messages as m
from broker.client import (
    BrokerAddress,
    BusClient,
    BusConnectionError,
    ConnectOptions,
    Will,
    run_with_reconnect,
)
from broker.topics import DeviceChannel, device_topic
from core.aio import task_group
from device_agent import __version__
from device_agent.admission import MB, MemoryAdmission, read_memory
from device_agent.catalog import DrafterCatalog
from device_agent.health import HealthReader
from device_agent.journal import JournalError, SessionJournal
from device_agent.local_api import LocalApi
from device_agent.models_store import ModelStore
from device_agent.sessions import SessionBook, SessionError, SessionRequest
from device_agent.settings import AgentSettings

log = logging.getLogger(__name__)

# Probes older than this are forgotten: the echo was lost, the next probe will measure.
PROBE_TTL_S = 30.0


class Agent:
    """One device on the bus; `run()` returns only when `stop()` is called.

    With `announce` off the agent is a one-shot connection (`specfleet-agent ask` when no agent
    runs): no presence, no Will, no telemetry, no local API, and a client id of its own, so that
    it never takes over or marks offline a resident agent of the same device.
    """

    def __init__(
        self, settings: AgentSettings, runtimes: tuple[str, ...] = (), *, announce: bool = True
    ) -> None:
        self.settings = settings
        self.device_id = settings.device_id
        self.runtimes = runtimes
        self.announce = announce
        self.rtt_ms: float | None = None
        self._probes: dict[str, float] = {}  # nonce -> monotonic send time
        self._health = HealthReader(settings.sys_root)
        self._client: BusClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self.connected = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.memory = MemoryAdmission(
            int(settings.memory_margin_mb * MB),
            lambda: read_memory(settings.proc_root, settings.sys_root),
        )
        self.catalog = DrafterCatalog(
            settings.resolved_models_dir,
            tokenizer_dir=settings.tokenizer_dir,
            target=settings.target,
            runtime=settings.draft_runtime,
            threads=settings.draft_threads,
            isolate=settings.isolate_drafts,
            admission=self.memory,
        )
        # Drafting is CPU work, and a LiteRT interpreter is not safe to share between threads:
        # one worker thread drafts for every session in turn, keeping the event loop free.
        self.drafting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specfleet-draft")
        # Only the resident agent journals its sessions: a one-shot `ask` must never resume them.
        self.journal: SessionJournal | None = None
        if announce and settings.journal:
            try:
                self.journal = SessionJournal(settings.journal_path)
            except JournalError as exc:
                log.error("%s; sessions will not survive a restart", exc)
        self.sessions = SessionBook(
            settings,
            self.catalog,
            self.publish,
            self.drafting,
            connected=self.connected,
            journal=self.journal,
        )
        self.local_api: LocalApi | None = None
        self.models = ModelStore.from_settings(settings)
        self.models.on_change = self._models_changed
        self.models.vocabulary = self.catalog.vocabulary  # drafts for this device's target only
        self.catalog.fetch_failure = self.models.failures.get
        # Drafts on demand: a session may ask for a draft this device lacks when signed
        # releases can be installed here; it drafts with the copying tiers until one arrives.
        self.sessions.on_demand = self.models.release_key is not None

    def _models_changed(self, name: str) -> None:
        """An install or rollback changed a model: new loads see it (sessions waiting for it
        load it at their next window), and the coordinator hears what is installed now."""
        self.catalog.forget(name)
        client = self._client
        if client is None or not self.announce:
            return
        status = m.encode(self._status(m.DeviceState.ONLINE))
        topic = self.topic(DeviceChannel.STATUS)

        async def publish() -> None:
            try:
                await client.publish(topic, status, retain=True)
            except BusConnectionError as exc:  # the next connection publishes it anyway
                log.warning("could not publish the status after an install: %s", exc)

        # Called from the install's worker thread: the publish belongs to the event loop.
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: self._spawn(publish(), "agent-status"))

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def topic(self, channel: DeviceChannel) -> str:
        return device_topic(self.device_id, channel)

    def _status(self, state: m.DeviceState, reason: str = "") -> m.Status:
        return m.Status(
            device_id=self.device_id,
            state=state,
            at=time.time(),
            agent_version=__version__,
            kind=self.settings.kind,
            runtimes=self.runtimes,
            drafts=tuple(self.models.installed())[:64],
            keepalive_s=self.settings.keepalive_s,
            reason=reason,
        )

    def connect_options(self) -> ConnectOptions:
        if not self.announce:
            return ConnectOptions(
                client_id=f"dev-{self.device_id}-{secrets.token_hex(4)}",
                username=self.device_id if self.settings.credential else None,
                password=self.settings.credential,
                keepalive_s=self.settings.keepalive_s,
                protocol=self.settings.mqtt_protocol,  # type: ignore[arg-type]
            )
        will = Will(
            self.topic(DeviceChannel.STATUS),
            m.encode(self._status(m.DeviceState.OFFLINE, "connection lost")),
        )
        return ConnectOptions(
            client_id=f"dev-{self.device_id}",
            username=self.device_id if self.settings.credential else None,
            password=self.settings.credential,
            keepalive_s=self.settings.keepalive_s,
            will=will,
            persistent=True,
            protocol=self.settings.mqtt_protocol,  # type: ignore[arg-type]
        )

    async def run(self) -> None:
        address = BrokerAddress.from_url(self.settings.broker_url, self.settings.ca_file)
        self._loop = asyncio.get_running_loop()
        if self.announce and self.settings.local_api:
            api = LocalApi(
                self.sessions,
                self.health,
                self.settings.local_api_port,
                connected=self.connected,
                connect_wait_s=self.settings.connect_wait_s,
            )
            try:
                await api.start()
                self.local_api = api
            except OSError as exc:  # another agent on this host holds the port
                log.warning("local API not started on port %d: %s", api.port, exc)
        # Sessions that ran when this agent stopped without closing them (a crash, a power cut)
        # go on; each asks the coordinator for its state once the bus is up.
        await self.sessions.resume_journal()
        bus = asyncio.create_task(
            run_with_reconnect(
                address, self.connect_options(), self._session, on_disconnect=self._on_disconnect
            ),
            name="agent-bus",
        )
        stopping = asyncio.create_task(self._stopping.wait(), name="agent-stopping")
        try:
            await asyncio.wait({bus, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not bus.done() and not self.connected.is_set():
                # Stopped while the broker is out of reach: the reconnect loop never ends by
                # itself (a connected session does, once it has said goodbye).
                bus.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await bus
            else:
                await bus
        finally:
            stopping.cancel()
            bus.cancel()
            if self.local_api is not None:
                await self.local_api.close()
            self.drafting.shutdown(wait=False, cancel_futures=True)
            self.catalog.stop()
            if self.journal is not None:
                self.journal.close()

    def health(self) -> dict[str, Any]:
        """What `GET /v1/health` reports."""
        return {
            "status": "ok",
            "device_id": self.device_id,
            "agent_version": __version__,
            "connected": self.connected.is_set(),
            "rtt_ms": self.rtt_ms,
            "drafters": self.catalog.names(),
            "default_draft": self.settings.default_draft,
            "proactive": self.settings.proactive,
            "sessions_active": len(self.sessions.active),
            "sessions_local": sum(1 for s in self.sessions.active if s.local),
            "draft_runtimes": [asdict(h) for h in self.catalog.runtime_health()],
        }

    async def publish(self, channel: DeviceChannel, message: m.Message) -> bool:
        """Publish on one of this device's topics; False when the bus is down (callers retry)."""
        client = self._client
        if client is None:
            return False
        try:
            await client.publish(self.topic(channel), m.encode(message))
        except BusConnectionError as exc:
            log.warning("could not publish %s: %s", message.type, exc)
            return False
        return True

    async def stop(self) -> None:
        """Close running sessions, say goodbye (a retained offline status) and leave."""
        await self.sessions.aclose()
        client = self._client
        if client is not None and self.announce:
            try:
                await client.publish(
                    self.topic(DeviceChannel.STATUS),
                    m.encode(self._status(m.DeviceState.OFFLINE, "agent stopped")),
                    retain=True,
                )
            except Exception as exc:  # the link may already be gone; the Will covers that
                log.warning("could not publish the offline status: %s", exc)
        self._stopping.set()

    async def _on_disconnect(self, exc: Exception) -> None:
        self._client = None
        self.connected.clear()

    async def _session(self, client: BusClient) -> None:
        await client.subscribe(self.topic(DeviceChannel.COMMAND))
        await client.subscribe(self.topic(DeviceChannel.VERDICT))
        if self.announce:
            await client.publish(
                self.topic(DeviceChannel.STATUS),
                m.encode(self._status(m.DeviceState.ONLINE)),
                retain=True,
            )
        self._client = client
        self.connected.set()
        # Sessions that ran before this connection ask for their state again.
        self.sessions.reconnected()
        async with task_group() as tasks:
            receiver = tasks.create_task(self._receive(client), name="agent-receive")
            if self.announce:
                telemetry = tasks.create_task(self._telemetry_loop(client), name="agent-telemetry")
            await self._stopping.wait()
            receiver.cancel()
            if self.announce:
                telemetry.cancel()

    async def _telemetry_loop(self, client: BusClient) -> None:
        while True:
            await client.publish(self.topic(DeviceChannel.TELEMETRY), m.encode(self._telemetry()))
            await asyncio.sleep(self.settings.telemetry_interval_s)

    def _telemetry(self) -> m.Telemetry:
        now = time.monotonic()
        self._probes = {n: t for n, t in self._probes.items() if now - t < PROBE_TTL_S}
        nonce = secrets.token_hex(8)
        self._probes[nonce] = now
        health = self._health.read()
        return m.Telemetry(
            device_id=self.device_id,
            at=time.time(),
            rtt_ms=self.rtt_ms,
            cpu_percent=health.cpu_percent,
            memory_percent=health.memory_percent,
            battery_percent=health.battery_percent,
            thermal_c=health.thermal_c,
            probe_nonce=nonce,
            charging=health.charging,
            power_saver=self.settings.power_saver,
            thermal_limit_c=self.settings.thermal_limit_c,
            battery_floor_percent=self.settings.battery_floor_percent,
            quarantined_drafts=self._quarantined_drafts(),
            memory_available_mb=self._memory_available_mb(),
            drafts_over_memory=tuple(self.catalog.over_memory()[:16]) or None,
        )

    def _memory_available_mb(self) -> float | None:
        available = self.memory.read().available_mb
        return None if available is None else round(available, 1)

    def _quarantined_drafts(self) -> tuple[str, ...] | None:
        names = [h.name for h in self.catalog.runtime_health() if h.quarantined]
        return tuple(names[:16]) or None

    async def _receive(self, client: BusClient) -> None:
        ours = {self.topic(DeviceChannel.COMMAND), self.topic(DeviceChannel.VERDICT)}
        async for incoming in client.messages():
            if incoming.topic not in ours:
                # Not a topic this agent subscribed to: the embedded broker was seen to hand
                # retained presence messages to a one-shot `ask` connection.
                log.debug("ignoring a message on %s", incoming.topic)
                continue
            try:
                message = m.decode(incoming.payload)
            except m.BusError as exc:
                log.warning("refused a payload on %s: %s", incoming.topic, exc.reason)
                continue
            if isinstance(message, m.Command):
                await self._on_command(client, message)
            elif isinstance(message, (m.Verdict, m.SessionState, m.ErrorReply)):
                if self.sessions.dispatch(message):
                    continue
                if isinstance(message, m.ErrorReply):
                    log.warning(
                        "the coordinator refused our %s: %s", message.refused_type, message.reason
                    )
                else:  # another connection of this device (an `ask`) owns that session
                    log.debug("%s for session %s, not ours", message.type, message.session_id)
            else:
                log.warning("unexpected %s on %s", message.type, incoming.topic)

    async def _on_command(self, client: BusClient, command: m.Command) -> None:
        if command.name is m.CommandName.ECHO:
            sent = self._probes.pop(str(command.args.get("nonce", "")), None)
            if sent is not None:
                self.rtt_ms = (time.monotonic() - sent) * 1000.0
            return
        if command.name is m.CommandName.DEPLOY_MODEL:
            self.models.start_deploy(client, command, self.device_id)  # acks when done
            return
        if command.name in (m.CommandName.START_SESSION, m.CommandName.CANCEL_SESSION):
            # Opening loads the tokenizer and the drafter: off the receive loop.
            task = asyncio.create_task(
                self._session_command(client, command), name=f"agent-{command.name.value}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if command.name is m.CommandName.PING:
            ack = m.CommandAck(
                command_id=command.command_id,
                device_id=self.device_id,
                ok=True,
                result={"pong": True, "agent_version": __version__, "rtt_ms": self.rtt_ms},
                at=time.time(),
            )
        else:  # a command this agent version does not know
            ack = m.CommandAck(
                command_id=command.command_id,
                device_id=self.device_id,
                ok=False,
                error=f"unsupported command {command.name.value!r}",
                at=time.time(),
            )
        await client.publish(self.topic(DeviceChannel.ACK), m.encode(ack))

    async def _session_command(self, client: BusClient, command: m.Command) -> None:
        result: dict[str, Any] = {}
        error = ""
        if command.name is m.CommandName.START_SESSION:
            try:
                session_id, request = SessionRequest.from_command(command.args)
                running = self.sessions.get(session_id)
                if running is None:  # a repeated command finds its session running
                    running = await self.sessions.start(request, session_id)
                result = {"session_id": session_id, "status": running.status}
            except SessionError as exc:
                error = str(exc)
        else:
            session_id = str(command.args.get("session_id", ""))
            found = self.sessions.get(session_id)
            if found is None:
                error = f"no session {session_id!r} on this device"
            else:
                reason = str(command.args.get("reason", "cancelled by the coordinator"))
                await found.cancel(reason[:256])
                result = {"session_id": session_id, "status": found.status}
        ack = m.CommandAck(
            command_id=command.command_id,
            device_id=self.device_id,
            ok=not error,
            result=result,
            error=error[:1024],
            at=time.time(),
        )
        await client.publish(self.topic(DeviceChannel.ACK), m.encode(ack))
