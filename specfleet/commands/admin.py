"""`specfleet admin ...`: the accounts and tokens of the HTTP API and the dashboard."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core.errors import CommandError
from specfleet.commands.common import (
    _add_database_url,
    _choice,
    _command,
    _engine,
    _group,
    _print_json,
)

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from coordinator.web.auth import AdminStore

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
    group = _group(subparsers, "admin", "people and scripts allowed into the admin API")
    create = _command(
        group, "create", "create an admin; prints its bearer token once", _admin_create
    )
    create.add_argument("name", metavar="NAME", help="1-48 of a-z 0-9 . _ -")
    create.add_argument(
        "--role", default="admin", help="admin (reads and writes) or viewer (reads only)"
    )
    create.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_database_url(create)

    listing = _command(group, "list", "list admins and their live tokens", _admin_list)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_database_url(listing)

    token = _command(group, "token", "issue another token; prints it once", _admin_token)
    token.add_argument("name", metavar="NAME", help="the admin's name")
    token.add_argument("--label", default="", help="what the token is for (e.g. prometheus)")
    _add_database_url(token)

    revoke = _command(
        group, "revoke", "revoke every token of an admin (and its logins)", _admin_revoke
    )
    revoke.add_argument("name", metavar="NAME", help="the admin's name")
    _add_database_url(revoke)


def _admin_store(engine: Engine) -> AdminStore:
    from coordinator.db.engine import make_sessionmaker
    from coordinator.web.auth import AdminStore

    return AdminStore(make_sessionmaker(engine))


def _admin_create(args: argparse.Namespace) -> int:
    from coordinator.db.models import AdminRole
    from coordinator.web.auth import AdminError

    role = _choice(AdminRole, args.role, "--role")
    with _engine(args) as engine:
        try:
            admin, token = _admin_store(engine).create(args.name, role, actor="cli")
        except AdminError as exc:
            raise CommandError(str(exc)) from exc
    if args.json:
        _print_json({"name": admin.name, "role": admin.role.value, "token": token})
    else:
        print(f"admin   {admin.name}")
        print(f"role    {admin.role.value}")
        print(f"token   {token}")
        print(
            "The token is shown only now. Send it as 'Authorization: Bearer TOKEN', "
            "or paste it into the dashboard's login page."
        )
    return 0


def _admin_list(args: argparse.Namespace) -> int:
    from core.report import format_table

    with _engine(args) as engine:
        admins = _admin_store(engine).list()
    if args.json:
        _print_json(
            [
                {
                    "name": a.name,
                    "role": a.role.value,
                    "live_tokens": n,
                    "created_at": a.created_at.isoformat(),
                }
                for a, n in admins
            ]
        )
        return 0
    if not admins:
        print("no admins; create one with `specfleet admin create NAME`")
        return 0
    rows = [
        (a.name, a.role.value, str(n), a.created_at.isoformat(timespec="seconds"))
        for a, n in admins
    ]
    print(format_table(("name", "role", "tokens", "created"), rows))
    return 0


def _admin_token(args: argparse.Namespace) -> int:
    from coordinator.web.auth import AdminError

    with _engine(args) as engine:
        try:
            token = _admin_store(engine).issue_token(args.name, label=args.label, actor="cli")
        except AdminError as exc:
            raise CommandError(str(exc)) from exc
    print(f"token   {token}")
    print("Shown only now.")
    return 0


def _admin_revoke(args: argparse.Namespace) -> int:
    from coordinator.web.auth import AdminError

    with _engine(args) as engine:
        try:
            revoked = _admin_store(engine).revoke_tokens(args.name, actor="cli")
        except AdminError as exc:
            raise CommandError(str(exc)) from exc
    print(f"revoked {revoked} token(s) of {args.name}")
    return 0
