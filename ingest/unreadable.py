"""Batches the consumer cannot read: what failed, what to do, and the durable record of it.

A Kafka record batch is compressed and checksummed as a whole. When this process has no library
for its codec (kafka-python decodes snappy, lz4 and zstd only with their packages), or its bytes
are damaged (a CRC mismatch, a payload the codec cannot decompress), none of its records can be
read: there is nothing to store and nothing to dead-letter. The consumer holds that partition at
the batch's offset, so nothing after it is skipped or lost, reads the others, and tries the
batch again after a back-off (:mod:`ingest.consumer`).

Each failed read is recorded here, in the ``unreadable_batches`` table (one row per consumer group
and partition: offset, reason, what to do, failures, first and last time). ``undertow stats
--json`` (:func:`summary`) and the API's ``/metrics`` read it, so the condition is visible where
operators look and survives the process. A partition counts as held while the group's stored
offset has not passed the recorded one.

Left out: skipping a corrupt batch. Which records it held cannot be known, so moving past it is
an operator's decision (see ``docs/operating.md``), not the consumer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Table, and_, case, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import transaction
from ingest.tables import ConsumerOffsetRow, UnreadableBatchRow

CODEC_UNAVAILABLE = "codec_unavailable"
"""The batch's compression codec has no library in this process."""
CORRUPT_BATCH = "corrupt_batch"
"""The batch's bytes are damaged: its CRC does not match, or its payload does not decompress."""

_RECORD_CODE = (Path("kafka") / "record").as_posix()
"""Where kafka-python decodes batches: an error raised from there is about a batch's bytes."""


@dataclass(frozen=True)
class UnreadableBatch:
    """Where a batch could not be read, and why."""

    topic: str
    partition: int
    offset: int
    reason: str
    error: str
    """The client's or the codec's own words."""

    def advice(self) -> str:
        """What failed and what to do, for the log and the record."""
        where = f"topic {self.topic!r} partition {self.partition} at offset {self.offset}"
        if self.reason == CODEC_UNAVAILABLE:
            return (
                f"the batch at {where} is compressed with a codec this consumer cannot decode ({self.error}); "
                "install the codec's library (python-snappy for snappy, lz4, zstandard for zstd: Undertow's "
                "dependencies bring them) and restart ingest. The partition waits at that offset: nothing "
                "after it is stored or lost; other partitions flow."
            )
        return (
            f"the batch at {where} is corrupt ({self.error}): its producer or the broker stored damaged "
            "bytes. The partition waits at that offset: nothing after it is stored or lost; other partitions "
            "flow. Find the producer that wrote it; to move past the batch, see docs/operating.md."
        )


def classify(exc: BaseException) -> str | None:
    """The reason a poll failed on a batch's bytes (:data:`CODEC_UNAVAILABLE`, :data:`CORRUPT_BATCH`), or None.

    Decompression errors are the codec library's own (``zlib.error``, ``OSError``, lz4's
    ``RuntimeError``, ...), so a failure counts as a corrupt batch when it was raised from
    kafka-python's batch decoding code.
    """
    from kafka.errors import CorruptRecordError, UnsupportedCodecError

    if isinstance(exc, UnsupportedCodecError):
        return CODEC_UNAVAILABLE
    if isinstance(exc, CorruptRecordError):
        return CORRUPT_BATCH
    if isinstance(exc, NotImplementedError) and "codec" in str(exc).lower():  # e.g. "Snappy codec is not available"
        return CODEC_UNAVAILABLE
    tb = exc.__traceback__
    while tb is not None:
        if _RECORD_CODE in Path(tb.tb_frame.f_code.co_filename).as_posix():
            return CORRUPT_BATCH
        tb = tb.tb_next
    return None


def record(engine: Engine, group_id: str, batch: UnreadableBatch, at: datetime | None = None) -> None:
    """Record one failed read of ``batch`` for ``group_id`` (its own transaction)."""
    at = at or datetime.now(UTC)
    table = cast(Table, UnreadableBatchRow.__table__)
    with transaction(engine) as session:
        name = session.get_bind().dialect.name
        insert: Any = postgresql.insert(table) if name == "postgresql" else sqlite.insert(table)
        stmt = insert.values(
            group_id=group_id,
            topic=batch.topic,
            partition=batch.partition,
            offset=batch.offset,
            reason=batch.reason,
            detail=batch.advice()[:4000],
            failures=1,
            first_at=at,
            last_at=at,
        )
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=["group_id", "topic", "partition"],
                set_={  # a new offset starts a new stretch: ``first_at`` is when this batch first failed
                    "first_at": case(
                        (table.c.offset == stmt.excluded.offset, table.c.first_at), else_=stmt.excluded.first_at
                    ),
                    "offset": stmt.excluded.offset,
                    "reason": stmt.excluded.reason,
                    "detail": stmt.excluded.detail,
                    "failures": table.c.failures + 1,
                    "last_at": stmt.excluded.last_at,
                },
            )
        )


def _held_rows(session: Session) -> list[UnreadableBatchRow]:
    """Recorded partitions whose group has not stored an offset past the unreadable batch."""
    offsets = ConsumerOffsetRow
    rows = UnreadableBatchRow
    query = (
        select(rows)
        .outerjoin(
            offsets,
            and_(offsets.group_id == rows.group_id, offsets.topic == rows.topic, offsets.partition == rows.partition),
        )
        .where(or_(offsets.next_offset.is_(None), offsets.next_offset <= rows.offset))
        .order_by(rows.topic, rows.partition, rows.group_id)
    )
    return list(session.scalars(query))


def summary(session: Session) -> dict[str, Any]:
    """``unreadable_batches`` of ``undertow stats --json``: failed reads, the latest one, the partitions held."""
    failures = int(session.scalar(select(func.coalesce(func.sum(UnreadableBatchRow.failures), 0))) or 0)
    last = session.scalars(select(UnreadableBatchRow).order_by(UnreadableBatchRow.last_at.desc()).limit(1)).first()
    held = [
        {
            "group_id": r.group_id,
            "topic": r.topic,
            "partition": r.partition,
            "offset": r.offset,
            "reason": r.reason,
            "failures": r.failures,
            "since": r.first_at.isoformat(),
            "last_at": r.last_at.isoformat(),
        }
        for r in _held_rows(session)
    ]
    return {
        "count": failures,
        "last_at": last.last_at.isoformat() if last else None,
        "last_reason": last.reason if last else None,
        "last_topic": last.topic if last else None,
        "last_partition": last.partition if last else None,
        "last_offset": last.offset if last else None,
        "last_detail": last.detail if last else None,
        "held_partitions": held,
    }


def held_counts(session: Session) -> tuple[dict[str, int], list[UnreadableBatchRow]]:
    """Failed reads by reason (all time), and the rows of the partitions held now (for ``/metrics``)."""
    by_reason = dict(
        session.execute(
            select(UnreadableBatchRow.reason, func.sum(UnreadableBatchRow.failures)).group_by(UnreadableBatchRow.reason)
        )
        .tuples()
        .all()
    )
    return {str(k): int(v or 0) for k, v in by_reason.items()}, _held_rows(session)
