"""policy: policy_versions table (lineage, data window, staleness, metrics, checkpoint).

Revision ID: policy_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "policy_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("policy",)
depends_on: str | Sequence[str] | None = "ingest_0001"

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "policy_versions",
        sa.Column("version_id", sa.String(128), nullable=False),
        sa.Column("parent_id", sa.String(128), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("data_start", TS, nullable=True),
        sa.Column("data_end", TS, nullable=True),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("num_dropped_stale", sa.Integer(), nullable=False),
        sa.Column("staleness_mean", sa.Float(), nullable=True),
        sa.Column("staleness_max", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("checkpoint_path", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("version_id", name=op.f("pk_policy_versions")),
    )
    op.create_index(op.f("ix_policy_versions_parent_id"), "policy_versions", ["parent_id"])
    op.create_index(op.f("ix_policy_versions_created_at"), "policy_versions", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_policy_versions_created_at"), table_name="policy_versions")
    op.drop_index(op.f("ix_policy_versions_parent_id"), table_name="policy_versions")
    op.drop_table("policy_versions")
