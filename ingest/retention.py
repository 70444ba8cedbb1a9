"""Retention: telemetry older than ``ingest.retention_days`` is deleted (the ``undertow.enforce_retention``
beat job runs :func:`delete_older_than`).

A session goes with its segments and every signal about it (a signal outlives its session only while
it waits for one). Signals without a stored session, dead letters (they hold raw envelopes, prompts
and code included) and duplicate records go by their own timestamps. Labels are computed from
signals, never stored, so they go with them. Deletes run in chunks of :data:`CHUNK` rows, each its
own transaction, so ingest never waits long behind them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.tables import DeadLetterRow, DuplicateRow, SegmentRow, SessionRow, SignalRow

CHUNK = 2000


def _rowcount(result: Any) -> int:
    return int(result.rowcount or 0)


def _delete_sessions(engine: Engine, cutoff: datetime, counts: dict[str, int]) -> None:
    while True:
        with transaction(engine) as session:
            ids = list(
                session.scalars(select(SessionRow.session_id).where(SessionRow.occurred_at < cutoff).limit(CHUNK))
            )
            if not ids:
                return
            counts["session_segments"] += _rowcount(
                session.execute(delete(SegmentRow).where(SegmentRow.session_id.in_(ids)))
            )
            counts["signals"] += _rowcount(session.execute(delete(SignalRow).where(SignalRow.session_id.in_(ids))))
            counts["sessions"] += _rowcount(session.execute(delete(SessionRow).where(SessionRow.session_id.in_(ids))))


def _delete_by_id(engine: Engine, table: Any, stamp: Any, cutoff: datetime, name: str, counts: dict[str, int]) -> None:
    while True:
        with transaction(engine) as session:
            ids = list(session.scalars(select(table.id).where(stamp < cutoff).limit(CHUNK)))
            if not ids:
                return
            counts[name] += _rowcount(session.execute(delete(table).where(table.id.in_(ids))))


def delete_older_than(engine: Engine, cutoff: datetime) -> dict[str, int]:
    """Delete telemetry older than ``cutoff`` (see the module docstring); rows deleted per table."""
    counts = dict.fromkeys(("sessions", "session_segments", "signals", "dead_letters", "duplicates"), 0)
    _delete_sessions(engine, cutoff, counts)
    _delete_by_id(engine, SignalRow, SignalRow.occurred_at, cutoff, "signals", counts)
    _delete_by_id(engine, DeadLetterRow, DeadLetterRow.created_at, cutoff, "dead_letters", counts)
    _delete_by_id(engine, DuplicateRow, DuplicateRow.received_at, cutoff, "duplicates", counts)
    return counts
