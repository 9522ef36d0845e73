"""summaries.abridged: what of each evicted message the abridge layout sends in its place

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("summaries") as batch:
        batch.add_column(sa.Column("abridged", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("summaries") as batch:
        batch.drop_column("abridged")
