"""pinned messages, per-message token counts, context state

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(
            sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    op.create_table(
        "message_tokens",
        sa.Column("message_id", sa.Integer(), nullable=False),
        sa.Column("tokenizer", sa.String(100), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["messages.id"],
            name="fk_message_tokens_message_id_messages",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("message_id", "tokenizer", name="pk_message_tokens"),
    )
    op.create_table(
        "context_states",
        sa.Column("conversation_id", sa.String(200), nullable=False),
        sa.Column("window_start", sa.Integer(), nullable=False),
        sa.Column("summary_id", sa.Integer(), nullable=True),
        sa.Column("pending_ids", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_context_states_conversation_id_conversations",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["summary_id"],
            ["summaries.id"],
            name="fk_context_states_summary_id_summaries",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("conversation_id", name="pk_context_states"),
    )


def downgrade() -> None:
    op.drop_table("context_states")
    op.drop_table("message_tokens")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("pinned")
