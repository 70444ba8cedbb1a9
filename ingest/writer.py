"""Idempotent, batched writes of validated events, keyed on ``event_id``.

``session.completed`` becomes a :class:`~ingest.tables.SessionRow` with its segments; every other
type becomes a :class:`~ingest.tables.SignalRow` with its type-specific number in ``value``
(:func:`~ingest.rows.signal_value`). An ``event_id`` already stored, or seen earlier in the same
batch, is recorded in ``duplicates`` and never stored twice. So is a second ``session.completed``
for a ``session_id`` already stored under another ``event_id`` (a producer that re-sent a session
with a fresh id): a session is one rollout and is stored once.

The hot inserts go through the driver with rows built by :mod:`ingest.rows`, in the session's
transaction; everything else goes through SQLAlchemy. First one lookup finds which ``event_id``
are stored already; then:

- PostgreSQL: the new rows go in with binary ``COPY`` (one round trip per table, no statement per
  row), inside a savepoint. ``COPY`` cannot skip a conflicting row, so a row that a concurrent
  writer stored since the lookup (or a session re-sent under a fresh ``event_id``) fails it: the
  savepoint is rolled back and the batch takes the SQLite path below instead.
- SQLite (and that fallback): ``executemany`` with ``INSERT OR IGNORE`` / ``INSERT .. ON CONFLICT
  DO NOTHING``: whatever a racing transaction stored first is counted as a duplicate here.

The consumer calls :func:`write_events`, :func:`write_dead_letters` and :func:`store_offsets` in
one transaction, so rows and offsets commit together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from operator import itemgetter
from typing import Any, NamedTuple, cast

import msgspec
from sqlalchemy import Table, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ingest import fastpath, schemas
from ingest.forget import count_dropped, forgotten_among, lock_shared
from ingest.pgcopy import RowEncoder
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
    no_nul,
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
    "InFlightKeys",
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


class Delivery(NamedTuple):
    """One validated event and where it was read from (``topic=""`` when it came from elsewhere).

    The event is the contract's pydantic model, or its :mod:`ingest.fastpath` mirror (same attributes).
    A named tuple: one is built per record, and a frozen dataclass costs twice as much to build.
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
    dropped: int = 0
    """Events of forgotten users (:mod:`ingest.forget`): neither stored nor duplicates, counted on their tombstone."""


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
    cursor = _cursor(session)
    if codec.dialect == "postgresql":  # the ids as one JSON array: one short statement, one parameter
        statement = (
            f"WITH ids AS (SELECT json_array_elements_text(%s::json) AS event_id) "
            f'SELECT event_id FROM "{_SESSIONS.name}" WHERE event_id IN (SELECT event_id FROM ids) '
            f'UNION ALL SELECT event_id FROM "{_SIGNALS.name}" WHERE event_id IN (SELECT event_id FROM ids)'
        )
        try:
            cursor.execute(statement, (msgspec.json.encode(ids).decode(),), prepare=False)
            found.update(row[0] for row in cursor.fetchall())
        except codec.error as exc:  # raised as SQLAlchemy would (connection lost, ...)
            raise DBAPIError.instance(statement, None, exc, codec.error) from exc
        finally:
            cursor.close()
        return found
    try:
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ", ".join([codec.mark] * len(chunk))
            statement = (
                f'SELECT event_id FROM "{_SESSIONS.name}" WHERE event_id IN ({marks}) '
                f'UNION ALL SELECT event_id FROM "{_SIGNALS.name}" WHERE event_id IN ({marks})'
            )
            try:
                cursor.execute(statement, chunk + chunk)
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
    copied: tuple[NewRows, dict[str, bytes]] | None = None
    """PostgreSQL: the rows to insert when none of the batch is stored yet, and their binary ``COPY`` streams."""


@dataclass(frozen=True, slots=True)
class EventRef:
    """What :func:`write_prepared` reads of an event once its rows are built: its id."""

    event_id: str


PackedEvents = tuple[
    str,
    datetime,
    list[tuple[str, str, int, int]],
    list[tuple[str, Row, list[Row] | None]],
    tuple["NewRows", dict[str, bytes]] | None,
]
"""A :class:`PreparedEvents` as plain tuples: sent between processes (cheap to pickle).
Producer: the validating process of :mod:`ingest.batches`; consumer: its writer process."""


def pack_prepared(prepared: PreparedEvents) -> PackedEvents:
    """The rows and delivery coordinates of a prepared batch, without the events themselves."""
    items = [(d.event.event_id, d.topic, d.partition, d.offset) for d in prepared.items]
    first = [(eid, row, segs) for eid, (_, row, segs) in prepared.first.items()]
    return prepared.codec.dialect, prepared.received_at, items, first, prepared.copied


def unpack_prepared(packed: PackedEvents) -> PreparedEvents:
    """:func:`pack_prepared` undone, with :class:`EventRef` in place of each event."""
    dialect, received_at, items, first, copied = packed
    deliveries = [Delivery(cast(Any, EventRef(eid)), topic, part, offset) for eid, topic, part, offset in items]
    by_id: dict[str, Delivery] = {}
    for d in deliveries:
        by_id.setdefault(d.event.event_id, d)
    rows = {eid: (by_id[eid], row, segs) for eid, row, segs in first}
    return PreparedEvents(codec_for(dialect), received_at, deliveries, rows, copied)


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
    copied = None
    if codec.dialect == "postgresql":
        rows = new_rows(first, set())
        copied = rows, copy_streams(rows)
    return PreparedEvents(codec, received_at, items, first, copied)


def write_events(
    session: Session, deliveries: Sequence[Delivery | schemas.Event], received_at: datetime | None = None
) -> WriteResult:
    """Store each event once; count every other delivery of an ``event_id`` as a duplicate."""
    return write_prepared(session, prepare_events(_codec(session), deliveries, received_at))


@dataclass
class NewRows:
    """The rows a batch inserts: the first delivery of each ``event_id`` not stored yet, a session once."""

    sessions: list[Row]
    """Sorted by ``session_id``: a fixed key order keeps two concurrent writers from deadlocking."""
    segments: dict[str, list[Row]]
    """Per ``session_id`` of :attr:`sessions`, its segment rows."""
    signals: list[Row]
    """Sorted by ``event_id``."""

    def segment_rows(self, event_ids: set[str] | None = None) -> list[Row]:
        """Segment rows of the sessions (of those whose ``event_id`` is in ``event_ids``), in session order."""
        return [
            seg
            for row in self.sessions
            if event_ids is None or row[SESSION_EVENT_ID] in event_ids
            for seg in self.segments[row[SESSION_KEY]]
        ]


@dataclass(frozen=True)
class InFlightKeys:
    """The keys a batch not committed yet may store: a writer with two batches in flight leaves them out of
    the next one (counted as duplicates there), so the two never wait on each other's rows. Should the batch
    before not commit, neither does the next one."""

    event_ids: frozenset[str]
    session_ids: frozenset[str]

    @classmethod
    def of(cls, prepared: PreparedEvents) -> InFlightKeys:
        sessions = (row[SESSION_KEY] for _, row, segs in prepared.first.values() if segs is not None)
        return cls(frozenset(prepared.first), frozenset(sessions))


def new_rows(
    first: Mapping[str, tuple[Delivery, Row, list[Row] | None]],
    stored: set[str],
    pending_sessions: frozenset[str] = frozenset(),
) -> NewRows:
    """The rows to insert for ``first`` (:attr:`PreparedEvents.first`) when ``stored`` event ids exist already
    (and the sessions ``pending_sessions`` are being stored by a batch before)."""
    rows = NewRows([], {}, [])
    for eid, (_, row, segs) in first.items():
        if eid in stored:
            continue
        if segs is None:
            rows.signals.append(row)
        elif row[SESSION_KEY] not in rows.segments and row[SESSION_KEY] not in pending_sessions:
            rows.sessions.append(row)  # else the same session twice in one batch under two event ids, or in
            rows.segments[row[SESSION_KEY]] = segs  # the batch before: counted as a duplicate, not inserted
    rows.sessions.sort(key=itemgetter(SESSION_KEY))
    rows.signals.sort(key=itemgetter(0))
    return rows


def write_prepared(session: Session, prepared: PreparedEvents, pending: InFlightKeys | None = None) -> WriteResult:
    """:func:`write_events` for rows built by :func:`prepare_events` (with this session's dialect); the keys of
    ``pending`` (a batch before, perhaps not committed yet) count as stored."""
    result = WriteResult()
    items, codec, received_at = prepared.items, prepared.codec, prepared.received_at
    if not items:
        return result
    dropped = _forgotten_events(session, prepared)
    already = existing_event_ids(session, prepared.first)
    pending_sessions: frozenset[str] = frozenset()
    if pending is not None:
        already |= pending.event_ids.intersection(prepared.first)
        pending_sessions = pending.session_ids
    fresh: dict[str, Delivery] = {}
    dupes: list[Delivery] = []
    for d in items:
        eid = d.event.event_id
        if eid in dropped:
            continue
        if eid in already or eid in fresh:
            dupes.append(d)
        else:
            fresh[eid] = d

    streams = None
    skipped = already | dropped.keys()
    if prepared.copied is not None and not skipped and pending_sessions.isdisjoint(prepared.copied[0].segments):
        rows, streams = prepared.copied  # built for the batch with nothing stored before
    else:
        rows = new_rows(prepared.first, skipped, pending_sessions)
    if codec.dialect == "postgresql" and _copy_new(session, codec, rows, streams):
        inserted = {row[SESSION_EVENT_ID] for row in rows.sessions} | {row[0] for row in rows.signals}
    else:
        inserted = set()
        if rows.sessions:
            inserted |= _insert_new(
                session, codec, _SESSIONS, SESSION_COLUMNS, rows.sessions, SESSION_EVENT_ID, received_at
            )
            seg_rows = rows.segment_rows(inserted)
            if seg_rows:
                _executemany(session, codec, _SEGMENTS, SEGMENT_COLUMNS, seg_rows, skip_conflicts=False)
        if rows.signals:
            inserted |= _insert_new(session, codec, _SIGNALS, SIGNAL_COLUMNS, rows.signals, 0, received_at)
    dupes.extend(d for eid, d in fresh.items() if eid not in inserted)

    if dupes:
        received = codec.ts(received_at)
        dupe_rows = [(d.event.event_id, d.topic, d.partition, d.offset, received) for d in dupes]
        _executemany(session, codec, _DUPLICATES, DUPLICATE_COLUMNS, dupe_rows, skip_conflicts=False)
    if dropped:
        per_user: dict[str, int] = {}
        for uid in dropped.values():
            per_user[uid] = per_user.get(uid, 0) + 1
        count_dropped(session, per_user)
    result.dropped = len(dropped)
    result.stored = len(inserted)
    result.stored_ids = [eid for eid in fresh if eid in inserted]
    result.duplicates = len(dupes)
    result.duplicate_ids = [d.event.event_id for d in dupes]
    return result


_SESSION_USER = SESSION_COLUMNS.index("user_id")
_SIGNAL_USER = SIGNAL_COLUMNS.index("user_id")


def _forgotten_events(session: Session, prepared: PreparedEvents) -> dict[str, str]:
    """``event_id -> user_id`` of the batch's events whose user was forgotten (after waiting for a forget in
    progress: :func:`ingest.forget.lock_shared`)."""
    lock_shared(session)
    users = {
        eid: row[_SESSION_USER if segs is not None else _SIGNAL_USER] for eid, (_, row, segs) in prepared.first.items()
    }
    forgotten = forgotten_among(session, users.values())
    return {eid: uid for eid, uid in users.items() if uid in forgotten}


_COPY = {
    table.name: RowEncoder(table, columns)
    for table, columns in ((_SESSIONS, SESSION_COLUMNS), (_SEGMENTS, SEGMENT_COLUMNS), (_SIGNALS, SIGNAL_COLUMNS))
}
"""Binary ``COPY`` of each hot table (PostgreSQL)."""


def copy_streams(rows: NewRows) -> dict[str, bytes]:
    """Each hot table's rows as one binary ``COPY`` stream (tables without rows left out)."""
    tables = ((_SESSIONS, rows.sessions), (_SEGMENTS, rows.segment_rows()), (_SIGNALS, rows.signals))
    return {table.name: _COPY[table.name].encode(part) for table, part in tables if part}


def _copy_new(session: Session, codec: Codec, rows: NewRows, copied: dict[str, bytes] | None) -> bool:
    """PostgreSQL: ``COPY`` the new rows (``copied``: their streams, built already); False, with nothing
    written, when one of them was stored meanwhile by a concurrent writer (or a session came again under
    a fresh ``event_id``): ``COPY`` cannot skip a row, so the caller inserts with ``ON CONFLICT`` instead."""
    import psycopg

    streams = copied if copied is not None else copy_streams(rows)
    cursor = _cursor(session)
    try:
        cursor.execute("SAVEPOINT undertow_copy")
        try:
            for name, data in streams.items():
                with cursor.copy(_COPY[name].statement) as copy:
                    copy.write(data)
        except psycopg.errors.UniqueViolation:
            cursor.execute("ROLLBACK TO SAVEPOINT undertow_copy")
            return False
        cursor.execute("RELEASE SAVEPOINT undertow_copy")
        return True
    except codec.error as exc:  # raised as SQLAlchemy would (connection lost, ...)
        raise DBAPIError.instance("COPY", None, exc, codec.error) from exc
    finally:
        cursor.close()


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
                "detail": no_nul(dl.detail[:4000]),  # PostgreSQL text cannot hold NUL
                "created_at": created_at,
                "replayed_at": None,
                "replay_count": 0,
            }
            for dl in letters
        ],
    )
    return len(letters)


_OFFSET_COLUMNS = ("group_id", "topic", "partition", "next_offset", "updated_at", "cluster_id")


@cache
def _offsets_upsert(mark: str, count: int) -> str:
    """The upsert of ``count`` offset rows (the same SQL on SQLite and PostgreSQL)."""
    names = ", ".join(f'"{c}"' for c in _OFFSET_COLUMNS)
    row = "(" + ", ".join([mark] * len(_OFFSET_COLUMNS)) + ")"
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in ("next_offset", "updated_at", "cluster_id"))
    return (
        f'INSERT INTO "{_OFFSETS.name}" ({names}) VALUES {", ".join([row] * count)} '
        f'ON CONFLICT ("group_id", "topic", "partition") DO UPDATE SET {updates}'
    )


def store_offsets(
    session: Session, group_id: str, offsets: Mapping[tuple[str, int], int], cluster_id: str | None = None
) -> None:
    """Upsert the next offset to read per ``(topic, partition)`` for ``group_id`` (on ``cluster_id``'s log).

    One statement through the driver, rows in key order (two writers lock them in the same order).
    """
    if not offsets:
        return
    codec = _codec(session)
    now = codec.ts(datetime.now(UTC))
    params = [v for (t, p), o in sorted(offsets.items()) for v in (group_id, t, p, o, now, cluster_id)]
    statement = _offsets_upsert(codec.mark, len(offsets))
    cursor = _cursor(session)
    try:
        cursor.execute(statement, params)
    except codec.error as exc:  # raised as SQLAlchemy would (locked, connection lost, ...)
        raise DBAPIError.instance(statement, None, exc, codec.error) from exc
    finally:
        cursor.close()


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


def committed_before(
    session: Session,
    prepared: PreparedEvents,
    group_id: str,
    offsets: Mapping[tuple[str, int], int],
    cluster_id: str | None = None,
) -> WriteResult | None:
    """What a batch's earlier try did when its commit went through but the answer was lost (the connection
    dropped during ``COMMIT``); None when it did not commit.

    The stored offsets tell: they commit with the rows and only move forward, so offsets at or past the
    batch's mean its rows are in. Its deliveries are then what that commit made of them: those recorded in
    ``duplicates`` under their topic, partition and offset were duplicates, those of forgotten users were
    dropped, and the rest were stored. Writing the batch again instead would count every event it stored as
    a duplicate of itself.
    """
    if not offsets:
        return None
    topics = {t for t, _ in offsets}
    stored = {(t, p): o for t in topics for p, o in load_offsets(session, group_id, t, cluster_id).items()}
    if any(stored.get(tp, -1) < o for tp, o in offsets.items()):
        return None
    spans: dict[tuple[str, int], list[int]] = {}
    for d in prepared.items:
        spans.setdefault((d.topic, d.partition), []).append(d.offset)
    recorded: set[tuple[str, int, int]] = set()
    for (topic, partition), span in spans.items():
        rows = session.execute(
            select(DuplicateRow.offset).where(
                DuplicateRow.topic == topic,
                DuplicateRow.partition == partition,
                DuplicateRow.offset.between(min(span), max(span)),
            )
        )
        recorded.update((topic, partition, int(o)) for (o,) in rows)
    dropped = _forgotten_events(session, prepared) if prepared.items else {}
    result = WriteResult(dropped=len(dropped))
    for d in prepared.items:
        eid = d.event.event_id
        if (d.topic, d.partition, d.offset) in recorded:
            result.duplicate_ids.append(eid)
        elif eid not in dropped:
            result.stored_ids.append(eid)
    result.stored, result.duplicates = len(result.stored_ids), len(result.duplicate_ids)
    return result
