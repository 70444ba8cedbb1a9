"""api: API tokens (hashed) and the audit log of mutating calls.

Revision ID: api_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "api_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("api",)
depends_on: str | Sequence[str] | None = "ingest_0001"

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("last_used_at", TS, nullable=True),
        sa.Column("revoked_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_api_tokens_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "api_audit_log",
        sa.Column("id", BIGINT_PK, nullable=False),
        sa.Column("occurred_at", TS, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("client", sa.String(64), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_audit_log")),
    )
    for col in ("occurred_at", "actor", "action"):
        op.create_index(op.f(f"ix_api_audit_log_{col}"), "api_audit_log", [col])


def downgrade() -> None:
    for col in ("occurred_at", "actor", "action"):
        op.drop_index(op.f(f"ix_api_audit_log_{col}"), table_name="api_audit_log")
    op.drop_table("api_audit_log")
    op.drop_table("api_tokens")
