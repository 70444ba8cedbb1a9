"""Idempotent, batched writes of validated events, keyed on ``event_id``.

``session.completed`` becomes a :class:`~ingest.tables.SessionRow` with its segments; every other
type becomes a :class:`~ingest.tables.SignalRow` with its type-specific number in ``value``
(:func:`~ingest.rows.signal_value`). An ``event_id`` already stored, or seen earlier in the same
batch, is recorded in ``duplicates`` and never stored twice. So is a second ``session.completed``
for a ``session_id`` already stored under another ``event_id`` (a producer that re-sent a session
with a fresh id): a session is one rollout and is stored once.

The hot inserts go through the driver's ``executemany`` with rows built by :mod:`ingest.rows`, in
the session's transaction; everything else goes through SQLAlchemy. Safety against a concurrent
writer comes from ``INSERT OR IGNORE`` (SQLite) / ``INSERT .. ON CONFLICT DO NOTHING``
(PostgreSQL): whatever a racing transaction stored first is counted as a duplicate here. The
consumer calls :func:`write_events`, :func:`write_dead_letters` and :func:`store_offsets` in one
transaction, so rows and offsets commit together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ingest import fastpath, schemas
from ingest.rows import (
    DUPLICATE_COLUMNS,
    SEGMENT_COLUMNS,
    SESSION_COLUMNS,
    SESSION_EVENT_ID,
    SESSION_KEY,
    SIGNAL_COLUMNS,
    Codec,
    JsonText,
    Row,
    codec_for,
    payload_json,
    session_rows,
    session_values,
    signal_row,
    signal_value,
    signal_values,
)
from ingest.tables import ConsumerOffsetRow, DeadLetterRow, DuplicateRow, SegmentRow, SessionRow, SignalRow

__all__ = [
    "DeadLetter",
    "Delivery",
    "JsonText",
    "PreparedEvents",
    "WriteResult",
    "existing_event_ids",
    "load_offsets",
    "payload_json",
    "prepare_events",
    "session_rows",
    "signal_row",
    "signal_value",
    "store_offsets",
    "write_dead_letters",
    "write_events",
    "write_prepared",
]

_CHUNK = 500
_SESSIONS = cast(Table, SessionRow.__table__)
_SEGMENTS = cast(Table, SegmentRow.__table__)
_SIGNALS = cast(Table, SignalRow.__table__)
_DUPLICATES = cast(Table, DuplicateRow.__table__)
_DEAD_LETTERS = cast(Table, DeadLetterRow.__table__)
_OFFSETS = cast(Table, ConsumerOffsetRow.__table__)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One validated event and where it was read from (``topic=""`` when it came from elsewhere).

    The event is the contract's pydantic model, or its :mod:`ingest.fastpath` mirror (same attributes).
    """

    event: schemas.Event | fastpath.FastEvent
    topic: str = ""
    partition: int = -1
    offset: int = -1


@dataclass(frozen=True)
class DeadLetter:
    """A message that broke the contract: raw bytes, where it was read, and why."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str
    detail: str = ""


@dataclass
class WriteResult:
    """What one batch did: events stored, deliveries counted as duplicates, their event ids."""

    stored: int = 0
    duplicates: int = 0
    stored_ids: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)


def _insert(session: Session, table: Table) -> Any:
    """A dialect ``INSERT`` that supports ``ON CONFLICT``."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise RuntimeError(f"Unsupported database dialect {name!r}: use SQLite or PostgreSQL.")


def _codec(session: Session) -> Codec:
    return codec_for(session.get_bind().dialect.name)


def _cursor(session: Session) -> Any:
    """A driver cursor on the session's connection, inside its transaction."""
    return session.connection().connection.driver_connection.cursor()  # type: ignore[union-attr]


def _executemany(
    session: Session, codec: Codec, table: Table, columns: tuple[str, ...], rows: list[Row], skip_conflicts: bool
) -> int:
    """Insert ``rows`` (tuples in ``columns`` order) through the driver; returns the rows inserted."""
    statement = codec.insert(table.name, columns, skip_conflicts)
    cursor = _cursor(session)
    try:
        cursor.executemany(statement, rows)
        return int(cursor.rowcount)
    except codec.error as exc:  # raised as SQLAlchemy would (OperationalError: locked, connection lost, ...)
        raise DBAPIError.instance(statement, None, exc, codec.error) from exc
    finally:
        cursor.close()


def _naive_utc(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


def _insert_new(
    session: Session,
    codec: Codec,
    table: Table,
    columns: tuple[str, ...],
    rows: list[Row],
    key: int,
    received_at: datetime,
) -> set[str]:
    """Insert rows whose keys may already exist; returns the ``event_id`` (at ``key``) of the rows inserted.

    The pre-select already removed stored ids, so every row goes in unless a concurrent writer
    stored some of them meanwhile (in SQLite's WAL mode that makes this insert fail and the
    consumer retry); then the rows stamped with this batch's ``received_at`` are ours.
    """
    count = _executemany(session, codec, table, columns, rows, skip_conflicts=True)
    keys = set(map(itemgetter(key), rows))
    if count == len(rows):
        return keys
    ours: set[str] = set()
    ids = list(keys)
    stamp = _naive_utc(received_at)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        query = select(table.c.event_id, table.c.received_at).where(table.c.event_id.in_(chunk))
        ours.update(eid for eid, at in session.execute(query) if _naive_utc(at) == stamp)
    return ours


def existing_event_ids(session: Session, event_ids: Iterable[str]) -> set[str]:
    """Which of ``event_ids`` are already stored (as a session or a signal)."""
    ids = list(event_ids)
    found: set[str] = set()
    if not ids:
        return found
    # One statement per chunk through the driver: SQLAlchemy's expanding IN costs more than the lookup.
    # Never a prepared statement on PostgreSQL: psycopg prepares a statement from its fifth run, and
    # the generic plan made while a fresh table was nearly empty scans it whole, every batch, as
    # it grows (measured: 60,000 events ingested at a third of the rate of 20,000).
    codec = _codec(session)
    options = {"prepare": False} if codec.dialect == "postgresql" else {}
    cursor = _cursor(session)
    try:
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ", ".join([codec.mark] * len(chunk))
            statement = (
                f'SELECT event_id FROM "{_SESSIONS.name}" WHERE event_id IN ({marks}) '
                f'UNION ALL SELECT event_id FROM "{_SIGNALS.name}" WHERE event_id IN ({marks})'
            )
            try:
                cursor.execute(statement, chunk + chunk, **options)
                found.update(row[0] for row in cursor.fetchall())
            except codec.error as exc:  # raised as SQLAlchemy would (locked, connection lost, ...)
                raise DBAPIError.instance(statement, None, exc, codec.error) from exc
    finally:
        cursor.close()
    return found


@dataclass
class PreparedEvents:
    """A batch's rows, built before the transaction (:func:`prepare_events`), written by :func:`write_prepared`."""

    codec: Codec
    received_at: datetime
    items: list[Delivery]
    """Every delivery, in order."""
    first: dict[str, tuple[Delivery, Row, list[Row] | None]]
    """Per ``event_id``, its first delivery with its row (and segment rows for a session), in order."""


@dataclass(frozen=True, slots=True)
class EventRef:
    """What :func:`write_prepared` reads of an event once its rows are built: its id."""

    event_id: str


PackedEvents = tuple[str, datetime, list[tuple[str, str, int, int]], list[tuple[str, Row, list[Row] | None]]]
"""A :class:`PreparedEvents` as plain tuples: sent between processes (cheap to pickle).
Producer: the validating process of :mod:`ingest.batches`; consumer: its writer process."""


def pack_prepared(prepared: PreparedEvents) -> PackedEvents:
    """The rows and delivery coordinates of a prepared batch, without the events themselves."""
    items = [(d.event.event_id, d.topic, d.partition, d.offset) for d in prepared.items]
    first = [(eid, row, segs) for eid, (_, row, segs) in prepared.first.items()]
    return prepared.codec.dialect, prepared.received_at, items, first


def unpack_prepared(packed: PackedEvents) -> PreparedEvents:
    """:func:`pack_prepared` undone, with :class:`EventRef` in place of each event."""
    dialect, received_at, items, first = packed
    deliveries = [Delivery(cast(Any, EventRef(eid)), topic, part, offset) for eid, topic, part, offset in items]
    by_id: dict[str, Delivery] = {}
    for d in deliveries:
        by_id.setdefault(d.event.event_id, d)
    rows = {eid: (by_id[eid], row, segs) for eid, row, segs in first}
    return PreparedEvents(codec_for(dialect), received_at, deliveries, rows)


def prepare_events(
    codec: Codec, deliveries: Sequence[Delivery | schemas.Event], received_at: datetime | None = None
) -> PreparedEvents:
    """Build the rows of a batch (no database needed: a writer prepares the next batch while one commits)."""
    received_at = received_at or datetime.now(UTC)
    received = codec.ts(received_at)
    items = [d if isinstance(d, Delivery) else Delivery(d) for d in deliveries]
    first: dict[str, tuple[Delivery, Row, list[Row] | None]] = {}
    for d in items:
        event = d.event
        if event.event_id in first:
            continue
        if event.type == schemas.SESSION_COMPLETED:
            row, segs = session_values(event, received, codec)  # type: ignore[arg-type]
            first[event.event_id] = (d, row, segs)
        else:
            first[event.event_id] = (d, signal_values(event, received, codec), None)
    return PreparedEvents(codec, received_at, items, first)


def write_events(
    session: Session, deliveries: Sequence[Delivery | schemas.Event], received_at: datetime | None = None
) -> WriteResult:
    """Store each event once; count every other delivery of an ``event_id`` as a duplicate."""
    return write_prepared(session, prepare_events(_codec(session), deliveries, received_at))


def write_prepared(session: Session, prepared: PreparedEvents) -> WriteResult:
    """:func:`write_events` for rows built by :func:`prepare_events` (with this session's dialect)."""
    result = WriteResult()
    items, codec, received_at = prepared.items, prepared.codec, prepared.received_at
    if not items:
        return result
    already = existing_event_ids(session, prepared.first)
    fresh: dict[str, Delivery] = {}
    dupes: list[Delivery] = []
    for d in items:
        eid = d.event.event_id
        if eid in already or eid in fresh:
            dupes.append(d)
        else:
            fresh[eid] = d

    sessions: list[Row] = []
    segments: dict[str, list[Row]] = {}
    signals: list[Row] = []
    for eid in fresh:
        _, row, segs = prepared.first[eid]
        if segs is None:
            signals.append(row)
        elif row[SESSION_KEY] not in segments:  # else the same session twice in one batch, under two event ids:
            sessions.append(row)  # counted below, not inserted
            segments[row[SESSION_KEY]] = segs

    # A fixed key order keeps two concurrent writers from deadlocking on each other's rows.
    sessions.sort(key=itemgetter(SESSION_KEY))
    signals.sort(key=itemgetter(0))
    inserted: set[str] = set()
    if sessions:
        inserted |= _insert_new(session, codec, _SESSIONS, SESSION_COLUMNS, sessions, SESSION_EVENT_ID, received_at)
        seg_rows = [seg for row in sessions if row[SESSION_EVENT_ID] in inserted for seg in segments[row[SESSION_KEY]]]
        if seg_rows:
            _executemany(session, codec, _SEGMENTS, SEGMENT_COLUMNS, seg_rows, skip_conflicts=False)
    if signals:
        inserted |= _insert_new(session, codec, _SIGNALS, SIGNAL_COLUMNS, signals, 0, received_at)
    dupes.extend(d for eid, d in fresh.items() if eid not in inserted)

    if dupes:
        received = codec.ts(received_at)
        dupe_rows = [(d.event.event_id, d.topic, d.partition, d.offset, received) for d in dupes]
        _executemany(session, codec, _DUPLICATES, DUPLICATE_COLUMNS, dupe_rows, skip_conflicts=False)
    result.stored = len(inserted)
    result.stored_ids = [eid for eid in fresh if eid in inserted]
    result.duplicates = len(dupes)
    result.duplicate_ids = [d.event.event_id for d in dupes]
    return result


def write_dead_letters(session: Session, letters: Sequence[DeadLetter], created_at: datetime | None = None) -> int:
    """Store dead letters with their raw bytes and reason; returns how many."""
    if not letters:
        return 0
    created_at = created_at or datetime.now(UTC)
    session.execute(
        _DEAD_LETTERS.insert(),
        [
            {
                "topic": dl.topic,
                "partition": dl.partition,
                "offset": dl.offset,
                "key": dl.key,
                "value": dl.value,
                "reason": dl.reason,
                "detail": dl.detail[:4000],
                "created_at": created_at,
                "replayed_at": None,
                "replay_count": 0,
            }
            for dl in letters
        ],
    )
    return len(letters)


def store_offsets(
    session: Session, group_id: str, offsets: Mapping[tuple[str, int], int], cluster_id: str | None = None
) -> None:
    """Upsert the next offset to read per ``(topic, partition)`` for ``group_id`` (on ``cluster_id``'s log)."""
    if not offsets:
        return
    now = datetime.now(UTC)
    rows = [
        {
            "group_id": group_id,
            "topic": t,
            "partition": p,
            "next_offset": o,
            "updated_at": now,
            "cluster_id": cluster_id,
        }
        for (t, p), o in offsets.items()
    ]
    stmt = _insert(session, _OFFSETS)
    stmt = stmt.on_conflict_do_update(
        index_elements=["group_id", "topic", "partition"],
        set_={
            "next_offset": stmt.excluded.next_offset,
            "updated_at": stmt.excluded.updated_at,
            "cluster_id": stmt.excluded.cluster_id,
        },
    )
    session.execute(stmt, rows)


def load_offsets(session: Session, group_id: str, topic: str, cluster_id: str | None = None) -> dict[int, int]:
    """The stored next offset per partition of ``topic`` for ``group_id``.

    With ``cluster_id``, offsets stored under a different cluster id are left out: they point
    into a log that no longer exists (an embedded broker that restarted empty).
    """
    rows = session.execute(
        select(ConsumerOffsetRow.partition, ConsumerOffsetRow.next_offset, ConsumerOffsetRow.cluster_id).where(
            ConsumerOffsetRow.group_id == group_id, ConsumerOffsetRow.topic == topic
        )
    )
    return {int(p): int(o) for p, o, c in rows if cluster_id is None or c is None or c == cluster_id}
