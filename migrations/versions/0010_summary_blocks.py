"""summaries.blocks: where each part of a summary is sent in the append layout

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("summaries") as batch:
        batch.add_column(sa.Column("blocks", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("summaries") as batch:
        batch.drop_column("blocks")
