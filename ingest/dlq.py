"""The dead-letter store: list what was rejected and why, and replay it after a fix.

Replay re-produces the raw bytes, with their original key, to the telemetry topic; the consumer
validates them again. A message that is still bad becomes a new dead letter; one that is now
valid is stored once (or counted as a duplicate if it had been stored meanwhile). Rows are
marked (``replayed_at``, ``replay_count``) only after the broker acknowledged every send.

When ingest verifies signatures (``ingest.signing_keys``), a replay is signed with the key named by
``ingest.replay_signing_key_id``: an operator's replay is trusted, so a dead letter ``unsigned``
(or ``bad_signature``) passes once replayed. Without that key it is sent unsigned
(:func:`replay_key` says why). Dead letters ``unknown_session`` hold the signal's envelope as JSON
(:mod:`ingest.unmatched`), replayed like any other.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from ingest.config import IngestConfig
from ingest.db import transaction
from ingest.producer import TelemetryProducer
from ingest.signing import SigningKey, keyring
from ingest.tables import DeadLetterRow
from ingest.writer import DeadLetter


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


def replay_key(cfg: IngestConfig) -> tuple[SigningKey | None, str | None]:
    """The key replays are signed with, and, when there is none while ingest verifies signatures, why.

    ``(None, None)``: signing is off (no ``signing_keys``), replays go unsigned and pass as before.
    """
    if not cfg.signing_keys:
        return None, None
    key = keyring(cfg.signing_keys).get(cfg.replay_signing_key_id)
    if key is None:
        return None, (
            f"replay_signing_key_id {cfg.replay_signing_key_id!r} is not one of ingest.signing_keys: replayed "
            "records go unsigned, and ingest dead-letters them again (unsigned)"
        )
    return key, None


def replay(
    engine: Engine,
    producer: TelemetryProducer,
    ids: Sequence[int] | None = None,
    reason: str | None = None,
    include_replayed: bool = False,
    signing_key: SigningKey | None = None,
) -> list[int]:
    """Re-produce the selected dead letters to the telemetry topic; returns the replayed ids.

    With neither ``ids`` nor ``reason`` every not yet replayed dead letter is replayed. With
    ``signing_key`` each replayed value is signed (:func:`replay_key`).
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
    futures = []
    for _, key, value in rows:
        data = value or b""
        headers = signing_key.headers(data) if signing_key is not None else None
        futures.append(producer.send_raw(data, key=key, headers=headers))
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


def topic_headers(dl: DeadLetter) -> list[tuple[str, bytes]]:
    """The headers of a dead letter on the dead-letter topic: its reason and where it was read."""
    return [
        ("reason", dl.reason.encode()),
        ("source_topic", dl.topic.encode()),
        ("source_partition", str(dl.partition).encode()),
        ("source_offset", str(dl.offset).encode()),
    ]


def publish(bootstrap: str, topic: str, letters: Sequence[DeadLetter]) -> int:
    """Send dead letters written to the table to the dead-letter topic too (its mirror); returns how many."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", client_id="undertow-dlq")
    try:
        futures = [producer.send(topic, key=dl.key, value=dl.value, headers=topic_headers(dl)) for dl in letters]
        producer.flush()
        for fut in futures:
            fut.get(timeout=30)
    finally:
        producer.close(timeout=5)
    return len(letters)
