"""ingest: PostgreSQL storage for bulk ingest: lz4 for the binary columns, byte order for indexed identifiers.

Two costs of every ingested row, measured on the ingest benchmark (server time per event):

- A session's ``routed_experts`` (about 2 KB) is over PostgreSQL's TOAST threshold, so each insert
  compressed it with pglz, the default: about 10 µs, a fifth of the whole write. lz4 compresses
  the same bytes several times faster. Values stored before keep their compression (both are
  read). Left as it is on a server built without lz4 (``default_toast_compression`` does not
  offer it then).
- The identifiers that are keys or indexed (event, session and group ids, types, versions) were
  compared with the database's linguistic collation at every index insert and lookup (about
  2.5 µs per event). They are opaque strings, matched only for equality: ``COLLATE "C"`` compares
  their bytes. Ordering by them (never relied on) becomes byte order.

Nothing changes on SQLite.

Revision ID: ingest_0003
Revises: ingest_0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ingest_0003"
down_revision: str | None = "ingest_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BINARY = (
    ("sessions", "prompt_token_ids"),
    ("sessions", "routed_experts"),
    ("session_segments", "token_ids"),
    ("session_segments", "logprobs"),
)
IDENTIFIERS = (
    ("sessions", "session_id", 128),
    ("sessions", "event_id", 128),
    ("sessions", "policy_version", 128),
    ("session_segments", "session_id", 128),
    ("signals", "event_id", 128),
    ("signals", "type", 32),
    ("signals", "session_id", 128),
    ("signals", "group_id", 128),
    ("duplicates", "event_id", 128),
)


def _postgres() -> bool:
    return bool(op.get_bind().dialect.name == "postgresql")


def _offers_lz4() -> bool:
    query = sa.text("SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'")
    return bool(op.get_bind().execute(query).scalar())


def _collate(collation: str) -> None:
    for table in dict.fromkeys(table for table, _, _ in IDENTIFIERS):
        changes = ", ".join(
            f'ALTER COLUMN "{column}" TYPE varchar({length}) COLLATE "{collation}"'
            for name, column, length in IDENTIFIERS
            if name == table
        )
        op.execute(f'ALTER TABLE "{table}" {changes}')


def upgrade() -> None:
    if not _postgres():
        return
    if _offers_lz4():
        for table, column in BINARY:
            op.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" SET COMPRESSION lz4')
    _collate("C")


def downgrade() -> None:
    if not _postgres():
        return
    _collate("default")
    if _offers_lz4():
        for table, column in BINARY:
            op.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" SET COMPRESSION default')
