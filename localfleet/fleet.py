"""A whole fleet on one machine: broker, database, coordinator, verifier and agent processes.

The demo, the end-to-end tests and the benchmarks run the same pieces the same way, as separate
processes talking over a real broker, so a SIGKILL of any one of them is a real fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from broker.client import BrokerAddress
from broker.mosquitto import MosquittoError, free_port, popen_tied, wait_for_port
from coordinator.db.registry import DeviceExistsError, DeviceRegistry
from coordinator.runtime.service import Coordinator, configured_target
from coordinator.stack import (
    COORDINATOR_USER,
    NOISY_LOGGERS,
    VERIFIER_USER,
    LocalBrokerChoice,
    OwnBroker,
    prepare_database,
    start_own_broker,
)
from core.settings import Settings
from netem.emulator import NetworkEmulator

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class AgentSpec:
    device_id: str
    kind: str
    draft: str
    runtime: str  # onnx | tflite | none (lookup drafters need no runtime)


@dataclass
class ChildProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """In a session of its own (a Ctrl-C is ours to pass on, in order), and sent SIGTERM if
        this process ends without stopping it (SIGKILL included), so that it stops as on Ctrl-C
        instead of running on with nobody to stop it."""
        with self.log_path.open("ab") as log_file:
            self.process = popen_tied(self.argv, log=log_file, env=self.env, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; the event loop (and an embedded broker in
        it) keeps running meanwhile, so the child can say goodbye on the bus."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.process.kill()
                break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.process.wait)


@dataclass(kw_only=True)
class FleetProcesses:
    """The child processes of a fleet on one machine: verifiers, agents, and, for faults that
    need one, the coordinator itself (`specfleet up` against the same broker and database)."""

    settings: Settings
    broker_url: str  # the coordinator's and the verifiers'
    # The agents' (a private Mosquitto has a listener for devices apart from the services'
    # one); empty: the same as broker_url.
    device_broker_url: str = ""
    credentials: dict[str, str]  # username -> plaintext, devices and services
    workdir: Path
    verifiers: dict[str, ChildProcess] = field(default_factory=dict)
    agents: dict[str, ChildProcess] = field(default_factory=dict)
    agent_ports: dict[str, int] = field(default_factory=dict)
    # How each agent was started (broker URL override, extra flags), so it restarts the same.
    agent_starts: dict[str, tuple[AgentSpec, str | None, tuple[str, ...]]] = field(
        default_factory=dict
    )
    coordinator_child: ChildProcess | None = None
    coordinator_http_port: int = 0

    def _child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
        env["SPECFLEET_HOME"] = str(self.settings.home)
        env["SPECFLEET_MODELS_DIR"] = str(self.settings.resolved_models_dir)
        env["SPECFLEET_MQTT_PROTOCOL"] = self.settings.mqtt_protocol
        if self.settings.target is not None:  # verifiers load it, agents read its tokenizer
            env["SPECFLEET_TARGET"] = self.settings.target
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start_coordinator(self) -> ChildProcess:
        """`specfleet up` against this fleet's broker and database, under the same client id
        every time, so a restarted coordinator takes over its persistent MQTT session."""
        self.coordinator_http_port = self.coordinator_http_port or free_port()
        argv = [
            sys.executable,
            "-m",
            "specfleet",
            "up",
            "--broker",
            self.broker_url,
            "--database-url",
            self.settings.database_url,
            "--http-port",
            str(self.coordinator_http_port),
        ]
        env = self._child_env()
        env["SPECFLEET_COORDINATOR_ID"] = self.settings.coordinator_id
        if self.settings.broker_username:
            env["SPECFLEET_BROKER_USERNAME"] = self.settings.broker_username
        if self.settings.broker_password:
            env["SPECFLEET_BROKER_PASSWORD"] = self.settings.broker_password
        child = ChildProcess("coordinator", argv, env, self.workdir / "coordinator.log")
        child.start()
        self.coordinator_child = child
        return child

    def start_verifier(
        self, verifier_id: str, *, threads: int = 1, extra: Sequence[str] = ()
    ) -> ChildProcess:
        argv = [
            sys.executable,
            "-m",
            "specfleet",
            "verifier",
            "--id",
            verifier_id,
            "--broker-url",
            self.broker_url,
            "--username",
            VERIFIER_USER,
            "--threads",
            str(threads),
            "--database-url",
            self.settings.database_url,
            *extra,
        ]
        env = self._child_env()
        # Secrets go in the environment, not argv, where `ps` shows them to every user.
        env["SPECFLEET_BROKER_PASSWORD"] = self.credentials[VERIFIER_USER]
        child = ChildProcess(verifier_id, argv, env, self.workdir / f"{verifier_id}.log")
        child.start()
        self.verifiers[verifier_id] = child
        return child

    def start_agent(
        self, spec: AgentSpec, *, broker_url: str | None = None, extra: Sequence[str] = ()
    ) -> ChildProcess:
        """An agent process; `broker_url` overrides the fleet's (an emulated link in front of
        the broker), `extra` adds flags of `specfleet-agent run`. A restarted agent keeps its
        home directory and its local API port."""
        port = self.agent_ports.setdefault(spec.device_id, free_port())
        argv = [
            sys.executable,
            "-m",
            "device_agent.cli",
            "run",
            "--device-id",
            spec.device_id,
            "--broker-url",
            broker_url or self.device_broker_url or self.broker_url,
            "--kind",
            spec.kind,
            "--draft",
            spec.draft,
            "--local-api-port",
            str(port),
            *extra,
        ]
        if spec.runtime != "none":
            argv += ["--draft-runtime", spec.runtime]
        env = self._child_env()
        env["SPECFLEET_HOME"] = str(self.workdir / spec.device_id)
        env["SPECFLEET_CREDENTIAL"] = self.credentials[spec.device_id]
        child = ChildProcess(spec.device_id, argv, env, self.workdir / f"{spec.device_id}.log")
        child.start()
        self.agents[spec.device_id] = child
        self.agent_starts[spec.device_id] = (spec, broker_url, tuple(extra))
        return child

    async def restart_agent(self, device_id: str, *, kill: bool = True) -> ChildProcess:
        """SIGKILL an agent (a crash, unless `kill` is off and it is already gone), start it again
        as before, and wait until its local API answers."""
        if kill:
            self.agents[device_id].kill()
        spec, broker_url, extra = self.agent_starts[device_id]
        child = self.start_agent(spec, broker_url=broker_url, extra=extra)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not child.alive():
                raise RuntimeError(f"agent {device_id} exited: see {child.log_path}")
            try:
                await asyncio.to_thread(
                    wait_for_port, "127.0.0.1", self.agent_ports[device_id], 0.5
                )
                return child
            except (OSError, MosquittoError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agent {device_id} did not come back") from None

    async def wait_agents(self, deadline: float) -> None:
        """Until every agent's local API answers."""
        for device_id, port in self.agent_ports.items():
            child = self.agents[device_id]
            while True:
                if not child.alive():
                    raise RuntimeError(f"agent {device_id} exited: see {child.log_path}")
                try:
                    await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 0.5)
                    break
                except (OSError, MosquittoError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"agent {device_id} did not come up") from None

    async def stop_children(self) -> None:
        """In the order of an orderly shutdown: the agents (their sessions close), then the
        verifiers (with no work left, they leave without a fail-over), then the coordinator."""
        await asyncio.gather(*(child.stop() for child in self.agents.values()))
        await asyncio.gather(*(child.stop() for child in self.verifiers.values()))
        if self.coordinator_child is not None:
            await self.coordinator_child.stop()


@dataclass(kw_only=True)
class LocalFleet(FleetProcesses):
    """A fleet whose coordinator runs in this process (the demo, most tests, the benchmarks)."""

    coordinator: Coordinator
    own_broker: OwnBroker | None = None  # the broker started for this fleet, if any
    # Network emulators between agents and the broker, by device id (`behind_netem`): cut,
    # stall or reshape one agent's link alone.
    links: dict[str, NetworkEmulator] = field(default_factory=dict)
    _coordinator_task: asyncio.Task[None] | None = None

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every verifier has announced itself and every agent's local API answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = {v.verifier_id for v in self.coordinator.verifiers.live()}
            if set(self.verifiers) <= live:
                break
            for child in self.verifiers.values():
                if not child.alive():
                    raise RuntimeError(f"verifier {child.name} exited: see {child.log_path}")
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError("verifiers did not come up; see their logs in " + str(self.workdir))
        await self.wait_agents(deadline)


def _provision(registry: DeviceRegistry, spec: AgentSpec) -> str:
    """A fresh credential for a demo device (rotated if it exists from an earlier run)."""
    try:
        _, credential = registry.provision(spec.device_id, spec.kind, ("demo",), actor="demo")
    except DeviceExistsError:
        credential = registry.rotate_credential(spec.device_id, actor="demo")
    return credential


@contextlib.asynccontextmanager
async def local_fleet(
    settings: Settings,
    agents: list[AgentSpec],
    verifier_ids: list[str],
    *,
    workdir: Path,
    external_broker: str | None = None,
    behind_netem: Collection[str] = (),
    agent_flags: Sequence[str] = (),
    verifier_flags: Sequence[str] = (),
    local_broker: LocalBrokerChoice = "amqtt",
) -> AsyncIterator[LocalFleet]:
    """Start everything, yield once all are up, stop everything on exit.

    Without `external_broker`, the fleet runs a broker of its own as `specfleet up` does
    (`local_broker`: "auto" is a private Mosquitto with the production config where one is
    installed, else the embedded amqtt). The agents named in `behind_netem` reach the broker
    through a `NetworkEmulator` of their own, running in this event loop (`fleet.links`);
    `agent_flags` go to every agent's command, `verifier_flags` to every verifier's.
    """
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    workdir.mkdir(parents=True, exist_ok=True)
    engine = await asyncio.to_thread(prepare_database, settings)
    from coordinator.db.engine import make_sessionmaker

    registry = DeviceRegistry(make_sessionmaker(engine))
    credentials = {spec.device_id: _provision(registry, spec) for spec in agents}
    own: OwnBroker | None = None
    if external_broker is None:
        own = await start_own_broker(settings, free_port(), registry, local_broker)
        credentials.update(own.credentials)
        settings = own.settings  # on the services' listener, with the coordinator's account
        broker_url = settings.broker_url
    else:
        # An external broker is set up by its operator; these clients authenticate if it asks.
        credentials.update({COORDINATOR_USER: "", VERIFIER_USER: ""})
        broker_url = external_broker
        settings = settings.model_copy(update={"broker_url": broker_url})
    # The target comes from the settings (`target`, the models directory), as in production.
    coordinator = Coordinator(settings, engine, target=configured_target(settings))
    fleet = LocalFleet(
        settings=settings,
        coordinator=coordinator,
        broker_url=broker_url,
        device_broker_url=own.device_url if own is not None else "",
        credentials=credentials,
        workdir=workdir,
        own_broker=own,
    )
    if own is not None:  # devices provisioned while the fleet runs can connect
        coordinator.background.append(own.refresh_forever)
    fleet._coordinator_task = asyncio.create_task(coordinator.run(), name="coordinator")
    try:
        await asyncio.wait_for(coordinator.connected.wait(), 30)
        for verifier_id in verifier_ids:
            fleet.start_verifier(verifier_id, extra=verifier_flags)
        upstream = BrokerAddress.from_url(fleet.device_broker_url or broker_url)
        for spec in agents:
            agent_broker = None
            if spec.device_id in behind_netem:
                link = NetworkEmulator(0, upstream.host, upstream.port)
                await link.start()
                fleet.links[spec.device_id] = link
                agent_broker = f"mqtt://127.0.0.1:{link.port}"
            fleet.start_agent(spec, broker_url=agent_broker, extra=agent_flags)
        await fleet.wait_ready()
        yield fleet
    finally:
        await fleet.stop_children()
        for link in fleet.links.values():
            await link.close()
        fleet._coordinator_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await fleet._coordinator_task
        if own is not None:
            await own.stop()
        engine.dispose()
