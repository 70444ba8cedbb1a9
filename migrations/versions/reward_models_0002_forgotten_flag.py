"""reward_models: flag versions trained on a forgotten user's rows.

Revision ID: reward_models_0002
Revises: reward_models_0001
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "reward_models_0002"
down_revision: str | None = "reward_models_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("reward_models") as batch:
        batch.add_column(sa.Column("trained_on_forgotten", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("reward_models") as batch:
        batch.drop_column("trained_on_forgotten")
