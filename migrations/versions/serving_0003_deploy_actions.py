"""serving: the hash a rollback restores, and operator requests to a running deployment.

Revision ID: serving_0003
Revises: serving_0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "serving_0003"
down_revision: str | None = "serving_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("serving_deployments") as batch:
        batch.add_column(sa.Column("from_hash", sa.String(128), nullable=True))
        batch.add_column(sa.Column("requested", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("serving_deployments") as batch:
        batch.drop_column("requested")
        batch.drop_column("from_hash")
