"""ingest: the tombstones of forgotten users (``undertow users forget``), checked by ingest.

Revision ID: ingest_0006
Revises: ingest_0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ingest_0006"
down_revision: str | None = "ingest_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "forgotten_users",
        sa.Column("user_hash", sa.String(64), nullable=False),
        sa.Column("forgotten_at", TS, nullable=False),
        sa.Column("requested_by", sa.String(128), nullable=False),
        sa.Column("deleted", sa.JSON(), nullable=False),
        sa.Column("flagged", sa.JSON(), nullable=False),
        sa.Column("dropped_events", sa.BigInteger(), nullable=False),
        sa.Column("last_dropped_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("user_hash", name=op.f("pk_forgotten_users")),
    )


def downgrade() -> None:
    op.drop_table("forgotten_users")
