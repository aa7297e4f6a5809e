"""Helpers of the deployment tests: release variants of a real draft and a plain file server."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from broker.mosquitto import PrivateMosquitto
from coordinator.db.registry import DeviceRegistry
from inference.artifacts import load_manifest, sha256_file, write_manifest


def copy_release(source: Path, dest: Path, *, note: str) -> Path:
    """A second release of the same model: the same files under a manifest that says `note`."""
    shutil.copytree(source, dest)
    manifest = load_manifest(dest)
    write_manifest(dest, dataclasses.replace(manifest, extra={**manifest.extra, "release": note}))
    return dest


def broken_release(source: Path, dest: Path) -> Path:
    """A release whose manifest is honest about a model file that is not a model at all."""
    shutil.copytree(source, dest)
    manifest = load_manifest(dest)
    model = dest / manifest.file
    model.write_bytes(b"not an onnx graph " * 4096)
    write_manifest(
        dest,
        dataclasses.replace(manifest, sha256=sha256_file(model), size_bytes=model.stat().st_size),
    )
    return dest


# --- HTTP ----------------------------------------------------------------------------------------


class FileServer:
    """A stdlib HTTP server on loopback serving one directory (handled in its own thread)."""

    def __init__(self, root: Path) -> None:
        handler = _handler_for(root)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        # The stdlib server blocks in serve_forever; a thread keeps it beside the test.
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler_for(root: Path) -> type[http.server.SimpleHTTPRequestHandler]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


# --- the CLI -------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    """`specfleet ARGV` through the coordinator's and the models' command modules only."""
    import argparse

    from core.errors import CommandError
    from specfleet import commands as coordinator_commands
    from specfleet.commands import models as model_commands

    parser = argparse.ArgumentParser(prog="specfleet")
    subparsers = parser.add_subparsers(dest="command", required=True)
    coordinator_commands.register(subparsers)
    model_commands.register(subparsers)
    args = parser.parse_args(argv)
    try:
        result: int | None = args.func(args)
    except CommandError as exc:
        print(f"specfleet {args.command}: {exc}")
        return 2
    return result or 0


# --- topic isolation on a real broker ------------------------------------------------------------


async def _receive_until(client: object, marker: bytes, timeout_s: float = 5.0) -> list[bytes]:
    from broker.client import BusClient

    assert isinstance(client, BusClient)
    seen: list[bytes] = []

    async def collect() -> None:
        async for incoming in client.messages():
            if incoming.retain:  # a running agent's retained status is not what we sent
                continue
            seen.append(incoming.payload)
            if incoming.payload == marker:
                return

    await asyncio.wait_for(collect(), timeout_s)
    return seen


async def isolation(
    url: str, device_id: str, credential: str, observer: tuple[str, str], other: str
) -> dict[str, list[bytes]]:
    """What crosses the broker between `device_id` and another device's topics.

    An observer with the coordinator's rights writes to the other device's command topic, then to
    the device's own; and subscribes to both status topics while the device writes to the other's
    status, then its own. One connection's messages arrive in order, so anything that crossed
    arrives before the own marker.
    """
    from broker.client import BrokerAddress, ConnectOptions, connect
    from broker.topics import DeviceChannel, device_topic

    address = BrokerAddress.from_url(url)
    device_options = ConnectOptions(f"iso-{device_id}", device_id, credential)
    observer_options = ConnectOptions(f"iso-observer-{device_id}", *observer)
    async with (
        connect(address, device_options) as device,
        connect(address, observer_options) as watcher,
    ):
        await device.subscribe(device_topic(other, DeviceChannel.COMMAND))
        await device.subscribe(device_topic(device_id, DeviceChannel.COMMAND))
        await watcher.subscribe(device_topic(other, DeviceChannel.STATUS))
        await watcher.subscribe(device_topic(device_id, DeviceChannel.STATUS))
        await watcher.publish(device_topic(other, DeviceChannel.COMMAND), b"foreign command")
        await watcher.publish(device_topic(device_id, DeviceChannel.COMMAND), b"own command")
        read = await _receive_until(device, b"own command")
        await device.publish(device_topic(other, DeviceChannel.STATUS), b"forged status")
        await device.publish(device_topic(device_id, DeviceChannel.STATUS), b"own status")
        written = await _receive_until(watcher, b"own status")
    return {"read": read, "written": written}


# --- a lab: registry, broker and bundles for flashing ---------------------------------------------

# The interpreter behind the project's virtual environment: the "device's" Python.
DEVICE_PYTHON = str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())
ISOLATED = {"read": [b"own command"], "written": [b"own status"]}
ONLINE_TIMEOUT = "60"


@dataclass
class Lab:
    database_url: str
    registry: DeviceRegistry
    broker: PrivateMosquitto
    coordinator: tuple[str, str]
    broker_dir: Path
    bundles: Path
    roots: list[Path]

    def provision(self, device_id: str) -> Path:
        bundle = self.bundles / device_id
        code = run_cli(
            [
                "devices", "provision", device_id, "--kind", "pi",
                "--device-broker-url", self.broker.url, "--out", str(bundle),
                "--broker-dir", str(self.broker_dir),
                "--broker-pid-file", str(self.broker_dir / "mosquitto.pid"),
                "--database-url", self.database_url,
            ]
        )  # fmt: skip
        assert code == 0
        return bundle


def flash(*args: str) -> int:
    """`specfleet flash` with the device's Python; later arguments override these."""
    return run_cli(["flash", "--python", DEVICE_PYTHON, "--online-timeout", ONLINE_TIMEOUT, *args])


def isolated(lab: Lab, device_id: str, credential: str) -> bool:
    seen = asyncio.run(isolation(lab.broker.url, device_id, credential, lab.coordinator, "pi-x"))
    return seen == ISOLATED


def releases(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "releases").iterdir()) if root.exists() else []


def agent_running(root: Path) -> bool:
    agentctl = root / "current" / "bin" / "agentctl"
    status = subprocess.run([str(agentctl), "status"], capture_output=True, check=False)
    return status.returncode == 0
