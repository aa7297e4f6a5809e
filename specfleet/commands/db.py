"""`specfleet db ...`: the database schema, migrated with Alembic."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from core.errors import CommandError
from specfleet.commands.common import _add_database_url, _command, _engine, _group

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
    group = _group(subparsers, "db", "migrate and check the coordinator database")
    upgrade = _command(group, "upgrade", "apply migrations up to a revision", _db_upgrade)
    _add_database_url(upgrade)
    upgrade.add_argument("--revision", default="head", help="target revision (default: head)")
    downgrade = _command(group, "downgrade", "revert migrations down to a revision", _db_downgrade)
    _add_database_url(downgrade)
    downgrade.add_argument("revision", help="target revision, e.g. 0001 or base")
    check = _command(group, "check", "fail unless the schema is at head and matches", _db_check)
    _add_database_url(check)
    current = _command(group, "current", "print the database's revision", _db_current)
    _add_database_url(current)


def _run_alembic(
    args: argparse.Namespace, action: Callable[[Engine], None], *, create: bool = False
) -> None:
    import alembic.util

    with _engine(args, require_head=False, create=create) as engine:
        try:
            action(engine)
        except alembic.util.CommandError as exc:
            raise CommandError(str(exc)) from exc


def _db_upgrade(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    _run_alembic(args, lambda engine: migrate.upgrade(engine, args.revision), create=True)
    return _db_current(args)


def _db_downgrade(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    _run_alembic(args, lambda engine: migrate.downgrade(engine, args.revision))
    return _db_current(args)


def _db_check(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    with _engine(args, require_head=False) as engine:
        try:
            migrate.check(engine)
        except (migrate.SchemaOutOfDateError, migrate.SchemaDriftError) as exc:
            raise CommandError(str(exc)) from exc
    print("schema is at head and matches the models")
    return 0


def _db_current(args: argparse.Namespace) -> int:
    from coordinator.db import migrate

    with _engine(args, require_head=False) as engine:
        current = migrate.current_revision(engine)
    print(f"database revision: {current or 'none (empty database)'}")
    return 0
