"""full-text index over message text for recall (SQLite FTS5)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

An external-content FTS5 table over ``messages.content`` (porter stemming: "parked" finds
"parking"), kept in step by triggers, so every way a message is written is covered: appends,
updates of a streamed reply, imports, and deletes (cascade deletes of a conversation fire
the delete trigger too). Existing messages are indexed on upgrade.

On other databases this revision does nothing; search falls back to a portable query.

Note for later migrations: a ``batch_alter_table("messages")`` on SQLite rebuilds the table and
drops its triggers; such a migration must run ``drop()`` before and ``create()`` after it.
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CREATE = [
    "CREATE VIRTUAL TABLE messages_fts USING fts5("
    "content, content='messages', content_rowid='id', tokenize='porter unicode61')",
    # The 'delete' command must be given the text that was indexed: the old row's.
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) "
    "VALUES ('delete', old.id, old.content); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) "
    "VALUES ('delete', old.id, old.content); "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
]
DROP = [
    "DROP TRIGGER IF EXISTS messages_fts_update",
    "DROP TRIGGER IF EXISTS messages_fts_delete",
    "DROP TRIGGER IF EXISTS messages_fts_insert",
    "DROP TABLE IF EXISTS messages_fts",
]


def create() -> None:
    for statement in CREATE:
        op.execute(statement)


def drop() -> None:
    for statement in DROP:
        op.execute(statement)


def _fts5_available() -> bool:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return False
    # A Python built against an SQLite without FTS5 still gets a working store (and the
    # portable search) instead of a failed upgrade.
    used = bind.exec_driver_sql("SELECT sqlite_compileoption_used('ENABLE_FTS5')").scalar()
    return bool(used)


def upgrade() -> None:
    if _fts5_available():
        create()


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        drop()
