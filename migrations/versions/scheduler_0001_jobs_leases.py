"""scheduler: job table, replica leases, borrow events.

Revision ID: scheduler_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "scheduler_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("scheduler",)
depends_on: str | Sequence[str] | None = "ingest_0001"

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("chain_id", sa.String(64), nullable=True),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("outputs", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(128), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    for col in ("name", "state", "chain_id", "created_at"):
        op.create_index(op.f(f"ix_jobs_{col}"), "jobs", [col])

    op.create_table(
        "replica_leases",
        sa.Column("replica_id", sa.String(128), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("purpose", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("acquired_at", TS, nullable=False),
        sa.Column("renewed_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("recall_requested", sa.Boolean(), nullable=False),
        sa.Column("recall_deadline", TS, nullable=True),
        sa.Column("released_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("replica_id", name=op.f("pk_replica_leases")),
    )
    for col in ("pool", "expires_at"):
        op.create_index(op.f(f"ix_replica_leases_{col}"), "replica_leases", [col])

    op.create_table(
        "borrow_events",
        sa.Column("id", BIGINT_PK, nullable=False),
        sa.Column("replica_id", sa.String(128), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("holder", sa.String(128), nullable=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_borrow_events")),
    )
    for col in ("replica_id", "event", "at"):
        op.create_index(op.f(f"ix_borrow_events_{col}"), "borrow_events", [col])


def downgrade() -> None:
    for col in ("replica_id", "event", "at"):
        op.drop_index(op.f(f"ix_borrow_events_{col}"), table_name="borrow_events")
    op.drop_table("borrow_events")
    for col in ("pool", "expires_at"):
        op.drop_index(op.f(f"ix_replica_leases_{col}"), table_name="replica_leases")
    op.drop_table("replica_leases")
    for col in ("name", "state", "chain_id", "created_at"):
        op.drop_index(op.f(f"ix_jobs_{col}"), table_name="jobs")
    op.drop_table("jobs")
