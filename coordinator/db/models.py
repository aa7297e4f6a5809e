"""ORM tables of the coordinator (SQLAlchemy 2); portable across SQLite and PostgreSQL."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from broker.messages import Mode

JsonDict = dict[str, Any]

# Named constraints, so that Alembic can drop and alter them, in batch mode on SQLite too.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UtcDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC in and out; SQLite stores no zone, so naive values read back as UTC."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass an aware one (UTC)")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


def _enum(cls: type[enum.Enum], name: str) -> sa.Enum:
    # VARCHAR plus a CHECK constraint rather than a native type: portable, and adding a value is
    # a constraint change instead of ALTER TYPE.
    return sa.Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda members: [m.value for m in members],
    )


# SQLite auto-increments only an INTEGER PRIMARY KEY, not a BIGINT one.
BigIntId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - read once by SQLAlchemy at class creation
        datetime: UtcDateTime(),
        JsonDict: sa.JSON(),
        list[str]: sa.JSON(),
        list[int]: sa.JSON(),
        uuid.UUID: sa.Uuid(),
    }


class DeviceKind(str, enum.Enum):
    PI = "pi"
    JETSON = "jetson"
    PHONE = "phone"
    OTHER = "other"


class DeviceStatus(str, enum.Enum):
    ONLINE = "online"
    OFFLINE = "offline"
    RETIRED = "retired"


class ModelRole(str, enum.Enum):
    DRAFT = "draft"
    TARGET = "target"


class DeploymentState(str, enum.Enum):
    PENDING = "pending"
    ROLLING = "rolling"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class DeviceDeploymentState(str, enum.Enum):
    PENDING = "pending"
    SENT = "sent"
    INSTALLING = "installing"
    INSTALLED = "installed"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"


class SessionStatus(str, enum.Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"  # its device dropped; it resumes from committed_len
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Device(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    kind: Mapped[DeviceKind] = mapped_column(_enum(DeviceKind, "device_kind"))
    hardware: Mapped[JsonDict] = mapped_column(default=dict)
    tags: Mapped[list[str]] = mapped_column(default=list)
    # Mosquitto's PBKDF2-SHA512 `$7$` format: the same hash checks the API and the broker.
    credential_hash: Mapped[str] = mapped_column(sa.String(255))
    status: Mapped[DeviceStatus] = mapped_column(
        _enum(DeviceStatus, "device_status"), default=DeviceStatus.OFFLINE, index=True
    )
    status_reason: Mapped[str | None] = mapped_column(sa.String(255))
    last_seen: Mapped[datetime | None]
    installed_models: Mapped[list[str]] = mapped_column(default=list)
    # The latest telemetry only (rtt_ms, cpu_percent, memory_percent, battery_percent, ...).
    telemetry: Mapped[JsonDict | None] = mapped_column(sa.JSON())
    telemetry_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Model(Base):
    __tablename__ = "models"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128), unique=True)
    role: Mapped[ModelRole] = mapped_column(_enum(ModelRole, "model_role"))
    format: Mapped[str] = mapped_column(sa.String(32))  # onnx, tflite, lookup, ...
    sha256: Mapped[str] = mapped_column(sa.String(64))
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    tokenizer_sha256: Mapped[str] = mapped_column(sa.String(64))
    location: Mapped[str] = mapped_column(sa.String(1024))  # a URL or a path below models_dir
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Deployment(Base):
    """A model rolled out to the devices a selector picks, wave by wave."""

    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(sa.ForeignKey("models.id"), index=True)
    # {"kind": ..., "tags": [...], "devices": [...]}: which devices the rollout targets.
    selector: Mapped[JsonDict] = mapped_column(default=dict)
    wave: Mapped[int] = mapped_column(default=0)  # the wave being rolled out now
    state: Mapped[DeploymentState] = mapped_column(
        _enum(DeploymentState, "deployment_state"), default=DeploymentState.PENDING
    )
    actor: Mapped[str] = mapped_column(sa.String(64))
    # The exact artifact rolled out (the models row may since point at a newer build).
    artifact_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    wave_percent: Mapped[float | None]  # each wave's share of the targeted devices
    abort_at_percent: Mapped[float | None]  # stop when this share of attempted devices failed
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class DeploymentDevice(Base):
    __tablename__ = "deployment_devices"

    deployment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True
    )
    device_id: Mapped[str] = mapped_column(sa.ForeignKey("devices.id"), primary_key=True)
    wave: Mapped[int]
    state: Mapped[DeviceDeploymentState] = mapped_column(
        _enum(DeviceDeploymentState, "device_deployment_state"),
        default=DeviceDeploymentState.PENDING,
    )
    detail: Mapped[str | None] = mapped_column(sa.String(1024))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class DecodingSession(Base):
    """One generation (table `sessions`); committed_ids is the only truth of its output."""

    __tablename__ = "sessions"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    device_id: Mapped[str] = mapped_column(sa.ForeignKey("devices.id"), index=True)
    task_type: Mapped[str] = mapped_column(sa.String(32))
    prompt: Mapped[str] = mapped_column(sa.Text)
    prompt_ids: Mapped[list[int]]
    temperature: Mapped[float]
    top_p: Mapped[float]
    seed: Mapped[int] = mapped_column(sa.BigInteger)
    max_tokens: Mapped[int]
    mode: Mapped[Mode] = mapped_column(_enum(Mode, "session_mode"))
    draft_model: Mapped[str | None] = mapped_column(sa.String(128))
    k: Mapped[int]
    status: Mapped[SessionStatus] = mapped_column(
        _enum(SessionStatus, "session_status"), default=SessionStatus.ACTIVE, index=True
    )
    committed_ids: Mapped[list[int]] = mapped_column(default=list)
    committed_len: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None]


class Round(Base):
    """One verified draft; (session_id, round_index) is unique so a re-sent draft finds it."""

    __tablename__ = "rounds"
    __table_args__ = (sa.UniqueConstraint("session_id", "round_index"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True)
    session_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("sessions.id"))
    round_index: Mapped[int]
    base_len: Mapped[int]
    draft_tokens: Mapped[list[int]]
    draft_model: Mapped[str | None] = mapped_column(sa.String(128))
    k: Mapped[int]
    # Who drafted: the device (distributed) or the verifier host (cloud, `k` tokens of its own).
    mode: Mapped[Mode] = mapped_column(
        _enum(Mode, "session_mode"),
        default=Mode.DISTRIBUTED,
        server_default=Mode.DISTRIBUTED.value,
    )
    n_accepted: Mapped[int]
    next_token: Mapped[int]
    committed_len: Mapped[int]
    verifier_id: Mapped[str | None] = mapped_column(sa.String(64))
    # The policy (mode, draft model, k) sent back with this round's verdict.
    policy: Mapped[JsonDict | None] = mapped_column(sa.JSON())
    t_draft_ms: Mapped[float | None]
    t_uplink_ms: Mapped[float | None]
    t_queue_ms: Mapped[float | None]
    t_verify_ms: Mapped[float | None]
    t_downlink_ms: Mapped[float | None]
    # Drafted offline (local mode) and already shown to the device's user; set from Draft.
    provisional: Mapped[bool] = mapped_column(default=False, server_default=sa.false())
    # q' of a sampled draft, as the Draft carried it, so that replay can re-verify the round:
    # [k, K] ids and probabilities; NULL for greedy sessions and deterministic drafters.
    q_ids: Mapped[list[list[int]] | None] = mapped_column(sa.JSON())
    q_probs: Mapped[list[list[float]] | None] = mapped_column(sa.JSON())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Event(Base):
    """Append-only audit log; triggers in the migration refuse UPDATE and DELETE."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(sa.String(64), index=True)
    # No foreign keys: the log outlives what it mentions and records unknown devices too.
    device_id: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    session_id: Mapped[uuid.UUID | None] = mapped_column(index=True)
    actor: Mapped[str] = mapped_column(sa.String(64))
    detail: Mapped[JsonDict] = mapped_column(default=dict)


class AdminRole(str, enum.Enum):
    ADMIN = "admin"  # reads and writes
    VIEWER = "viewer"  # reads only


class Admin(Base):
    """A person (or a script) allowed into the admin API and the dashboard."""

    __tablename__ = "admins"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(48), unique=True)
    role: Mapped[AdminRole] = mapped_column(_enum(AdminRole, "admin_role"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    disabled_at: Mapped[datetime | None]


class ApiToken(Base):
    """A bearer token of an admin; only its SHA-256 is stored (it is 256 random bits)."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    admin_id: Mapped[int] = mapped_column(
        sa.ForeignKey("admins.id", ondelete="CASCADE"), index=True
    )
    token_sha256: Mapped[str] = mapped_column(sa.String(64), unique=True)
    prefix: Mapped[str] = mapped_column(sa.String(16))  # tells tokens apart in listings
    label: Mapped[str] = mapped_column(sa.String(64), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
