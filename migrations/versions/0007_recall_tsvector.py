"""full-text index over message text for recall (PostgreSQL tsvector)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

PostgreSQL's counterpart of 0005's FTS5 table: a generated ``tsvector`` column
(``to_tsvector('english', content)``: Snowball stemming, as FTS5's porter tokenizer stems) with
a GIN index. Being generated, it is right for every way a message is written (appends, the
update of a streamed reply, imports), and existing rows are filled when it is added.

On other databases this revision does nothing.
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "ALTER TABLE messages ADD COLUMN content_tsv tsvector "
        "GENERATED ALWAYS AS (to_tsvector('english', content)) STORED"
    )
    op.execute("CREATE INDEX ix_messages_content_tsv ON messages USING GIN (content_tsv)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX IF EXISTS ix_messages_content_tsv")
    op.execute("ALTER TABLE messages DROP COLUMN IF EXISTS content_tsv")
