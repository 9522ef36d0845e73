"""turns: tool calls made, tool-result tokens kept and cleared, a call kept as text;
context_states.cleared_ids: tool results sent as a stub

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("tool_calls", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tool_result_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tool_cleared_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tool_warning", sa.Text(), nullable=True))
    with op.batch_alter_table("context_states") as batch:
        batch.add_column(sa.Column("cleared_ids", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("context_states") as batch:
        batch.drop_column("cleared_ids")
    with op.batch_alter_table("turns") as batch:
        for column in ("tool_warning", "tool_cleared_tokens", "tool_result_tokens", "tool_calls"):
            batch.drop_column(column)
