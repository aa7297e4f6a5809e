"""Model rollouts in waves: each device's state in deployment_devices, every step in the event log.

A rollout sends one `deploy_model` command per device, a wave at a time, and waits for each
device's acknowledgement. After every wave it compares the share of failed devices among those
tried so far with the abort threshold: at or above it, the rollout stops and the devices of later
waves are never asked. A device that refused a release or rolled back still serves its previous
model; its state says `rolled_back`. One that did not answer in time is `failed`.

An operator aborts a rollout by marking its row `cancelled` (the API's abort, the dashboard's
button): whoever runs the rollout reads the state before each wave and stops there. The wave in
flight finishes, since its commands are already out; the devices of later waves stay `pending`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from broker.model_release import DeployModelArgs
from coordinator.db.events import append_event
from coordinator.db.models import (
    Deployment,
    DeploymentDevice,
    DeploymentState,
    Device,
    DeviceDeploymentState,
    DeviceStatus,
    Model,
    ModelRole,
    utcnow,
)
from coordinator.db.registry import has_tag
from coordinator.ops.releases import StoredRelease

log = logging.getLogger(__name__)

DEFAULT_WAVE_PERCENT = 25.0
DEFAULT_ABORT_AT_PERCENT = 20.0
# Downloading tens of megabytes and a smoke draft on a Pi over a slow link takes minutes.
DEFAULT_DEVICE_TIMEOUT_S = 600.0


class RolloutEvent(str, Enum):
    CREATED = "deployment.created"
    WAVE_STARTED = "deployment.wave_started"
    DEVICE_INSTALLED = "deployment.device_installed"
    DEVICE_ROLLED_BACK = "deployment.device_rolled_back"
    DEVICE_FAILED = "deployment.device_failed"
    ABORT_REQUESTED = "deployment.abort_requested"
    ABORTED = "deployment.aborted"
    DONE = "deployment.done"


DEVICE_EVENTS = {
    DeviceDeploymentState.INSTALLED: RolloutEvent.DEVICE_INSTALLED,
    DeviceDeploymentState.ROLLED_BACK: RolloutEvent.DEVICE_ROLLED_BACK,
    DeviceDeploymentState.FAILED: RolloutEvent.DEVICE_FAILED,
}


# A rollout in one of these states may still be aborted.
ABORTABLE = frozenset({DeploymentState.PENDING, DeploymentState.ROLLING, DeploymentState.PAUSED})


class RolloutError(Exception):
    """No devices to roll out to, or arguments that make no rollout."""


class AbortRefused(RolloutError):
    """The rollout has already ended (done, failed or cancelled)."""


def plan_waves(device_ids: Sequence[str], wave_percent: float) -> list[list[str]]:
    """Sorted devices cut into waves of ceil(wave_percent% of all) devices each."""
    if not 0 < wave_percent <= 100:
        raise RolloutError(f"--wave {wave_percent}: use a percentage in (0, 100]")
    ordered = sorted(set(device_ids))
    size = max(1, math.ceil(len(ordered) * wave_percent / 100 - 1e-9))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def should_abort(failed: int, attempted: int, abort_at_percent: float) -> bool:
    """Whether the failure rate so far has reached the threshold (never on no attempts)."""
    return attempted > 0 and 100.0 * failed / attempted >= abort_at_percent


def device_state_from_ack(ack: m.CommandAck) -> tuple[DeviceDeploymentState, str]:
    """What an acknowledgement says: installed, back on the old model, or neither."""
    result = ack.result
    if ack.ok:
        return DeviceDeploymentState.INSTALLED, str(result.get("state", "installed"))
    if result.get("rolled_back") is True:
        return DeviceDeploymentState.ROLLED_BACK, ack.error or "refused"
    return DeviceDeploymentState.FAILED, ack.error or "failed"


@dataclass(frozen=True)
class DeviceOutcome:
    device_id: str
    wave: int
    state: DeviceDeploymentState
    detail: str


@dataclass(frozen=True)
class RolloutSummary:
    deployment_id: int
    state: DeploymentState
    waves: int
    waves_run: int
    outcomes: tuple[DeviceOutcome, ...]

    def count(self, state: DeviceDeploymentState) -> int:
        return sum(1 for outcome in self.outcomes if outcome.state is state)


class Deployments:
    """The deployments tables; synchronous and short per call (wrap in `asyncio.to_thread`)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def resolve_targets(self, targets: Sequence[str]) -> builtins.list[str]:
        """Each target is a device id or, failing that, a tag; retired devices are skipped."""
        found: set[str] = set()
        with self._sessions() as session:
            dialect = session.get_bind().dialect.name
            for target in targets:
                device = session.get(Device, target)
                if device is not None:
                    if device.status is DeviceStatus.RETIRED:
                        raise RolloutError(f"device {target!r} is retired")
                    found.add(device.id)
                    continue
                tagged = session.scalars(
                    sa.select(Device.id).where(
                        has_tag(target, dialect), Device.status != DeviceStatus.RETIRED
                    )
                ).all()
                if not tagged:
                    raise RolloutError(f"{target!r} is neither a device nor a tag of any device")
                found.update(tagged)
        return sorted(found)

    def register_model(self, stored: StoredRelease, location: str) -> int:
        """The models row of this build, created or updated to it; returns its id."""
        manifest = stored.manifest
        with self._sessions.begin() as session:
            model = session.scalar(sa.select(Model).where(Model.name == manifest.name))
            if model is None:
                model = Model(name=manifest.name, created_at=utcnow())
                session.add(model)
            model.role = ModelRole(manifest.role)
            model.format = manifest.format
            model.sha256 = manifest.sha256
            model.size_bytes = manifest.size_bytes
            model.tokenizer_sha256 = manifest.tokenizer_sha256
            model.location = location[:1024]
            session.flush()
            return model.id

    def create(
        self,
        *,
        model_id: int,
        artifact_sha256: str,
        targets: Sequence[str],
        waves: Sequence[Sequence[str]],
        wave_percent: float,
        abort_at_percent: float,
        actor: str,
    ) -> int:
        with self._sessions.begin() as session:
            deployment = Deployment(
                model_id=model_id,
                selector={"to": list(targets)},
                wave=0,
                state=DeploymentState.ROLLING,
                actor=actor[:64],
                artifact_sha256=artifact_sha256,
                wave_percent=wave_percent,
                abort_at_percent=abort_at_percent,
            )
            session.add(deployment)
            session.flush()
            for wave, device_ids in enumerate(waves):
                for device_id in device_ids:
                    session.add(
                        DeploymentDevice(
                            deployment_id=deployment.id,
                            device_id=device_id,
                            wave=wave,
                            state=DeviceDeploymentState.PENDING,
                        )
                    )
            append_event(
                session,
                RolloutEvent.CREATED,
                actor=actor,
                detail={
                    "deployment_id": deployment.id,
                    "model_id": model_id,
                    "artifact_sha256": artifact_sha256,
                    "to": list(targets),
                    "waves": [list(w) for w in waves],
                    "wave_percent": wave_percent,
                    "abort_at_percent": abort_at_percent,
                },
            )
            return deployment.id

    def start_wave(self, deployment_id: int, wave: int, device_ids: Sequence[str]) -> None:
        with self._sessions.begin() as session:
            deployment = session.get(Deployment, deployment_id, with_for_update=True)
            assert deployment is not None
            deployment.wave = wave
            for row in session.scalars(
                sa.select(DeploymentDevice).where(
                    DeploymentDevice.deployment_id == deployment_id,
                    DeploymentDevice.device_id.in_(device_ids),
                )
            ):
                row.state = DeviceDeploymentState.SENT
                row.updated_at = utcnow()
            append_event(
                session,
                RolloutEvent.WAVE_STARTED,
                detail={"deployment_id": deployment_id, "wave": wave, "devices": list(device_ids)},
            )

    def record_device(
        self,
        deployment_id: int,
        device_id: str,
        state: DeviceDeploymentState,
        detail: str,
        *,
        model_name: str,
        result: dict[str, Any] | None = None,
    ) -> None:
        """A device's outcome, its event, and on success its installed models, in one commit."""
        with self._sessions.begin() as session:
            row = session.get(DeploymentDevice, (deployment_id, device_id), with_for_update=True)
            assert row is not None
            row.state = state
            row.detail = detail[:1024]
            row.updated_at = utcnow()
            if state is DeviceDeploymentState.INSTALLED:
                device = session.get(Device, device_id, with_for_update=True)
                if device is not None:
                    device.installed_models = sorted({*device.installed_models, model_name})
            append_event(
                session,
                DEVICE_EVENTS[state],
                device_id=device_id,
                detail={"deployment_id": deployment_id, "detail": detail, **(result or {})},
            )

    def finish(
        self, deployment_id: int, state: DeploymentState, detail: dict[str, Any]
    ) -> DeploymentState:
        """The rollout's end, returned as recorded: an abort that came in meanwhile wins."""
        with self._sessions.begin() as session:
            deployment = session.get(Deployment, deployment_id, with_for_update=True)
            assert deployment is not None
            if deployment.state is not DeploymentState.CANCELLED:
                deployment.state = state
            kind = (
                RolloutEvent.DONE
                if deployment.state is DeploymentState.DONE
                else RolloutEvent.ABORTED
            )
            append_event(
                session,
                kind,
                detail={"deployment_id": deployment_id, "state": deployment.state.value, **detail},
            )
            return deployment.state

    def request_abort(self, deployment_id: int, *, actor: str, reason: str) -> Deployment:
        """Mark a running rollout cancelled; its runner stops before the next wave."""
        with self._sessions.begin() as session:
            deployment = session.get(Deployment, deployment_id, with_for_update=True)
            if deployment is None:
                raise LookupError(f"no deployment {deployment_id}")
            if deployment.state not in ABORTABLE:
                raise AbortRefused(
                    f"deployment {deployment_id} is {deployment.state.value}: nothing to abort"
                )
            deployment.state = DeploymentState.CANCELLED
            append_event(
                session,
                RolloutEvent.ABORT_REQUESTED,
                actor=actor,
                detail={"deployment_id": deployment_id, "wave": deployment.wave, "reason": reason},
            )
            return deployment

    def abort_requested(self, deployment_id: int) -> bool:
        with self._sessions() as session:
            state = session.scalar(
                sa.select(Deployment.state).where(Deployment.id == deployment_id)
            )
            return state is DeploymentState.CANCELLED

    def get(self, deployment_id: int) -> tuple[Deployment, builtins.list[DeploymentDevice]]:
        with self._sessions() as session:
            deployment = session.get(Deployment, deployment_id)
            if deployment is None:
                raise LookupError(f"no deployment {deployment_id}")
            rows = session.scalars(
                sa.select(DeploymentDevice)
                .where(DeploymentDevice.deployment_id == deployment_id)
                .order_by(DeploymentDevice.wave, DeploymentDevice.device_id)
            ).all()
            return deployment, builtins.list(rows)


SendCommand = Callable[[str, m.CommandName, dict[str, Any], float], Awaitable[m.CommandAck]]


class AckWaiter:
    """Sends commands and matches the acknowledgements coming back on `dev/+/ack`.

    `on_ack` is fed every acknowledgement seen (by the caller's receive loop); `send` publishes a
    command and waits for its acknowledgement or raises TimeoutError.
    """

    def __init__(self, publish: Callable[[str, bytes], Awaitable[None]]) -> None:
        self._publish = publish
        self._pending: dict[str, asyncio.Future[m.CommandAck]] = {}

    def on_ack(self, ack: m.CommandAck) -> None:
        future = self._pending.get(ack.command_id)
        if future is not None and not future.done():
            future.set_result(ack)

    async def send(
        self, device_id: str, name: m.CommandName, args: dict[str, Any], timeout_s: float
    ) -> m.CommandAck:
        from broker.topics import DeviceChannel, device_topic

        command = m.Command(
            command_id=f"{name.value}-{secrets.token_hex(8)}",
            name=name,
            args=args,
            issued_at=time.time(),
        )
        future: asyncio.Future[m.CommandAck] = asyncio.get_running_loop().create_future()
        self._pending[command.command_id] = future
        try:
            await self._publish(device_topic(device_id, DeviceChannel.COMMAND), m.encode(command))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(command.command_id, None)


async def run_rollout(
    deployments: Deployments,
    deployment_id: int,
    waves: Sequence[Sequence[str]],
    args: DeployModelArgs,
    send: SendCommand,
    *,
    abort_at_percent: float,
    device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S,
    on_outcome: Callable[[DeviceOutcome], None] | None = None,
    download_token: Callable[[str], str] | None = None,
) -> RolloutSummary:
    """Roll `args` out wave by wave; stop once the failure rate reaches `abort_at_percent`.

    `download_token` mints each device's grant to fetch the artifact as its command is sent, so
    that a grant outlives its device's attempt by little (see coordinator.releases).
    """
    outcomes: list[DeviceOutcome] = []
    waves_run = 0

    async def one(device_id: str, wave: int) -> DeviceOutcome:
        result: dict[str, Any] = {}
        command_args = args.to_args()
        if download_token is not None:
            command_args["download_token"] = download_token(device_id)
        try:
            ack = await send(device_id, m.CommandName.DEPLOY_MODEL, command_args, device_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            state, detail = DeviceDeploymentState.FAILED, f"no answer in {device_timeout_s:g}s"
        else:
            state, detail = device_state_from_ack(ack)
            result = {k: v for k, v in ack.result.items() if k != "smoke_tokens"}
        await asyncio.to_thread(
            deployments.record_device,
            deployment_id,
            device_id,
            state,
            detail,
            model_name=args.name,
            result=result,
        )
        outcome = DeviceOutcome(device_id, wave, state, detail)
        if on_outcome is not None:
            on_outcome(outcome)
        return outcome

    state = DeploymentState.DONE
    for wave, device_ids in enumerate(waves):
        if await asyncio.to_thread(deployments.abort_requested, deployment_id):
            state = DeploymentState.CANCELLED
            log.warning("deployment %d: aborted by an operator before wave %d", deployment_id, wave)
            break
        await asyncio.to_thread(deployments.start_wave, deployment_id, wave, device_ids)
        waves_run += 1
        outcomes += await asyncio.gather(*(one(device_id, wave) for device_id in device_ids))
        failed = sum(1 for o in outcomes if o.state is not DeviceDeploymentState.INSTALLED)
        if should_abort(failed, len(outcomes), abort_at_percent):
            state = DeploymentState.FAILED
            log.warning(
                "deployment %d: %d of %d devices failed after wave %d; stopping",
                deployment_id,
                failed,
                len(outcomes),
                wave,
            )
            break
    failed = sum(1 for o in outcomes if o.state is not DeviceDeploymentState.INSTALLED)
    state = await asyncio.to_thread(
        deployments.finish,
        deployment_id,
        state,
        {
            "waves_run": waves_run,
            "waves": len(waves),
            "attempted": len(outcomes),
            "failed": failed,
            "abort_at_percent": abort_at_percent,
        },
    )
    return RolloutSummary(deployment_id, state, len(waves), waves_run, tuple(outcomes))
