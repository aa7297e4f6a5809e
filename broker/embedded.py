"""The embedded broker for the quickstart: amqtt, in-process, on loopback.

Its limits, measured with paho clients that set TCP_NODELAY: MQTT 3.1.1 only (clients fall back
from MQTT 5 by themselves) and no shared subscriptions; it delivers at the subscriber's QoS; it
keeps QoS 1 messages for an offline client only when that client authenticated, which is why the
quickstart gives every client a password too; and it moves about 2.7k messages/s with a QoS 1
round trip near 0.8 ms. Production runs Mosquitto with the config in broker/config/.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from amqtt.adapters import ReaderAdapter, WriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action, ListenerConfig
from amqtt.errors import MQTTError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session
from amqtt.utils import gen_client_id

from broker.passwords import verify_credential
from broker.topics import DOWNLINK_CHANNELS, UPLINK_CHANNELS, device_topic

log = logging.getLogger(__name__)


class _ShutdownIsNotAnError(logging.Filter):
    """amqtt logs its broadcast loop's cancellation, which is how every stop ends it, as an
    error with a traceback; an operator who pressed Ctrl-C should see nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


logging.getLogger("amqtt.broker").addFilter(_ShutdownIsNotAnError())

# amqtt and its state machine library narrate every connection and state change at INFO; whoever
# runs the broker wants their warnings only. A level set on them explicitly is left alone.
LIBRARY_LOGGERS = ("amqtt", "transitions")

DEFAULT_PORT = 1884  # 1883 is usually taken by a system Mosquitto
# Where anonymous clients' ids live; '~' is no username character, so no account owns it.
ANONYMOUS_NAMESPACE = "~anonymous"


def bound_client_id(username: str | None, client_id: str) -> str:
    """The id a client's session is kept under: inside its username's namespace, so that one
    credential can displace or resume only its own connections (usernames hold no '/')."""
    return f"{username or ANONYMOUS_NAMESPACE}/{client_id}"


def read_password_file(path: Path) -> dict[str, str]:
    """`user:hash` lines, as Mosquitto's password file holds them."""
    users: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            username, _, hashed = line.partition(":")
            users[username] = hashed
    return users


class CredentialAuthPlugin(BaseAuthPlugin):
    """Checks username and password against the same `$7$` hashes Mosquitto reads."""

    @dataclass
    class Config:
        password_file: str = ""
        allow_anonymous: bool = False

    async def authenticate(self, *, session: Session) -> bool | None:
        config: CredentialAuthPlugin.Config = self.context.config  # type: ignore[assignment]
        if not session.username:
            if config.allow_anonymous:
                return True
            log.warning("embedded broker: refused an anonymous client %s", session.client_id)
            return False
        users = read_password_file(Path(config.password_file)) if config.password_file else {}
        hashed = users.get(session.username)
        if hashed is not None and verify_credential(session.password or "", hashed):
            return True
        log.warning("embedded broker: refused %s: bad username or password", session.username)
        return False


class DeviceTopicPlugin(BaseTopicPlugin):
    """The per-device ACL of broker/acl.py, for the embedded broker.

    Service users (coordinator, verifiers) and anonymous quickstart clients may use any topic;
    a device may publish only on its own uplink topics and read only its own downlink topics.
    """

    @dataclass
    class Config:
        service_users: list[str] = field(default_factory=list)

    async def topic_filtering(
        self,
        *,
        session: Session | None = None,
        topic: str | None = None,
        action: Action | None = None,
    ) -> bool | None:
        config: DeviceTopicPlugin.Config = self.context.config  # type: ignore[assignment]
        if session is None or topic is None:
            return False
        username = session.username
        if not username or username in config.service_users:
            return True
        try:
            if action == Action.PUBLISH:
                allowed = {device_topic(username, c) for c in UPLINK_CHANNELS}
            else:
                allowed = {device_topic(username, c) for c in DOWNLINK_CHANNELS}
        except ValueError:
            return False
        if topic not in allowed:
            log.warning("embedded broker: %s may not %s %s", username, action, topic)
            return False
        return True


_AUTHENTICATED = "_specfleet_authenticated"


class _WalkedWhileChanging(dict[str, list[tuple[Session, int]]]):
    """amqtt's subscription table, walked over a snapshot: amqtt awaits inside its walks (a
    broadcast awaits the topic check of each subscriber, a resumed session each retained
    message), so a client that subscribed meanwhile changed the table under the walk, and the
    broadcast died with 'dictionary changed size during iteration', its message lost."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(super().__iter__()))

    def items(self) -> Any:  # a list, not a live view
        return list(super().items())


class BindingBroker(Broker):
    """amqtt with credentials checked before any session is touched, and client ids bound to
    usernames (Mosquitto does the same with `use_username_as_clientid`).

    amqtt itself deletes (clean session) or resumes the session of a CONNECT's client id before
    it authenticates, and takes the id over even when authentication fails: any client could
    cut any other off the bus by reusing its id. Here a refused client never reaches the session
    table, and an accepted one gets the id `bound_client_id(username, id)`. Several processes
    may still share one account (verifiers of the quickstart), each under its own id.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        table = self._subscriptions  # type: ignore[has-type]  # amqtt's, typed there
        self._subscriptions = _WalkedWhileChanging(table)

    async def _initialize_client_session(
        self, reader: ReaderAdapter, writer: WriterAdapter, remote_address: str, remote_port: int
    ) -> tuple[BrokerProtocolHandler, Session]:
        try:
            handler, incoming = await BrokerProtocolHandler.init_from_connect(
                reader, writer, self.plugins_manager
            )
        except MQTTError:
            await writer.close()
            raise
        if not await super()._authenticate(incoming, ListenerConfig()):
            handler.attach(incoming, reader, writer)
            await handler.mqtt_connack_authorize(False)
            await writer.close()
            who = incoming.username or "an anonymous client"
            raise MQTTError(f"refused {who} from {remote_address}:{remote_port}")
        incoming.client_id = bound_client_id(
            incoming.username, incoming.client_id or gen_client_id()
        )
        session = await self._resume_or_start(incoming)
        # Marked, so that the broker's own check that follows does not hash the password again.
        setattr(session, _AUTHENTICATED, True)
        return handler, session

    async def _resume_or_start(self, incoming: Session) -> Session:
        """amqtt's own choice once the id is bound: a clean start, or the stored session."""
        known = self._sessions.get(incoming.client_id)
        if incoming.clean_session or known is None:
            await self._delete_session(incoming.client_id)
            session = incoming
            session.parent = 0
        else:
            session = known[0]
            # The new connection brings its own Will, keepalive and credentials.
            for name in ("will_flag", "will_message", "will_topic", "will_qos", "keep_alive"):
                setattr(session, name, getattr(incoming, name))
            session.username, session.password = incoming.username, incoming.password
            session.parent = 1
        delay = self.config.get("timeout-disconnect-delay", 0)
        if session.keep_alive > 0 and isinstance(delay, int):
            session.keep_alive += delay
        return session

    async def _authenticate(self, session: Session, listener: ListenerConfig) -> bool:
        if getattr(session, _AUTHENTICATED, False):
            setattr(session, _AUTHENTICATED, False)
            return True
        authenticated: bool = await super()._authenticate(session, listener)
        return authenticated

    async def disconnect_user(self, username: str) -> int:
        """Close every connection of `username` now (its Will is published); returns how many.
        Remove the account from the password file first, or the client connects again."""
        handlers = [
            handler
            for session, handler in list(self._sessions.values())
            if session.username == username and session.transitions.is_connected()
        ]
        for handler in handlers:
            await handler.handle_connection_closed()
        return len(handlers)


class EmbeddedBroker:
    """`async with EmbeddedBroker(...) as broker:` serves MQTT on `broker.url` until exit."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        password_file: Path | None = None,
        allow_anonymous: bool = False,
        service_users: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.port = port
        config: dict[str, Any] = {
            "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
            "plugins": {
                f"{__name__}.CredentialAuthPlugin": {
                    "password_file": str(password_file) if password_file else "",
                    "allow_anonymous": allow_anonymous,
                },
                f"{__name__}.DeviceTopicPlugin": {"service_users": list(service_users)},
            },
        }
        for name in LIBRARY_LOGGERS:  # before amqtt is made: it narrates its plugins' loading
            library = logging.getLogger(name)
            if library.level == logging.NOTSET:
                library.setLevel(logging.WARNING)
        self._broker = BindingBroker(config)

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    async def start(self) -> None:
        await self._broker.start()

    async def disconnect_user(self, username: str) -> int:
        """Close `username`'s connections (see BindingBroker.disconnect_user)."""
        return await self._broker.disconnect_user(username)

    async def stop(self) -> None:
        await self._broker.shutdown()
        # amqtt closes client sessions in background tasks; let them finish before the loop ends.
        await asyncio.sleep(0)

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
