"""ingest: the record of batches the consumer could not read (``undertow stats --json``, ``/metrics``).

Revision ID: ingest_0004
Revises: ingest_0003
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ingest_0004"
down_revision: str | None = "ingest_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "unreadable_batches",
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("first_at", TS, nullable=False),
        sa.Column("last_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("group_id", "topic", "partition", name=op.f("pk_unreadable_batches")),
    )


def downgrade() -> None:
    op.drop_table("unreadable_batches")
