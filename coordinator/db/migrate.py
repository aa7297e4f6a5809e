"""Schema migrations through Alembic's API, from a checkout or an installed wheel alike."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.url import URL

from coordinator.db.engine import make_engine
from coordinator.db.models import Base


class SchemaDriftError(RuntimeError):
    """The models and the migrated database differ: a migration is missing."""

    def __init__(self, differences: list[Any]) -> None:
        super().__init__(
            f"{len(differences)} difference(s) between the models and the database: "
            + "; ".join(repr(d) for d in differences[:5])
        )
        self.differences = differences


class SchemaOutOfDateError(RuntimeError):
    def __init__(self, current: str | None, head: str) -> None:
        super().__init__(
            f"database schema is at {current or 'nothing'}, the code needs {head}: "
            "run `specfleet db upgrade`"
        )
        self.current = current
        self.head = head


def migrations_dir() -> Path:
    # A wheel installs the package as plain files, so the traversable is a real directory.
    return Path(str(resources.files("migrations")))


def alembic_config(connection: Connection | None = None) -> Config:
    """A Config from the packaged alembic.ini, using `connection` when one is given."""
    directory = migrations_dir()
    config = Config(str(directory / "alembic.ini"))
    config.set_main_option("script_location", str(directory))
    config.attributes["keep_logging"] = True
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@contextmanager
def _connection(url: str | URL | Engine) -> Iterator[Connection]:
    engine = url if isinstance(url, Engine) else make_engine(url)
    try:
        with engine.begin() as connection:
            yield connection
    finally:
        if engine is not url:
            engine.dispose()


def upgrade(url: str | URL | Engine, revision: str = "head") -> None:
    with _connection(url) as connection:
        command.upgrade(alembic_config(connection), revision)


def downgrade(url: str | URL | Engine, revision: str) -> None:
    with _connection(url) as connection:
        command.downgrade(alembic_config(connection), revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None  # the package ships at least one revision
    return head


def current_revision(url: str | URL | Engine) -> str | None:
    with _connection(url) as connection:
        return MigrationContext.configure(connection).get_current_revision()


def require_head(url: str | URL | Engine) -> None:
    """Raises SchemaOutOfDateError unless the database is at the latest revision."""
    current, head = current_revision(url), head_revision()
    if current != head:
        raise SchemaOutOfDateError(current, head)


def check(url: str | URL | Engine) -> None:
    """Raises if the database is not at head or differs from the models (what autogenerate sees)."""
    require_head(url)
    with _connection(url) as connection:
        context = MigrationContext.configure(
            connection,
            opts={"compare_type": True, "compare_server_default": True},
        )
        differences = compare_metadata(context, Base.metadata)
    if differences:
        raise SchemaDriftError(differences)
