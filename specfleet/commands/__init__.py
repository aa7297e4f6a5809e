"""The `specfleet` commands of the control plane, one module a group: db, devices,
broker, up, admin and replay (common holds what they share); `flash` and `demo`
are modules of their own, registered here."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core.cli_help import add_module_command
from specfleet.commands import admin, broker, db, devices, replay, up

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
    db.register(subparsers)
    devices.register(subparsers)
    _register_flash(subparsers)
    broker.register(subparsers)
    up.register(subparsers)
    admin.register(subparsers)
    replay.register(subparsers)
    _register_demo(subparsers)


def _register_flash(subparsers: Subparsers) -> None:
    add_module_command(
        subparsers,
        "flash",
        "coordinator.ops.flash",
        "install or upgrade the agent on a device over SSH, or into a directory",
    )


def _register_demo(subparsers: Subparsers) -> None:
    add_module_command(
        subparsers,
        "demo",
        "localfleet.demo",
        "run a whole fleet on this machine and answer the benchmark prompts",
    )
