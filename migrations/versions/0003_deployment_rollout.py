"""Deployments record the artifact they roll out, their wave size and their abort threshold.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("artifact_sha256", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("wave_percent", sa.Double(), nullable=True))
        batch.add_column(sa.Column("abort_at_percent", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("abort_at_percent")
        batch.drop_column("wave_percent")
        batch.drop_column("artifact_sha256")
