"""serving: fleet registry, pool targets, deployments and their stages.

Revision ID: serving_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "serving_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("serving",)
depends_on: str | Sequence[str] | None = "ingest_0001"

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "serving_replicas",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.String(128), nullable=True),
        sa.Column("weights_hash", sa.String(128), nullable=True),
        sa.Column("health", sa.String(32), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_check", TS, nullable=True),
        sa.Column("registered_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_replicas")),
        sa.UniqueConstraint("url", name=op.f("uq_serving_replicas_url")),
    )
    op.create_index(op.f("ix_serving_replicas_pool"), "serving_replicas", ["pool"])
    op.create_index(op.f("ix_serving_replicas_state"), "serving_replicas", ["state"])

    op.create_table(
        "serving_targets",
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("weights_hash", sa.String(128), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("pool", name=op.f("pk_serving_targets")),
    )

    op.create_table(
        "serving_deployments",
        sa.Column("id", BIGINT_PK, nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("from_version", sa.String(128), nullable=False),
        sa.Column("to_version", sa.String(128), nullable=False),
        sa.Column("to_hash", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_deployments")),
    )
    op.create_index(op.f("ix_serving_deployments_pool"), "serving_deployments", ["pool"])
    op.create_index(op.f("ix_serving_deployments_status"), "serving_deployments", ["status"])

    op.create_table(
        "serving_deployment_stages",
        sa.Column("deployment_id", BIGINT_PK, nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("replicas", sa.JSON(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["serving_deployments.id"],
            name=op.f("fk_serving_deployment_stages_deployment_id_serving_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment_id", "idx", name=op.f("pk_serving_deployment_stages")),
    )


def downgrade() -> None:
    op.drop_table("serving_deployment_stages")
    op.drop_index(op.f("ix_serving_deployments_status"), table_name="serving_deployments")
    op.drop_index(op.f("ix_serving_deployments_pool"), table_name="serving_deployments")
    op.drop_table("serving_deployments")
    op.drop_table("serving_targets")
    op.drop_index(op.f("ix_serving_replicas_state"), table_name="serving_replicas")
    op.drop_index(op.f("ix_serving_replicas_pool"), table_name="serving_replicas")
    op.drop_table("serving_replicas")
