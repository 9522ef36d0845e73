"""stored sentence vectors for recall by meaning; a version on context states

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

``message_embeddings``: each message's vectors per embedder fingerprint (float32 bytes),
deleted with the message, so a restarted process embeds only what is new.
``context_states.version``: incremented on every save, for compare-and-set saves.

Neither touches ``messages``: the FTS triggers (0005) stay as they are.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "message_embeddings",
        sa.Column("message_id", sa.Integer(), nullable=False),
        sa.Column("embedder", sa.String(200), nullable=False),
        sa.Column("text_sha256", sa.String(64), nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("vectors", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["messages.id"],
            name=op.f("fk_message_embeddings_message_id_messages"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("message_id", "embedder", name=op.f("pk_message_embeddings")),
    )
    with op.batch_alter_table("context_states") as batch:
        batch.add_column(sa.Column("version", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("context_states") as batch:
        batch.drop_column("version")
    op.drop_table("message_embeddings")
