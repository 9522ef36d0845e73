"""Alembic wiring that works from a source checkout and from an installed wheel."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

import chatctx
from chatctx.errors import StoreError


def migrations_dir() -> Path:
    """The Alembic script directory: bundled in the wheel, or ``migrations/`` in a checkout."""
    package = Path(chatctx.__file__).resolve().parent
    for candidate in (package / "_migrations", package.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise StoreError(f"Alembic migrations not found next to {package}")


def _config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    """The newest revision shipped with this version of chatctx."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return ScriptDirectory.from_config(config).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None for an empty database)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database in place; each migration runs in its own transaction.

    A database already at the newest revision is left alone (no Alembic run, no log lines).
    """
    if revision == "head" and current_revision(engine) == head_revision():
        return
    with engine.begin() as connection:
        command.upgrade(_config(connection), revision)
