"""per-turn request timing, recall and memory figures

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = [
    # TTFT is timed from the request; these are its parts.
    ("build_ms", sa.Float()),
    ("store_ms", sa.Float()),
    ("engine_ttft_ms", sa.Float()),
    ("recall_tokens", sa.Integer()),
    ("recall_ms", sa.Float()),
    ("rss_bytes", sa.BigInteger()),
    ("gpu_used_bytes", sa.BigInteger()),
    ("gpu_free_bytes", sa.BigInteger()),
]


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
