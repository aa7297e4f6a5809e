"""The emulator's control channel: one command per line over loopback TCP, one JSON reply each.

Commands: `profile NAME`, `cut SECONDS`, `stall SECONDS`, `restore`, `status`. SECONDS may be
`forever`. Try it with `printf 'cut 2\n' | nc 127.0.0.1 PORT`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from netem.emulator import NetworkEmulator

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 1024


class ControlError(Exception):
    """A command the channel does not understand; its text goes back in the reply."""


def _seconds(text: str) -> float | None:
    if text == "forever":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ControlError(f"not a number of seconds: {text!r}") from None
    if not seconds >= 0:
        raise ControlError("seconds must be >= 0")
    return seconds


def status(emulator: NetworkEmulator) -> dict[str, Any]:
    return {
        "profile": emulator.profile.name,
        "cut": emulator.is_cut,
        "stalled": emulator.is_stalled,
        "connections": emulator.connections,
        "bytes_up": emulator.bytes_carried("up"),
        "bytes_down": emulator.bytes_carried("down"),
    }


def apply_command(emulator: NetworkEmulator, line: str) -> dict[str, Any]:
    """Run one command line on the emulator; returns its status afterwards."""
    words = line.split()
    if not words:
        raise ControlError("empty command")
    verb, args = words[0], words[1:]
    expected = {"profile": 1, "cut": 1, "stall": 1, "restore": 0, "status": 0}
    if verb not in expected:
        raise ControlError(f"unknown command {verb!r}; known: {', '.join(expected)}")
    if len(args) != expected[verb]:
        raise ControlError(f"{verb} takes {expected[verb]} argument(s)")
    if verb == "profile":
        try:
            emulator.set_profile(args[0])
        except ValueError as exc:
            raise ControlError(str(exc)) from None
    elif verb == "cut":
        emulator.cut(_seconds(args[0]))
    elif verb == "stall":
        emulator.stall(_seconds(args[0]))
    elif verb == "restore":
        emulator.restore()
    return status(emulator)


class ControlServer:
    """Serves `apply_command` on a loopback port (0 takes a free one)."""

    def __init__(self, emulator: NetworkEmulator, port: int = 0, host: str = "127.0.0.1") -> None:
        self.emulator = emulator
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._on_client, self.host, self.port, limit=MAX_LINE_BYTES
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    reply: dict[str, Any] = {
                        "ok": True,
                        **apply_command(self.emulator, line.decode(errors="replace")),
                    }
                except ControlError as exc:
                    reply = {"ok": False, "error": str(exc)}
                log.info("netem control: %s -> %s", line.decode(errors="replace").strip(), reply)
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError) as exc:  # ValueError: a line over the limit
            log.warning("netem control connection: %s", exc)
        finally:
            writer.close()


async def send_command(host: str, port: int, line: str) -> dict[str, Any]:
    """One command to a running emulator's control channel; its JSON reply."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(line.strip().encode() + b"\n")
        await writer.drain()
        reply: dict[str, Any] = json.loads(await reader.readline())
        return reply
    finally:
        writer.close()
