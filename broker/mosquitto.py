"""A Mosquitto process of our own on a free loopback port, for benchmarks, fault tests and demos."""

from __future__ import annotations

import ctypes
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO

START_TIMEOUT_S = 10.0


class MosquittoError(RuntimeError):
    """Mosquitto is missing, or did not start."""


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Linux sends a child its parent-death signal when the *thread* that forked it ends, not the
# process: a broker forked from a worker thread (asyncio.to_thread) would die with that thread.
# Children tied to us are forked from one thread of ours, which lives as long as the process
# (one per process: a forked copy of us has not the thread, so it makes its own).
_forkers: dict[int, ThreadPoolExecutor] = {}


def _die_with(parent: int, sig: signal.Signals) -> Callable[[], None] | None:
    """A preexec_fn (Linux) that has the kernel send the child `sig` once `parent` is gone,
    SIGKILL included, which no handler of ours would see."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm


def popen_tied(
    argv: list[str],
    *,
    log: IO[bytes],
    sig: signal.Signals = signal.SIGTERM,
    env: dict[str, str] | None = None,
    start_new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Start a child, its output to `log`, that is sent `sig` when this process ends, however it
    ends (on Linux; elsewhere a plain child): a broker a SIGKILLed `specfleet up` started must not
    keep its ports. In a session of its own, a child sees no Ctrl-C meant for us, and still ends
    with us."""
    tie = _die_with(os.getpid(), sig)

    def fork() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=start_new_session,
            preexec_fn=tie,
        )

    forker = _forkers.get(os.getpid())
    if forker is None:
        forker = _forkers[os.getpid()] = ThreadPoolExecutor(1, "tied-child-forker")
    return forker.submit(fork).result()


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
        if not any(line.split()[:1] == ["user"] for line in extra_config.splitlines()):
            # Started as root, Mosquitto would switch to its own user, and the kernel forgets a
            # parent-death signal on a change of user: it would outlive a SIGKILLed owner.
            lines.append(f"user {getpass.getuser()}")
        self.config_path.write_text("\n".join(lines) + "\n")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker's process id while it runs."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = popen_tied([self.binary, "-c", str(self.config_path)], log=log)
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
