"""`specfleet up`: embedded broker, database, coordinator and HTTP API in one process."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from broker.acl import ServiceRole, ServiceUser, generate_passwords
from broker.embedded import EmbeddedBroker
from broker.passwords import hash_credential, new_credential
from coordinator.db.engine import make_engine, make_sessionmaker
from coordinator.db.migrate import upgrade
from coordinator.db.registry import DeviceRegistry
from coordinator.ops.provisioning import BrokerReload, BrokerSync
from coordinator.runtime.service import Coordinator, configured_target
from coordinator.stack_broker import StackMosquitto, mosquitto_binary
from coordinator.web.api.main import create_app
from coordinator.web.control import BrokerRevoke, attach_service
from core.settings import Settings

log = logging.getLogger(__name__)

COORDINATOR_USER = ServiceRole.COORDINATOR.value
VERIFIER_USER = ServiceRole.VERIFIER.value


# Libraries that narrate their internals at INFO; an operator wants our lines only.
NOISY_LOGGERS = ("alembic", "amqtt", "transitions")

# Which broker `up` runs for itself: Mosquitto where installed ("auto"), or the one named.
LocalBrokerChoice = Literal["auto", "mosquitto", "amqtt"]
# Devices provisioned while the stack runs can connect within this many seconds.
PASSWORD_REFRESH_S = 2.0


class StackError(OSError):
    """The stack cannot start here: a port or the home is taken (one line, for the operator)."""


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Refuse, before anything starts, a port that something else listens on."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise StackError(
                f"{what} port {host}:{port} is in use ({exc.strerror}): stop what holds it, "
                f"or choose another with {flag}"
            ) from None


@contextlib.contextmanager
def home_lock(home: Path, role: str) -> Iterator[None]:
    """One stack per home: `up` and `demo` write the same broker files under it, and two would
    lock each other out. Held (an advisory lock) for as long as the stack runs."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "stack.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            raise StackError(
                f"{home} is in use by another specfleet stack ({holder}): stop it, or give this "
                "one its own home with SPECFLEET_HOME"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"specfleet {role}, pid {os.getpid()}".encode())
        yield
    finally:
        os.close(fd)


@dataclass
class QuickstartBroker:
    """The embedded broker and the service credentials minted for this run."""

    broker: EmbeddedBroker
    password_file: Path
    credentials: dict[str, str]  # service username -> plaintext, for this process's clients
    services: list[ServiceUser]

    def refresh_passwords(self, registry: DeviceRegistry) -> None:
        """Rewrite the password file from the registry; the broker reads it on every connect."""
        text = generate_passwords(registry.broker_accounts(), self.services)
        self.password_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.password_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o600)
        tmp.replace(self.password_file)


def broker_revoke(
    settings: Settings, registry: DeviceRegistry, quick: QuickstartBroker | None
) -> BrokerRevoke | None:
    """How a retired device leaves the broker: the embedded one's password file and its live
    connections, or an external Mosquitto's files and reload (when `broker_dir` is set)."""
    if quick is not None:
        embedded = quick

        async def revoke_embedded(device_id: str) -> str:
            await asyncio.to_thread(embedded.refresh_passwords, registry)
            closed = await embedded.broker.disconnect_user(device_id)
            return f"removed from the embedded broker; {closed} connection(s) closed"

        return revoke_embedded
    if settings.broker_dir is None:
        return None
    sync = BrokerSync(
        settings.broker_dir, BrokerReload(settings.broker_pid_file, settings.broker_reload_command)
    )

    def sync_registry() -> str:
        return sync.run(registry.broker_accounts(), [d.id for d in registry.list()])

    async def revoke_external(device_id: str) -> str:
        return await asyncio.to_thread(sync_registry)

    return revoke_external


def prepare_database(settings: Settings) -> Engine:
    """Migrate to head (SQLite files are created on the way) and return an engine."""
    settings.home.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.database_url)
    upgrade(engine)
    return engine


def verifier_credential_file(home: Path) -> Path:
    """Where `up` leaves this run's verifier credential (for `verifier --password-file`)."""
    return home / "broker" / f"{VERIFIER_USER}.credential"


def write_verifier_credential(home: Path, secret: str) -> None:
    path = verifier_credential_file(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(secret + "\n")
    tmp.replace(path)


def quickstart_broker(settings: Settings, port: int, registry: DeviceRegistry) -> QuickstartBroker:
    credentials = {COORDINATOR_USER: new_credential(), VERIFIER_USER: new_credential()}
    password_file = settings.home / "broker" / "passwords"
    write_verifier_credential(settings.home, credentials[VERIFIER_USER])
    broker = EmbeddedBroker(
        port=port,
        password_file=password_file,
        # Anonymous devices are accepted in the quickstart only; they get no offline queue.
        allow_anonymous=True,
        service_users=tuple(credentials),
    )
    services = [
        ServiceUser(name, hash_credential(secret), ServiceRole(name))
        for name, secret in credentials.items()
    ]
    quick = QuickstartBroker(broker, password_file, credentials, services)
    quick.refresh_passwords(registry)
    return quick


@contextlib.asynccontextmanager
async def http_api(
    app: FastAPI,
    host: str,
    port: int,
    *,
    ssl_certfile: Path | None = None,
    ssl_keyfile: Path | None = None,
) -> AsyncIterator[uvicorn.Server]:
    """Serve `app` in this event loop (over TLS with a certificate and its key); uvicorn turns
    Ctrl-C into a clean stop of everything."""
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise ValueError("TLS needs both a certificate file and its key file")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        # The process's own logging stays as it is: uvicorn's default dictConfig would close
        # every handler of the process (absl's closes the stream it writes to).
        log_config=None,
        lifespan="off",
        ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
        ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(), name="http-api")
    while not server.started:
        if task.done():
            task.result()  # re-raise the bind error
            raise RuntimeError("the HTTP API stopped while starting")
        await asyncio.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        if not _interrupted(task):
            await task


def _interrupted(task: asyncio.Task[None]) -> bool:
    """Whether `task` ended in Ctrl-C or SIGTERM (uvicorn re-raises the signal it caught when
    it stops). asyncio raised that out of the loop already, which is how the stack is stopping;
    awaiting the task would raise it again, inside the task being cancelled."""
    return task.done() and not task.cancelled() and isinstance(task.exception(), KeyboardInterrupt)


async def run_up(
    settings: Settings,
    *,
    embedded_port: int | None,
    ready: asyncio.Event | None = None,
    local_broker: LocalBrokerChoice = "auto",
) -> None:
    """Serve until cancelled. `embedded_port` None means: use settings.broker_url as it is;
    otherwise start a broker of our own there (Mosquitto where installed, else amqtt)."""
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if embedded_port is not None:
        check_port_free("127.0.0.1", embedded_port, "the embedded broker's", "--mqtt-port")
    check_port_free(settings.http_host, settings.http_port, "the HTTP API's", "--http-port")
    # The embedded broker's files live in the home; with an external broker, coordinators may
    # share one (scale-out).
    embedded = embedded_port is not None
    with home_lock(settings.home, "up") if embedded else contextlib.nullcontext():
        await _run_up(settings, embedded_port, ready, local_broker)


@dataclass
class OwnBroker:
    """The broker an `up` runs for itself, whichever it is, and how the stack uses it."""

    settings: Settings  # the coordinator's, pointed at this broker with a service account
    device_url: str  # where devices connect (Mosquitto: not the services' listener)
    description: str
    credentials: dict[str, str]  # service username -> plaintext, minted for this run
    revoke: BrokerRevoke
    refresh_forever: Callable[[], Coroutine[Any, Any, None]]
    stop: Callable[[], Coroutine[Any, Any, None]]


async def start_own_broker(
    settings: Settings, port: int, registry: DeviceRegistry, choice: LocalBrokerChoice
) -> OwnBroker:
    binary = None if choice == "amqtt" else mosquitto_binary()
    if choice == "mosquitto" and binary is None:
        raise StackError("--local-broker mosquitto: no mosquitto here (Debian package: mosquitto)")
    if binary is None:
        return await _own_amqtt(settings, port, registry, choice)
    mosquitto = StackMosquitto(binary, settings.home / "broker" / "mosquitto", port)
    await asyncio.to_thread(mosquitto.start, registry)
    write_verifier_credential(settings.home, mosquitto.credentials[VERIFIER_USER])

    async def revoke(device_id: str) -> str:
        await asyncio.to_thread(mosquitto.refresh, registry)
        return "removed from Mosquitto's password file; reloaded, which disconnects it"

    async def refresh_forever() -> None:
        while True:
            await asyncio.sleep(PASSWORD_REFRESH_S)
            await asyncio.to_thread(mosquitto.refresh, registry)

    async def stop() -> None:
        # Inline, not in a thread: this runs while the loop winds down (Ctrl-C, SIGTERM), and
        # stopping Mosquitto takes milliseconds.
        mosquitto.stop()

    return OwnBroker(
        settings.model_copy(
            update={
                "broker_url": mosquitto.service_url,
                "broker_username": COORDINATOR_USER,
                "broker_password": mosquitto.credentials[COORDINATOR_USER],
                "mqtt_protocol": "auto",
            }
        ),
        mosquitto.url,
        f"(Mosquitto, MQTT 5, the production config; services on {mosquitto.service_url}; "
        f"log {mosquitto.log_path})",
        dict(mosquitto.credentials),
        revoke,
        refresh_forever,
        stop,
    )


async def _own_amqtt(
    settings: Settings, port: int, registry: DeviceRegistry, choice: LocalBrokerChoice
) -> OwnBroker:
    quick = quickstart_broker(settings, port, registry)
    await quick.broker.start()
    revoke = broker_revoke(settings, registry, quick)
    assert revoke is not None
    why = "as asked" if choice == "amqtt" else "no mosquitto installed"
    return OwnBroker(
        settings.model_copy(
            update={
                "broker_url": quick.broker.url,
                "broker_username": COORDINATOR_USER,
                "broker_password": quick.credentials[COORDINATOR_USER],
                "mqtt_protocol": "3.1.1",
            }
        ),
        quick.broker.url,
        f"(embedded amqtt, MQTT 3.1.1, {why}: for trials; production runs Mosquitto)",
        dict(quick.credentials),
        revoke,
        lambda: _refresh_forever(quick, registry),
        quick.broker.stop,
    )


async def _run_up(
    settings: Settings,
    embedded_port: int | None,
    ready: asyncio.Event | None,
    local_broker: LocalBrokerChoice,
) -> None:
    engine = prepare_database(settings)
    registry = DeviceRegistry(make_sessionmaker(engine))
    own: OwnBroker | None = None
    try:
        if embedded_port is not None:
            own = await start_own_broker(settings, embedded_port, registry, local_broker)
            settings = own.settings
            print(f"broker       {own.device_url}  {own.description}", flush=True)
        else:
            print(f"broker       {settings.broker_url}  (external)", flush=True)
        database_url = engine.url.render_as_string(hide_password=True)
        print(f"database     {database_url}", flush=True)
        coordinator = Coordinator(settings, engine, target=configured_target(settings))
        app = create_app(settings, engine)
        revoke = own.revoke if own is not None else broker_revoke(settings, registry, None)
        attach_service(app, coordinator, revoke)
        async with http_api(
            app,
            settings.http_host,
            settings.http_port,
            ssl_certfile=settings.http_ssl_certfile,
            ssl_keyfile=settings.http_ssl_keyfile,
        ):
            scheme = "https" if settings.http_ssl_certfile else "http"
            print(
                f"http api     {scheme}://{settings.http_host}:{settings.http_port}/api/v1",
                flush=True,
            )
            if own is not None:
                coordinator.background.append(own.refresh_forever)
            task = asyncio.create_task(coordinator.run(), name="coordinator")
            await coordinator.connected.wait()
            print(f"coordinator  connected as {coordinator.client_id}", flush=True)
            device_url = own.device_url if own is not None else settings.broker_url
            steps = next_steps(settings, database_url, device_url, embedded=own is not None)
            print("\n".join(steps), flush=True)
            if ready is not None:
                ready.set()
            await task
    finally:
        if own is not None:
            await own.stop()
        engine.dispose()


def next_steps(
    settings: Settings, database_url: str, device_url: str, *, embedded: bool
) -> list[str]:
    """The banner's closing lines: the dashboard, and the commands that add an admin, a
    verifier and a device to this stack (run with the same SPECFLEET_HOME)."""
    scheme = "https" if settings.http_ssl_certfile else "http"
    host = "127.0.0.1" if settings.http_host in ("0.0.0.0", "::") else settings.http_host
    broker = settings.broker_url
    db = f" --database-url {database_url}"
    if embedded:
        verifier_auth = (
            f"--username {VERIFIER_USER} --password-file {verifier_credential_file(settings.home)}"
        )
    else:
        verifier_auth = f"--username {VERIFIER_USER} --password-file FILE"
    bundle = settings.home / "bundles" / "pi-1"
    return [
        f"dashboard    {scheme}://{host}:{settings.http_port}/  (log in with an admin's token)",
        "",
        "next, in another shell:",
        f"  an admin     specfleet admin create alice{db}",
        f"  a verifier   specfleet verifier --broker-url {broker} {verifier_auth}{db}",
        f"  a device     specfleet devices provision pi-1 --kind pi "
        f"--device-broker-url {device_url}{db}",
        # The bundle's config names its files relative to the bundle.
        f"               cd {bundle} && specfleet-agent run --config agent.toml",
        "",
    ]


async def _refresh_forever(quick: QuickstartBroker, registry: DeviceRegistry) -> None:
    while True:
        await asyncio.sleep(PASSWORD_REFRESH_S)
        await asyncio.to_thread(quick.refresh_passwords, registry)
