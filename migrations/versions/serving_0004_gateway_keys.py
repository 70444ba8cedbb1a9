"""serving: API keys of the gateway's client integrations (hashed), with scopes, user and rate.

Revision ID: serving_0004
Revises: serving_0003
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "serving_0004"
down_revision: str | None = "serving_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "gateway_keys",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("scopes", sa.JSON, nullable=False),
        sa.Column("user_id", sa.String(128), nullable=True),
        sa.Column("rate_per_s", sa.Float, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("gateway_keys")
