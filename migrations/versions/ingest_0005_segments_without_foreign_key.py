"""ingest: session segments without a foreign key to their session.

Every segment row inserted ran the key's check, a query on ``sessions`` per row: about 4.3 µs of
server time per ingested event on the PostgreSQL ingest benchmark (a sixth of the server's work),
for a guarantee the writer gives already: it stores a session and its segments in one transaction
(binary ``COPY`` of both, or neither), and nothing else writes or deletes them. Removing a session
through the ORM still removes its segments (the relationship's cascade).

Revision ID: ingest_0005
Revises: ingest_0004
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "ingest_0005"
down_revision: str | None = "ingest_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FK = "fk_session_segments_session_id_sessions"


def upgrade() -> None:
    with op.batch_alter_table("session_segments") as batch:  # SQLite rebuilds the table
        batch.drop_constraint(FK, type_="foreignkey")


def downgrade() -> None:
    with op.batch_alter_table("session_segments") as batch:
        batch.create_foreign_key(FK, "sessions", ["session_id"], ["session_id"], ondelete="CASCADE")
