"""Persistence of the coordinator: ORM tables, engines, Alembic migrations, and the stores over
them (the device registry, the audit log, the round writer)."""
