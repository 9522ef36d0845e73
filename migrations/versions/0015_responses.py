"""responses: /v1/responses answers as ranges of their conversation's messages;
conversations.metadata: OpenAI's metadata of a conversation

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("conversations", sa.Column("metadata", sa.JSON(), nullable=True))
    op.create_table(
        "responses",
        sa.Column("id", sa.String(200), nullable=False),
        sa.Column("conversation_id", sa.String(200), nullable=False),
        sa.Column("previous_response_id", sa.String(200), nullable=True),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("output_start", sa.Integer(), nullable=False),
        sa.Column("end", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_responses_conversation_id_conversations",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_responses"),
    )
    op.create_index("ix_responses_conversation_id", "responses", ["conversation_id"])


def downgrade() -> None:
    op.drop_index("ix_responses_conversation_id", table_name="responses")
    op.drop_table("responses")
    # A plain ALTER TABLE (SQLite 3.35+): a batch rebuild would drop and recreate the table
    # every other table's rows point at.
    op.drop_column("conversations", "metadata")
