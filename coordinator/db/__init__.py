"""Persistence of the coordinator: ORM tables, engines and Alembic migrations."""
