"""Sessions and rounds may be in plain mode: the verifier host decodes with no drafter (k = 0).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the session modes before and at this revision.
BEFORE = ("distributed", "cloud", "local")
AFTER = ("distributed", "cloud", "local", "plain")


def _allow(modes: tuple[str, ...]) -> None:
    allowed = ", ".join(f"'{v}'" for v in modes)
    for table in ("sessions", "rounds"):
        name = op.f(f"ck_{table}_session_mode")
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(name, type_="check")
            batch.create_check_constraint(name, f"mode IN ({allowed})")


def upgrade() -> None:
    _allow(AFTER)


def downgrade() -> None:
    op.execute("UPDATE rounds SET mode = 'cloud' WHERE mode = 'plain'")
    op.execute("UPDATE sessions SET mode = 'cloud' WHERE mode = 'plain'")
    _allow(BEFORE)
