"""Initial schema: devices, models, deployments, sessions, rounds and the event log.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the enum values at this revision; later changes need their own migration.
DEVICE_KINDS = ("pi", "jetson", "phone", "other")
DEVICE_STATUSES = ("online", "offline", "retired")
MODEL_ROLES = ("draft", "target")
DEPLOYMENT_STATES = ("pending", "rolling", "paused", "done", "failed", "cancelled")
DEVICE_DEPLOYMENT_STATES = ("pending", "sent", "installing", "installed", "failed", "rolled_back")
SESSION_MODES = ("distributed", "cloud", "local")
SESSION_STATUSES = ("active", "suspended", "finished", "failed", "cancelled")

APPEND_ONLY_MESSAGE = "events are append-only"


def _enum(name: str, values: tuple[str, ...], **kwargs: object) -> sa.Column:  # type: ignore[type-arg]
    # VARCHAR(16) plus a named CHECK (as the models declare), the same on SQLite and PostgreSQL.
    return sa.Column(
        name,
        sa.Enum(*values, native_enum=False, create_constraint=False, length=16),
        nullable=False,
        **kwargs,
    )


def _check(table: str, column: str, enum_name: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=op.f(f"ck_{table}_{enum_name}"))


def _timestamp(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.String(length=64), nullable=False),
        _enum("kind", DEVICE_KINDS),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("credential_hash", sa.String(length=255), nullable=False),
        _enum("status", DEVICE_STATUSES),
        sa.Column("status_reason", sa.String(length=255), nullable=True),
        _timestamp("last_seen", nullable=True),
        sa.Column("installed_models", sa.JSON(), nullable=False),
        sa.Column("telemetry", sa.JSON(), nullable=True),
        _timestamp("telemetry_at", nullable=True),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_devices")),
        _check("devices", "kind", "device_kind", DEVICE_KINDS),
        _check("devices", "status", "device_status", DEVICE_STATUSES),
    )
    op.create_index(op.f("ix_devices_status"), "devices", ["status"], unique=False)

    op.create_table(
        "events",
        sa.Column("id", BIG_ID, nullable=False),
        _timestamp("at"),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=True),
        sa.Column("session_id", sa.Uuid(), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_at"), "events", ["at"], unique=False)
    op.create_index(op.f("ix_events_device_id"), "events", ["device_id"], unique=False)
    op.create_index(op.f("ix_events_kind"), "events", ["kind"], unique=False)
    op.create_index(op.f("ix_events_session_id"), "events", ["session_id"], unique=False)
    _create_append_only_guard()

    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        _enum("role", MODEL_ROLES),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("tokenizer_sha256", sa.String(length=64), nullable=False),
        sa.Column("location", sa.String(length=1024), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("name", name=op.f("uq_models_name")),
        _check("models", "role", "model_role", MODEL_ROLES),
    )

    op.create_table(
        "deployments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("selector", sa.JSON(), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        _enum("state", DEPLOYMENT_STATES),
        sa.Column("actor", sa.String(length=64), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_deployments_model_id_models")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
        _check("deployments", "state", "deployment_state", DEPLOYMENT_STATES),
    )
    op.create_index(op.f("ix_deployments_model_id"), "deployments", ["model_id"], unique=False)

    op.create_table(
        "sessions",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("task_type", sa.String(length=32), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("prompt_ids", sa.JSON(), nullable=False),
        sa.Column("temperature", sa.Double(), nullable=False),
        sa.Column("top_p", sa.Double(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        _enum("mode", SESSION_MODES),
        sa.Column("draft_model", sa.String(length=128), nullable=True),
        sa.Column("k", sa.Integer(), nullable=False),
        _enum("status", SESSION_STATUSES),
        sa.Column("committed_ids", sa.JSON(), nullable=False),
        sa.Column("committed_len", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("finished_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name=op.f("fk_sessions_device_id_devices")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
        _check("sessions", "mode", "session_mode", SESSION_MODES),
        _check("sessions", "status", "session_status", SESSION_STATUSES),
    )
    op.create_index(op.f("ix_sessions_device_id"), "sessions", ["device_id"], unique=False)
    op.create_index(op.f("ix_sessions_status"), "sessions", ["status"], unique=False)

    op.create_table(
        "deployment_devices",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        _enum("state", DEVICE_DEPLOYMENT_STATES),
        sa.Column("detail", sa.String(length=1024), nullable=True),
        _timestamp("updated_at"),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_deployment_devices_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name=op.f("fk_deployment_devices_device_id_devices")
        ),
        sa.PrimaryKeyConstraint("deployment_id", "device_id", name=op.f("pk_deployment_devices")),
        _check(
            "deployment_devices", "state", "device_deployment_state", DEVICE_DEPLOYMENT_STATES
        ),
    )

    op.create_table(
        "rounds",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("session_id", sa.Uuid(), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("base_len", sa.Integer(), nullable=False),
        sa.Column("draft_tokens", sa.JSON(), nullable=False),
        sa.Column("draft_model", sa.String(length=128), nullable=True),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("n_accepted", sa.Integer(), nullable=False),
        sa.Column("next_token", sa.Integer(), nullable=False),
        sa.Column("committed_len", sa.Integer(), nullable=False),
        sa.Column("verifier_id", sa.String(length=64), nullable=True),
        sa.Column("policy", sa.JSON(), nullable=True),
        sa.Column("t_draft_ms", sa.Double(), nullable=True),
        sa.Column("t_uplink_ms", sa.Double(), nullable=True),
        sa.Column("t_queue_ms", sa.Double(), nullable=True),
        sa.Column("t_verify_ms", sa.Double(), nullable=True),
        sa.Column("t_downlink_ms", sa.Double(), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_rounds_session_id_sessions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rounds")),
        sa.UniqueConstraint(
            "session_id", "round_index", name=op.f("uq_rounds_session_id_round_index")
        ),
    )


def downgrade() -> None:
    op.drop_table("rounds")
    op.drop_table("deployment_devices")
    op.drop_index(op.f("ix_sessions_status"), table_name="sessions")
    op.drop_index(op.f("ix_sessions_device_id"), table_name="sessions")
    op.drop_table("sessions")
    op.drop_index(op.f("ix_deployments_model_id"), table_name="deployments")
    op.drop_table("deployments")
    op.drop_table("models")
    _drop_append_only_guard()
    op.drop_index(op.f("ix_events_session_id"), table_name="events")
    op.drop_index(op.f("ix_events_kind"), table_name="events")
    op.drop_index(op.f("ix_events_device_id"), table_name="events")
    op.drop_index(op.f("ix_events_at"), table_name="events")
    op.drop_table("events")
    op.drop_index(op.f("ix_devices_status"), table_name="devices")
    op.drop_table("devices")


# The audit log must not be rewritten, by the application or by a stray SQL session. TRUNCATE
# (an operator's deliberate act, e.g. retention) is not blocked. On SQLite a batch-mode
# migration of `events` recreates the table and drops these triggers: recreate them there.
def _create_append_only_guard() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION '{APPEND_ONLY_MESSAGE}'; END $$"
        )
        op.execute(
            "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events "
            "FOR EACH ROW EXECUTE FUNCTION events_append_only()"
        )
    else:
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER events_append_only_{action.lower()} BEFORE {action} ON events "
                f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY_MESSAGE}'); END"
            )


def _drop_append_only_guard() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER events_append_only ON events")
        op.execute("DROP FUNCTION events_append_only()")
    else:
        for action in ("update", "delete"):
            op.execute(f"DROP TRIGGER events_append_only_{action}")
