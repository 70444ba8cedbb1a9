"""ingest: telemetry tables (sessions, segments, signals, duplicates, dead letters, offsets).

Revision ID: ingest_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ingest_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("ingest",)
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("user_id", sa.String(128), nullable=True),
        sa.Column("occurred_at", TS, nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("policy_version", sa.String(128), nullable=False),
        sa.Column("group_id", sa.String(128), nullable=True),
        sa.Column("candidate_index", sa.Integer(), nullable=True),
        sa.Column("prompt_text", sa.Text(), nullable=True),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("completion_text", sa.Text(), nullable=False),
        sa.Column("num_completion_tokens", sa.Integer(), nullable=False),
        sa.Column("routed_experts", sa.LargeBinary(), nullable=True),
        sa.Column("logprobs_mode", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_sessions")),
        sa.UniqueConstraint("event_id", name=op.f("uq_sessions_event_id")),
    )
    for col in ("user_id", "occurred_at", "policy_version", "group_id"):
        op.create_index(op.f(f"ix_sessions_{col}"), "sessions", [col])

    op.create_table(
        "session_segments",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("logprobs", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.session_id"],
            name=op.f("fk_session_segments_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "idx", name=op.f("pk_session_segments")),
    )

    op.create_table(
        "signals",
        sa.Column("id", BIGINT_PK, nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("session_id", sa.String(128), nullable=True),
        sa.Column("user_id", sa.String(128), nullable=True),
        sa.Column("group_id", sa.String(128), nullable=True),
        sa.Column("occurred_at", TS, nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("horizon_s", sa.Integer(), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_signals")),
        sa.UniqueConstraint("event_id", name=op.f("uq_signals_event_id")),
    )
    for col in ("type", "session_id", "user_id", "group_id", "occurred_at"):
        op.create_index(op.f(f"ix_signals_{col}"), "signals", [col])

    op.create_table(
        "duplicates",
        sa.Column("id", BIGINT_PK, nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_duplicates")),
    )
    op.create_index(op.f("ix_duplicates_event_id"), "duplicates", ["event_id"])

    op.create_table(
        "dead_letters",
        sa.Column("id", BIGINT_PK, nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.LargeBinary(), nullable=True),
        sa.Column("value", sa.LargeBinary(), nullable=True),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("replayed_at", TS, nullable=True),
        sa.Column("replay_count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
    )
    op.create_index(op.f("ix_dead_letters_reason"), "dead_letters", ["reason"])

    op.create_table(
        "consumer_offsets",
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("cluster_id", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("group_id", "topic", "partition", name=op.f("pk_consumer_offsets")),
    )


def downgrade() -> None:
    op.drop_table("consumer_offsets")
    op.drop_index(op.f("ix_dead_letters_reason"), table_name="dead_letters")
    op.drop_table("dead_letters")
    op.drop_index(op.f("ix_duplicates_event_id"), table_name="duplicates")
    op.drop_table("duplicates")
    for col in ("type", "session_id", "user_id", "group_id", "occurred_at"):
        op.drop_index(op.f(f"ix_signals_{col}"), table_name="signals")
    op.drop_table("signals")
    op.drop_table("session_segments")
    for col in ("user_id", "occurred_at", "policy_version", "group_id"):
        op.drop_index(op.f(f"ix_sessions_{col}"), table_name="sessions")
    op.drop_table("sessions")
