"""Connecting to the database: SQLite tuned for several processes, and retries when busy.

SQLite gets WAL, foreign keys, a busy timeout and ``BEGIN IMMEDIATE`` for writes (so a write
transaction takes the lock before it reads, and appends never race); writes that still find
the database locked are retried with backoff.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from chatctx.errors import StoreError
from chatctx.store import _migrate

BUSY_TIMEOUT_MS = 10_000
# Writes that still find the database locked after the busy timeout are run again this many
# times, waiting RETRY_BASE_S * 2**attempt (capped, with jitter) in between.
WRITE_ATTEMPTS = 8
RETRY_BASE_S = 0.05
RETRY_MAX_S = 2.0
_BUSY_MESSAGES = ("database is locked", "database is busy", "database table is locked")
# PostgreSQL: serialization failure, deadlock detected, lock not available.
_BUSY_SQLSTATES = frozenset({"40001", "40P01", "55P03"})

logger = logging.getLogger("chatctx.store")

P = ParamSpec("P")
R = TypeVar("R")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, *, wal: bool) -> None:
    # pysqlite would open transactions itself, lazily and DEFERRED: a read that later writes
    # then fails to take the write lock. Transactions are begun in _sqlite_begin instead.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    if wal:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    # BEGIN IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so
    # read-then-write transactions such as an append's "next position" are serialized.
    immediate = connection.get_execution_options().get(_migrate.IMMEDIATE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def is_busy(exc: BaseException | None) -> bool:
    """Whether ``exc`` means another connection holds a lock (worth trying again)."""
    if not isinstance(exc, OperationalError):
        return False
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code in _BUSY_SQLSTATES or any(m in str(orig).lower() for m in _BUSY_MESSAGES)


def _retry_busy(method: Callable[P, R]) -> Callable[P, R]:
    """Run a store write again while the database is busy (exponential backoff, jitter).

    Each attempt is a whole transaction that rolled back, so running it again is safe.
    """

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        attempt = 0
        while True:
            try:
                return method(*args, **kwargs)
            except StoreError as exc:
                attempt += 1
                if attempt >= WRITE_ATTEMPTS or not is_busy(exc.__cause__):
                    raise
                delay = min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
                logger.info(
                    "%s: database busy, attempt %d of %d in %.2f s",
                    method.__name__,
                    attempt + 1,
                    WRITE_ATTEMPTS,
                    delay,
                )
                time.sleep(delay)

    return wrapper


def create_db_engine(url: str) -> Engine:
    """An Engine for ``url``; SQLite gets WAL, foreign keys and a busy timeout.

    ``postgresql://`` URLs use psycopg 3 (the ``postgres`` extra), as ``postgresql+psycopg://``.

        On SQLite, connections carrying the ``chatctx_immediate`` execution option begin their
        transactions with ``BEGIN IMMEDIATE`` (the Store's writes and migrations do).
    """
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"not a database URL: {url!r}") from exc
    kwargs: dict[str, Any] = {}
    if parsed.drivername in ("postgresql", "postgres"):
        # SQLAlchemy's default PostgreSQL driver is psycopg2; chatctx's extra installs psycopg 3.
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername == "postgresql+psycopg":
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise StoreError("PostgreSQL needs psycopg: pip install 'chatctx[postgres]'") from exc
    is_sqlite = parsed.get_backend_name() == "sqlite"
    in_memory = is_sqlite and parsed.database in (None, "", ":memory:")
    if in_memory:
        # One shared connection, or each checkout would see a different empty database.
        kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
    elif is_sqlite and parsed.database:
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": BUSY_TIMEOUT_MS / 1000}
    try:
        engine = create_engine(parsed, **kwargs)
    except (SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot open database {url!r}: {exc}") from exc
    if is_sqlite:
        wal = not in_memory

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, record: Any) -> None:
            _sqlite_pragmas(dbapi_connection, record, wal=wal)

        event.listen(engine, "begin", _sqlite_begin)
    return engine
