"""The Mosquitto `specfleet up` starts for itself where the binary exists: the config that
`broker write-config` writes for production (ACLs, passwords, TCP_NODELAY, MQTT 5), on loopback,
with its files under <home>/broker/mosquitto and kept equal to the registry while it runs.

Devices connect on one listener; the coordinator and verifiers on a second, service listener,
where replicas share an account and choose their own client ids (broker.acl's service
listener). The pure-Python amqtt broker remains the fallback where no Mosquitto is installed.
"""

from __future__ import annotations

import getpass
import logging
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from broker import acl
from broker.acl import ServiceRole, ServiceUser
from broker.mosquitto import MosquittoError, free_port, popen_tied, wait_for_port
from broker.passwords import hash_credential, new_credential
from coordinator.db.registry import DeviceRegistry

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 5.0
SERVICES = (ServiceRole.COORDINATOR, ServiceRole.VERIFIER)


def mosquitto_binary() -> str | None:
    """The installed Mosquitto, if any (Debian puts it in /usr/sbin, often off a user's PATH)."""
    found = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/bin")
    return found


@dataclass
class StackMosquitto:
    """A Mosquitto child process with the production config, for one `up` run."""

    binary: str
    directory: Path
    port: int  # devices' listener
    service_port: int = field(default_factory=free_port)
    credentials: dict[str, str] = field(default_factory=dict)  # service user -> plaintext
    _services: list[ServiceUser] = field(default_factory=list)
    _process: subprocess.Popen[bytes] | None = None
    _written: tuple[str, str] = ("", "")  # (acl, passwords) as last written

    @property
    def url(self) -> str:
        return f"mqtt://{HOST}:{self.port}"

    @property
    def service_url(self) -> str:
        return f"mqtt://{HOST}:{self.service_port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "mosquitto.log"

    def start(self, registry: DeviceRegistry) -> None:
        """Mint this run's service credentials, write every file, start and wait for both ports."""
        self.credentials = {role.value: new_credential() for role in SERVICES}
        self._services = [
            ServiceUser(role.value, hash_credential(self.credentials[role.value]), role)
            for role in SERVICES
        ]
        config = acl.render_mosquitto_conf(
            self.directory,
            listeners=[f"{self.port} {HOST}"],
            run_as_user=getpass.getuser(),  # started as root, it would switch users otherwise
            service_listener=f"{self.service_port} {HOST}",
        )
        devices = registry.broker_accounts()
        self._written = self._texts(devices)
        acl.write_broker_files(
            self.directory,
            config_text=config,
            acl_text=self._written[0],
            passwords_text=self._written[1],
            service_passwords_text=acl.generate_passwords([], self._services),
        )
        with self.log_path.open("ab") as out:
            # Tied to this process: a SIGKILLed `up` (no handler of ours runs) must not leave
            # its broker holding the ports.
            self._process = popen_tied(
                [self.binary, "-c", str(self.directory / acl.CONFIG_FILE)], log=out
            )
        try:
            for port in (self.port, self.service_port):
                wait_for_port(HOST, port)
        except MosquittoError:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-1000:]
            raise MosquittoError(f"mosquitto did not start: {tail}") from None

    def _texts(self, devices: list[acl.DeviceAccount]) -> tuple[str, str]:
        return (
            acl.generate_acl(devices, self._services),
            acl.generate_passwords(devices, self._services),
        )

    def refresh(self, registry: DeviceRegistry) -> bool:
        """Rewrite acl and passwords from the registry; reload (SIGHUP) only if they changed.
        Mosquitto drops the connections of accounts that are gone when it reloads."""
        texts = self._texts(registry.broker_accounts())
        if texts == self._written:
            return False
        for name, text in zip((acl.ACL_FILE, acl.PASSWORD_FILE), texts, strict=True):
            path = self.directory / name
            tmp = path.with_suffix(".tmp")
            tmp.touch(mode=0o600)
            tmp.write_text(text)
            tmp.replace(path)
        self._written = texts
        if self._process is not None:
            self._process.send_signal(signal.SIGHUP)
        return True

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("mosquitto did not stop in %gs; killing it", STOP_TIMEOUT_S)
            self._process.kill()
            self._process.wait()
        self._process = None
