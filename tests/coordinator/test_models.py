"""The ORM tables round-trip their values on both backends and enforce their constraints."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from broker.messages import Mode
from coordinator.db.models import (
    DecodingSession,
    Deployment,
    DeploymentDevice,
    Device,
    DeviceDeploymentState,
    DeviceKind,
    Model,
    ModelRole,
    Round,
    SessionStatus,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def _device(device_id: str = "pi-1") -> Device:
    return Device(id=device_id, kind=DeviceKind.PI, credential_hash="$7$1$AA==$AA==")


def _session(device_id: str = "pi-1") -> DecodingSession:
    return DecodingSession(
        device_id=device_id,
        task_type="chat",
        prompt="Hello",
        prompt_ids=[1, 9906, 2],
        temperature=0.7,
        top_p=0.95,
        seed=2**40 + 3,
        max_tokens=128,
        mode=Mode.DISTRIBUTED,
        draft_model="draft-s",
        k=4,
    )


def _round(session: DecodingSession, index: int) -> Round:
    return Round(
        session_id=session.id,
        round_index=index,
        base_len=3,
        draft_tokens=[11, 12, 13, 14],
        draft_model="draft-s",
        k=4,
        n_accepted=2,
        next_token=99,
        committed_len=6,
        verifier_id="verifier-0",
        policy={"mode": "distributed", "k": 5},
        t_draft_ms=3.5,
        t_verify_ms=7.25,
    )


def test_a_session_with_rounds_round_trips(db_engine: Engine) -> None:
    with Session(db_engine) as db, db.begin():
        db.add(_device())
        db.flush()
        session = _session()
        db.add(session)
        db.flush()
        db.add_all([_round(session, 0), _round(session, 1)])
        session_id = session.id
    with Session(db_engine) as db:
        stored = db.get(DecodingSession, session_id)
        assert stored is not None
        assert stored.status is SessionStatus.ACTIVE
        assert (stored.prompt_ids, stored.seed, stored.committed_ids) == (
            [1, 9906, 2],
            2**40 + 3,
            [],
        )
        assert stored.created_at.tzinfo is not None
        rounds = db.scalars(
            sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
        ).all()
        assert [r.round_index for r in rounds] == [0, 1]
        assert rounds[0].draft_tokens == [11, 12, 13, 14]
        assert rounds[0].policy == {"mode": "distributed", "k": 5}
        assert rounds[0].t_verify_ms == 7.25
        assert rounds[0].t_queue_ms is None


def test_a_round_is_stored_once(db_engine: Engine) -> None:
    """(session_id, round_index) is unique: a re-sent draft cannot create a second round."""
    with Session(db_engine, expire_on_commit=False) as db, db.begin():
        db.add(_device())
        db.flush()
        session = _session()
        db.add(session)
        db.flush()
        db.add(_round(session, 0))
    with (
        pytest.raises(sa.exc.IntegrityError),
        Session(db_engine, expire_on_commit=False) as db,
        db.begin(),
    ):
        db.add(_round(session, 0))


def test_sessions_need_a_known_device(db_engine: Engine) -> None:
    with pytest.raises(sa.exc.IntegrityError), Session(db_engine) as db, db.begin():
        db.add(_session("ghost"))


def test_deployments_track_a_state_per_device(db_engine: Engine) -> None:
    with Session(db_engine) as db, db.begin():
        db.add_all([_device("pi-1"), _device("pi-2")])
        model = Model(
            name="draft-s@1",
            role=ModelRole.DRAFT,
            format="onnx",
            sha256="a" * 64,
            size_bytes=5 * 2**30,
            tokenizer_sha256="b" * 64,
            location="models/draft-s.onnx",
        )
        db.add(model)
        db.flush()
        deployment = Deployment(model_id=model.id, selector={"kind": "pi"}, actor="alice")
        db.add(deployment)
        db.flush()
        db.add_all(
            [
                DeploymentDevice(deployment_id=deployment.id, device_id="pi-1", wave=0),
                DeploymentDevice(
                    deployment_id=deployment.id,
                    device_id="pi-2",
                    wave=1,
                    state=DeviceDeploymentState.INSTALLED,
                ),
            ]
        )
        deployment_id = deployment.id
    with Session(db_engine) as db:
        states = db.execute(
            sa.select(DeploymentDevice.device_id, DeploymentDevice.state)
            .where(DeploymentDevice.deployment_id == deployment_id)
            .order_by(DeploymentDevice.device_id)
        ).all()
        assert states == [
            ("pi-1", DeviceDeploymentState.PENDING),
            ("pi-2", DeviceDeploymentState.INSTALLED),
        ]
        assert db.scalar(sa.select(Model.size_bytes)) == 5 * 2**30


def test_the_database_refuses_a_value_outside_an_enum(db_engine: Engine) -> None:
    with pytest.raises(sa.exc.IntegrityError), db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO devices (id, kind, hardware, tags, credential_hash, status,"
                " installed_models, created_at) VALUES ('x', 'toaster', '{}', '[]', 'h',"
                " 'offline', '[]', :at)"
            ),
            {"at": T0},
        )
