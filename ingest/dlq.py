"""The dead-letter store: list what was rejected and why, and replay it after a fix.

Replay re-produces the raw bytes, with their original key, to the telemetry topic; the consumer
validates them again. A message that is still bad becomes a new dead letter; one that is now
valid is stored once (or counted as a duplicate if it had been stored meanwhile). Rows are
marked (``replayed_at``, ``replay_count``) only after the broker acknowledged every send.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.producer import TelemetryProducer
from ingest.tables import DeadLetterRow


def list_dead_letters(
    engine: Engine,
    reason: str | None = None,
    ids: Sequence[int] | None = None,
    pending_only: bool = False,
    limit: int | None = 100,
) -> list[dict[str, Any]]:
    """Dead letters, newest first, as plain data (raw value as base64 and a UTF-8 preview)."""
    query = select(DeadLetterRow).order_by(DeadLetterRow.id.desc())
    if reason:
        query = query.where(DeadLetterRow.reason == reason)
    if ids:
        query = query.where(DeadLetterRow.id.in_(list(ids)))
    if pending_only:
        query = query.where(DeadLetterRow.replayed_at.is_(None))
    if limit:
        query = query.limit(limit)
    with transaction(engine) as session:
        rows = session.execute(query).scalars().all()
        return [_as_dict(row) for row in rows]


def _as_dict(row: DeadLetterRow) -> dict[str, Any]:
    value = row.value or b""
    return {
        "id": row.id,
        "topic": row.topic,
        "partition": row.partition,
        "offset": row.offset,
        "reason": row.reason,
        "detail": row.detail,
        "key": row.key.decode("utf-8", "replace") if row.key is not None else None,
        "size": len(value),
        "preview": value[:200].decode("utf-8", "replace"),
        "value_b64": base64.b64encode(value).decode("ascii") if len(value) <= 65536 else None,
        "created_at": row.created_at.isoformat(),
        "replayed_at": row.replayed_at.isoformat() if row.replayed_at else None,
        "replay_count": row.replay_count,
    }


def replay(
    engine: Engine,
    producer: TelemetryProducer,
    ids: Sequence[int] | None = None,
    reason: str | None = None,
    include_replayed: bool = False,
) -> list[int]:
    """Re-produce the selected dead letters to the telemetry topic; returns the replayed ids.

    With neither ``ids`` nor ``reason`` every not yet replayed dead letter is replayed.
    """
    query = select(DeadLetterRow.id, DeadLetterRow.key, DeadLetterRow.value).order_by(DeadLetterRow.id)
    if ids:
        query = query.where(DeadLetterRow.id.in_(list(ids)))
    if reason:
        query = query.where(DeadLetterRow.reason == reason)
    if not include_replayed and not ids:
        query = query.where(DeadLetterRow.replayed_at.is_(None))
    with transaction(engine) as session:
        rows = session.execute(query).all()
    futures = [producer.send_raw(value or b"", key=key) for _, key, value in rows]
    producer.flush()
    for fut in futures:
        fut.get(timeout=30)  # raises if the broker did not take it: nothing is marked then
    done = [int(row_id) for row_id, _, _ in rows]
    if done:
        with transaction(engine) as session:
            session.execute(
                update(DeadLetterRow)
                .where(DeadLetterRow.id.in_(done))
                .values(replayed_at=datetime.now(UTC), replay_count=DeadLetterRow.replay_count + 1)
            )
    return done
