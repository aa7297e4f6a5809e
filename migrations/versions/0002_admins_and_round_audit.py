"""Admins and their API tokens; rounds keep the provisional flag and the draft's q' for replay.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ADMIN_ROLES = ("admin", "viewer")


def _timestamp(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "admins",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=48), nullable=False),
        sa.Column(
            "role",
            sa.Enum(*ADMIN_ROLES, native_enum=False, create_constraint=False, length=16),
            nullable=False,
        ),
        _timestamp("created_at"),
        _timestamp("disabled_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admins")),
        sa.UniqueConstraint("name", name=op.f("uq_admins_name")),
        sa.CheckConstraint("role IN ('admin', 'viewer')", name=op.f("ck_admins_admin_role")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("admin_id", sa.Integer(), nullable=False),
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("label", sa.String(length=64), nullable=False),
        _timestamp("created_at"),
        _timestamp("last_used_at", nullable=True),
        _timestamp("revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["admin_id"],
            ["admins.id"],
            name=op.f("fk_api_tokens_admin_id_admins"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_sha256", name=op.f("uq_api_tokens_token_sha256")),
    )
    op.create_index(op.f("ix_api_tokens_admin_id"), "api_tokens", ["admin_id"], unique=False)

    with op.batch_alter_table("rounds") as batch:
        batch.add_column(
            sa.Column("provisional", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch.add_column(sa.Column("q_ids", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("q_probs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("q_probs")
        batch.drop_column("q_ids")
        batch.drop_column("provisional")
    op.drop_index(op.f("ix_api_tokens_admin_id"), table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("admins")
