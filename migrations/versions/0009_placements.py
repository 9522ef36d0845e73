"""router placements: which backend holds each conversation; the backend of each turn

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "placements",
        sa.Column("conversation_id", sa.String(200), primary_key=True),
        sa.Column("backend", sa.String(255), nullable=False),
        sa.Column("placed_at", sa.DateTime(), nullable=False),
        sa.Column("moves", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("moved_from", sa.String(255), nullable=True),
        sa.Column("move_reason", sa.Text(), nullable=True),
    )
    op.create_index("ix_placements_backend", "placements", ["backend"])
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("backend", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("backend")
    op.drop_index("ix_placements_backend", table_name="placements")
    op.drop_table("placements")
