"""The agent's life on the bus: presence, telemetry with RTT probes, and commands."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from broker import messages as m
from broker.client import (
    BrokerAddress,
    BusClient,
    ConnectOptions,
    Will,
    run_with_reconnect,
)
from broker.compat import task_group
from broker.topics import DeviceChannel, device_topic
from device_agent import __version__
from device_agent.health import read_health
from device_agent.settings import AgentSettings

log = logging.getLogger(__name__)

# Probes older than this are forgotten: the echo was lost, the next probe will measure.
PROBE_TTL_S = 30.0


class Agent:
    """One device on the bus; `run()` returns only when `stop()` is called."""

    def __init__(self, settings: AgentSettings, runtimes: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.device_id = settings.device_id
        self.runtimes = runtimes
        self.rtt_ms: float | None = None
        self._probes: dict[str, float] = {}  # nonce -> monotonic send time
        self._client: BusClient | None = None
        self._stopping = asyncio.Event()
        self.connected = asyncio.Event()

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
            keepalive_s=self.settings.keepalive_s,
            reason=reason,
        )

    def connect_options(self) -> ConnectOptions:
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
        await run_with_reconnect(
            address, self.connect_options(), self._session, on_disconnect=self._on_disconnect
        )

    async def stop(self) -> None:
        """Say goodbye (a retained offline status) and leave."""
        client = self._client
        if client is not None:
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
        await client.publish(
            self.topic(DeviceChannel.STATUS),
            m.encode(self._status(m.DeviceState.ONLINE)),
            retain=True,
        )
        self._client = client
        self.connected.set()
        async with task_group() as tasks:
            receiver = tasks.create_task(self._receive(client), name="agent-receive")
            telemetry = tasks.create_task(self._telemetry_loop(client), name="agent-telemetry")
            await self._stopping.wait()
            receiver.cancel()
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
        health = read_health()
        return m.Telemetry(
            device_id=self.device_id,
            at=time.time(),
            rtt_ms=self.rtt_ms,
            cpu_percent=health.cpu_percent,
            memory_percent=health.memory_percent,
            battery_percent=health.battery_percent,
            thermal_c=health.thermal_c,
            probe_nonce=nonce,
        )

    async def _receive(self, client: BusClient) -> None:
        async for incoming in client.messages():
            try:
                message = m.decode(incoming.payload)
            except m.BusError as exc:
                log.warning("refused a payload on %s: %s", incoming.topic, exc.reason)
                continue
            if isinstance(message, m.Command):
                await self._on_command(client, message)
            elif isinstance(message, m.ErrorReply):
                log.warning(
                    "the coordinator refused our %s: %s", message.refused_type, message.reason
                )
            else:
                log.warning("unexpected %s on %s", message.type, incoming.topic)

    async def _on_command(self, client: BusClient, command: m.Command) -> None:
        if command.name is m.CommandName.ECHO:
            sent = self._probes.pop(str(command.args.get("nonce", "")), None)
            if sent is not None:
                self.rtt_ms = (time.monotonic() - sent) * 1000.0
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
