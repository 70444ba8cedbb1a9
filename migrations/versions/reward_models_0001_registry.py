"""reward_models: registry of reward-model versions and the LLM-judge cache.

Revision ID: reward_models_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "reward_models_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("reward_models",)
depends_on: str | Sequence[str] | None = "ingest_0001"

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "reward_models",
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("artifact_sha256", sa.String(64), nullable=False),
        sa.Column("artifact_path", sa.Text(), nullable=False),
        sa.Column("window_start", TS, nullable=True),
        sa.Column("window_end", TS, nullable=True),
        sa.Column("n_labeled", sa.Integer(), nullable=False),
        sa.Column("primary_metric", sa.Float(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("reference_scores", sa.JSON(), nullable=False),
        sa.Column("promoted_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_reward_models")),
    )
    op.create_index(op.f("ix_reward_models_created_at"), "reward_models", ["created_at"])
    op.create_index(op.f("ix_reward_models_status"), "reward_models", ["status"])

    op.create_table(
        "reward_judge_cache",
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("dimension", sa.String(64), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("content_hash", name=op.f("pk_reward_judge_cache")),
    )


def downgrade() -> None:
    op.drop_table("reward_judge_cache")
    op.drop_index(op.f("ix_reward_models_status"), table_name="reward_models")
    op.drop_index(op.f("ix_reward_models_created_at"), table_name="reward_models")
    op.drop_table("reward_models")
