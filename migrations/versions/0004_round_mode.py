"""Rounds record their mode: drafted on the device (distributed) or on the verifier host (cloud).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A frozen copy of the session modes at this revision.
SESSION_MODES = ("distributed", "cloud", "local")


def upgrade() -> None:
    allowed = ", ".join(f"'{v}'" for v in SESSION_MODES)
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(
            sa.Column(
                "mode",
                sa.Enum(*SESSION_MODES, native_enum=False, create_constraint=False, length=16),
                server_default="distributed",
                nullable=False,
            )
        )
        batch.create_check_constraint(op.f("ck_rounds_session_mode"), f"mode IN ({allowed})")


def downgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.drop_constraint(op.f("ck_rounds_session_mode"), type_="check")
        batch.drop_column("mode")
