"""An operator's abort (the API's, the dashboard's button) stops a running rollout before its next
wave, on PostgreSQL. The devices answer through `run_rollout`'s send port; the bus path of a
rollout is tested end to end in tests/deploy/test_rollout.py."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker import messages as m
from broker.model_release import DeployModelArgs
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import (
    DeploymentState,
    DeviceDeploymentState,
    Event,
    Model,
    ModelRole,
)
from coordinator.db.registry import DeviceRegistry
from coordinator.ops.rollout import AbortRefused, Deployments, RolloutEvent, plan_waves, run_rollout

DEVICES = ("dev-a", "dev-b", "dev-c", "dev-d")  # waves of 25%: one device each
SHA = hashlib.sha256(b"a draft").hexdigest()


def _rollout(sessions: sessionmaker[Session]) -> tuple[Deployments, int, list[list[str]]]:
    registry = DeviceRegistry(sessions, hash_iterations=10)
    for device_id in DEVICES:
        registry.provision(device_id, "pi", ["lab"])
    with sessions.begin() as db:
        model = Model(
            name="draft-x",
            role=ModelRole.DRAFT,
            format="onnx",
            sha256=SHA,
            size_bytes=1000,
            tokenizer_sha256=SHA,
            location="draft-x",
        )
        db.add(model)
        db.flush()
        model_id = model.id
    deployments = Deployments(sessions)
    waves = plan_waves(DEVICES, 25.0)
    deployment_id = deployments.create(
        model_id=model_id,
        artifact_sha256=SHA,
        targets=["lab"],
        waves=waves,
        wave_percent=25.0,
        abort_at_percent=50.0,
        actor="cli",
    )
    return deployments, deployment_id, waves


def _args(deployment_id: int) -> DeployModelArgs:
    return DeployModelArgs(
        deployment_id=deployment_id,
        name="draft-x",
        format="onnx",
        sha256=SHA,
        size_bytes=1000,
        version=1,
        url="http://127.0.0.1:1/api/v1/artifacts/x",
        signature="c2lnbmF0dXJl",
    )


def _events(sessions: sessionmaker[Session], kind: RolloutEvent) -> list[Event]:
    with sessions() as db:
        return list(db.scalars(sa.select(Event).where(Event.kind == kind.value)))


@pytest.mark.parametrize("abort_in_wave", [0, 3])
def test_an_abort_stops_the_rollout_before_its_next_wave(
    pg_clean_engine: Engine, abort_in_wave: int
) -> None:
    sessions = make_sessionmaker(pg_clean_engine)
    deployments, deployment_id, waves = _rollout(sessions)
    asked: list[str] = []

    async def device_installs(
        device_id: str, name: m.CommandName, args: dict[str, Any], timeout_s: float
    ) -> m.CommandAck:
        asked.append(device_id)
        if len(asked) == abort_in_wave + 1:  # the operator presses Abort while this one installs
            deployments.request_abort(deployment_id, actor="user:alice", reason="bad smoke")
        return m.CommandAck(
            command_id="c-1", device_id=device_id, ok=True, result={"state": "installed"}
        )

    summary = asyncio.run(
        run_rollout(
            deployments,
            deployment_id,
            waves,
            _args(deployment_id),
            device_installs,
            abort_at_percent=50.0,
        )
    )
    assert asked == list(DEVICES[: abort_in_wave + 1])  # the wave in flight finished, no more
    assert summary.state is DeploymentState.CANCELLED
    assert summary.waves_run == abort_in_wave + 1
    deployment, rows = deployments.get(deployment_id)
    assert deployment.state is DeploymentState.CANCELLED
    states = {row.device_id: row.state for row in rows}
    assert [states[d] for d in asked] == [DeviceDeploymentState.INSTALLED] * len(asked)
    assert {states[d] for d in DEVICES[len(asked) :]} <= {DeviceDeploymentState.PENDING}
    (requested,) = _events(sessions, RolloutEvent.ABORT_REQUESTED)
    assert requested.actor == "user:alice"
    assert requested.detail == {
        "deployment_id": deployment_id,
        "wave": abort_in_wave,
        "reason": "bad smoke",
    }
    (ended,) = _events(sessions, RolloutEvent.ABORTED)
    assert ended.detail["state"] == "cancelled"
    assert _events(sessions, RolloutEvent.DONE) == []


def test_an_ended_rollout_cannot_be_aborted(pg_clean_engine: Engine) -> None:
    sessions = make_sessionmaker(pg_clean_engine)
    deployments, deployment_id, _ = _rollout(sessions)
    deployments.finish(deployment_id, DeploymentState.DONE, {})
    with pytest.raises(AbortRefused, match="is done: nothing to abort"):
        deployments.request_abort(deployment_id, actor="user:alice", reason="")
    with pytest.raises(LookupError, match="no deployment 999"):
        deployments.request_abort(999, actor="user:alice", reason="")
    assert _events(sessions, RolloutEvent.ABORT_REQUESTED) == []
