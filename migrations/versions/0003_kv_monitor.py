"""per-turn KV-cache figures

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = [
    ("new_tokens", sa.Integer()),
    ("evicted_tokens", sa.Integer()),
    ("shifted_tokens", sa.Integer()),
    ("shift_count", sa.Integer()),
    ("eviction_policy", sa.String(20)),
    ("kv_fallback", sa.String(200)),
    ("cells_used", sa.JSON()),
    ("summary_tokens", sa.Integer()),
    ("summary_ms", sa.Float()),
]


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
