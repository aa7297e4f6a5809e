"""A Mosquitto process of our own on a free loopback port, for benchmarks, fault tests and demos."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

START_TIMEOUT_S = 10.0


class MosquittoError(RuntimeError):
    """Mosquitto is missing, or did not start."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_port(host: str, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                message = f"nothing listens on {host}:{port} after {timeout_s}s"
                raise MosquittoError(message) from None
            time.sleep(0.02)


class PrivateMosquitto:
    """`with PrivateMosquitto(extra_config=...) as broker:` runs `mosquitto -c` until exit.

    The listener line is written here; `extra_config` adds the rest (ACLs, passwords, options).
    `restart()` stops and starts it on the same port, for broker-restart faults.
    """

    def __init__(
        self,
        extra_config: str = "allow_anonymous true\n",
        *,
        tcp_nodelay: bool = True,
        port: int | None = None,
        workdir: Path | None = None,
        binary: str | None = None,
    ) -> None:
        found = binary or shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(found).exists():
            raise MosquittoError("mosquitto is not installed (Debian package: mosquitto)")
        self.binary = found
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="specfleet-mqtt-")
        self.workdir = workdir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.config_path = self.workdir / "mosquitto.conf"
        self.log_path = self.workdir / "mosquitto.log"
        lines = [
            f"listener {self.port} {self.host}",
            f"set_tcp_nodelay {'true' if tcp_nodelay else 'false'}",
            f"persistence_location {self.workdir}/",
            extra_config,
        ]
        self.config_path.write_text("\n".join(lines) + "\n")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [self.binary, "-c", str(self.config_path)], stdout=log, stderr=log
            )
        try:
            wait_for_port(self.host, self.port)
        except MosquittoError:
            self.stop()
            raise MosquittoError(
                f"mosquitto did not start: {self.log_path.read_text()[-2000:]}"
            ) from None

    def stop(self, kill: bool = False) -> None:
        if self._process is None:
            return
        if kill:
            self._process.kill()
        else:
            self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def reload(self) -> None:
        """SIGHUP: Mosquitto re-reads its password and ACL files."""
        if self._process is not None:
            self._process.send_signal(1)

    def __enter__(self) -> PrivateMosquitto:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
