"""Alembic wiring that works from a source checkout and from an installed wheel.

Upgrades run under a lock so that several processes opening a fresh database at once do not
all create its tables: a ``<db file>.lock`` file lock (``flock``) for SQLite files, a session
advisory lock for PostgreSQL. The revision is read again once the lock is held.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from chatctx.errors import StoreError

# Execution option: on SQLite, a connection carrying it begins with BEGIN IMMEDIATE (see _connect).
IMMEDIATE = "chatctx_immediate"
# pg_advisory_lock key: any fixed 64-bit number other programs are unlikely to use.
_PG_LOCK_KEY = zlib.crc32(b"chatctx.migrations")


def migrations_dir() -> Path:
    """The Alembic script directory: bundled in the wheel, or ``migrations/`` in a checkout."""
    package = Path(__file__).resolve().parents[1]  # chatctx/
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


def lock_path(engine: Engine) -> Path | None:
    """The sidecar lock file of a SQLite database file (None for other databases)."""
    url = engine.url
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    if url.database.startswith("file:") or url.query.get("uri"):
        return None  # a URI filename: no plain path to put a lock file next to
    path = Path(url.database).expanduser()
    return path.with_name(path.name + ".lock")


@contextmanager
def migration_lock(engine: Engine) -> Iterator[None]:
    """Hold the database's migration lock (blocks while another process holds it)."""
    if engine.url.get_backend_name() == "postgresql":
        # A session-level advisory lock lives as long as this connection holds it.
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _PG_LOCK_KEY})
            connection.commit()
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _PG_LOCK_KEY})
                connection.commit()
        return
    path = lock_path(engine)
    if path is None or sys.platform == "win32":
        # No file to lock: the BEGIN IMMEDIATE of the upgrade still serializes SQLite writers.
        yield
        return
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database in place, under the migration lock.

    A database already at the newest revision is left alone (no lock, no Alembic run, no log
    lines); so is one that another process upgraded while this one waited for the lock.
    """
    head = head_revision()
    if revision == "head" and current_revision(engine) == head:
        return
    with migration_lock(engine):
        if revision == "head" and current_revision(engine) == head:
            return
        with engine.execution_options(**{IMMEDIATE: True}).begin() as connection:
            command.upgrade(_config(connection), revision)
