"""per-turn slot pool figures: slot, swap-in, re-prefill reason, batch width

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Only the ``turns`` table changes; the FTS triggers on ``messages`` (0005) are not touched.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = [
    ("slot", sa.Integer()),  # the pool slot the turn ran in
    ("swap_in", sa.String(10)),  # "ram" | "disk" when the KV state was restored, else null
    ("swap_in_ms", sa.Float()),
    ("swap_in_bytes", sa.BigInteger()),
    # Why a swapped state was refused and the prompt prefilled again instead.
    ("reprefill_reason", sa.Text()),
    ("batch_max", sa.Integer()),  # most sequences in one llama_decode step of the turn
]


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
