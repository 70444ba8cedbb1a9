"""ingest: drop the indexes no query uses (every insert paid for them).

``sessions.user_id``, ``sessions.group_id`` and ``signals.user_id`` are only ever read as
columns, never filtered, joined or sorted on; ``signals.occurred_at`` is only a sort key of a
full read. The indexes that queries seek on stay: ``sessions.occurred_at`` and
``sessions.policy_version`` (time windows, version filters), ``signals.type``,
``signals.session_id`` and ``signals.group_id`` (label queries and joins), and both ``event_id``
unique constraints (idempotency).

Revision ID: ingest_0002
Revises: ingest_0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

from alembic import op

revision: str = "ingest_0002"
down_revision: str | None = "ingest_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DROPPED = (("sessions", "user_id"), ("sessions", "group_id"), ("signals", "user_id"), ("signals", "occurred_at"))


def upgrade() -> None:
    for table, col in DROPPED:
        op.drop_index(op.f(f"ix_{table}_{col}"), table_name=table)


def downgrade() -> None:
    for table, col in DROPPED:
        op.create_index(op.f(f"ix_{table}_{col}"), table, [col])
