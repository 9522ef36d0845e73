"""turn claims: one turn of a conversation at a time across serve processes

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "turn_claims",
        sa.Column("conversation_id", sa.String(200), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("turn_claims")
