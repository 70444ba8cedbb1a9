"""Counts behind ``undertow stats --json`` (CONTRACTS.md section 2).

``events`` counts distinct stored events by type (each ``event_id`` once: sessions and signals
are stored once by construction); ``duplicates`` counts deliveries of an already stored
``event_id``; ``dead_letters`` counts rows in the dead-letter store, replayed or not.
``unreadable_batches`` (added to the contract's keys) tells about batches the consumer could not
read (:func:`ingest.unreadable.summary`): failed reads, the latest one, and the partitions held.
``unknown_session_dead_letters`` (added too, present once non-zero, as ``events`` lists only the
types stored) counts the signals the sweep moved to the dead letters because their session never
arrived (:mod:`ingest.unmatched`); they are among ``dead_letters``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.schemas import SESSION_COMPLETED
from ingest.tables import DeadLetterRow, DuplicateRow, SessionRow, SignalRow
from ingest.unmatched import UNKNOWN_SESSION
from ingest.unreadable import summary


def stats(engine: Engine) -> dict[str, Any]:
    """``{"events": {"<type>": n}, "sessions": n, "duplicates": n, "dead_letters": n, "unreadable_batches": {...}}``,
    with ``"unknown_session_dead_letters": n`` once there are any."""
    with transaction(engine) as session:
        sessions = int(session.scalar(select(func.count()).select_from(SessionRow)) or 0)
        by_type = dict(session.execute(select(SignalRow.type, func.count()).group_by(SignalRow.type)).tuples().all())
        duplicates = int(session.scalar(select(func.count()).select_from(DuplicateRow)) or 0)
        dead_letters = int(session.scalar(select(func.count()).select_from(DeadLetterRow)) or 0)
        unknown = select(func.count()).select_from(DeadLetterRow).where(DeadLetterRow.reason == UNKNOWN_SESSION)
        unknown_session = int(session.scalar(unknown) or 0) if dead_letters else 0
        unreadable = summary(session)
    events: dict[str, int] = {SESSION_COMPLETED: sessions} if sessions else {}
    events.update({str(k): int(v) for k, v in sorted(by_type.items())})
    out: dict[str, Any] = {
        "events": events,
        "sessions": sessions,
        "duplicates": duplicates,
        "dead_letters": dead_letters,
        "unreadable_batches": unreadable,
    }
    if unknown_session:
        out["unknown_session_dead_letters"] = unknown_session
    return out
