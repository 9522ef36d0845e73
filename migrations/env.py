"""Alembic environment for chatctx. The caller passes its connection in ``config.attributes``."""

from __future__ import annotations

from alembic import context

from chatctx.store._connect import create_db_engine
from chatctx.store._migrate import IMMEDIATE, migration_lock
from chatctx.store._models import Base
from chatctx.store.search import include_name

config = context.config
connection = config.attributes.get("connection")


def _run(conn: object) -> None:
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things in place
        transaction_per_migration=True,
        compare_type=True,
        include_name=include_name,  # the FTS tables are not ORM tables
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set sqlalchemy.url or use `chatctx db upgrade --db URL`")
    # The `alembic` command line: the same engine setup and migration lock as chatctx.
    engine = create_db_engine(url)
    try:
        with migration_lock(engine), engine.execution_options(**{IMMEDIATE: True}).begin() as conn:
            _run(conn)
    finally:
        engine.dispose()
