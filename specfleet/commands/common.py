"""What the command groups share: subcommand plumbing, the database URL and engine,
enum choices and JSON output."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from core.errors import CommandError

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from enum import Enum

    from sqlalchemy.engine import Engine

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


DEFAULT_SERVICE_USERS = ("coordinator:coordinator",)


Handler = Callable[[argparse.Namespace], int]


EnumT = TypeVar("EnumT", bound="Enum")


def _group(subparsers: Subparsers, name: str, help_text: str) -> Subparsers:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    group: Subparsers = parser.add_subparsers(
        dest=f"{name}_command", metavar="ACTION", required=True
    )
    return group


def _command(
    group: Subparsers, name: str, help_text: str, handler: Handler
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = group.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(func=handler)
    return parser


def _add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="sqlite:///PATH or postgresql://... (default: the settings' database_url)",
    )


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return str(args.database_url)
    from pydantic import ValidationError

    from core.settings import Settings

    try:
        return Settings().database_url
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc.errors()[0]['msg']}") from exc


def _quiet_alembic(*, keep_migration_steps: bool) -> None:
    # Alembic logs its plugin setup and context at INFO; an operator wants only the steps run.
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if keep_migration_steps:
        logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)


@contextmanager
def _engine(
    args: argparse.Namespace, *, require_head: bool = True, create: bool = False
) -> Iterator[Engine]:
    """An engine for the command's database; refuses one whose schema is not at head. Only
    `db upgrade` creates a SQLite file: for any other command a missing one is a mistyped path."""
    import sqlalchemy.exc

    from specfleet.commands.db import _db_downgrade, _db_upgrade  # db imports this module

    _quiet_alembic(keep_migration_steps=args.func in (_db_upgrade, _db_downgrade))
    from coordinator.db import migrate
    from coordinator.db.engine import NoSuchDatabase, make_engine

    url = _database_url(args)
    try:
        engine = make_engine(url, create=create)
    except NoSuchDatabase as exc:
        raise CommandError(
            f"{exc} (`specfleet db upgrade --database-url {url}` creates one)"
        ) from exc
    except (ValueError, sqlalchemy.exc.ArgumentError) as exc:
        raise CommandError(str(exc)) from exc
    try:
        if require_head:
            migrate.require_head(engine)
        yield engine
    except migrate.SchemaOutOfDateError as exc:
        raise CommandError(str(exc)) from exc
    except sqlalchemy.exc.OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise CommandError(f"database error: {reason}") from exc
    finally:
        engine.dispose()


def _choice(enum_type: type[EnumT], value: str, option: str) -> EnumT:
    """`value` as a member of `enum_type`; the enum, not argparse, says what is allowed."""
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in enum_type)
        raise CommandError(f"{option} {value!r}: choose one of {allowed}") from None


def _print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
