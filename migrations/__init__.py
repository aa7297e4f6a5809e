"""Alembic migrations of the coordinator database; run them with `specfleet db upgrade`."""
