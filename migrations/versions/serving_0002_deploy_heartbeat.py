"""serving: deployment heartbeats, so a deployment left running by a crashed deployer is detected.

Revision ID: serving_0002
Revises: serving_0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "serving_0002"
down_revision: str | None = "serving_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("serving_deployments") as batch:
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("serving_deployments") as batch:
        batch.drop_column("heartbeat_at")
