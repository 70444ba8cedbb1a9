"""Idempotent, batched writes of validated events, keyed on ``event_id``.

``session.completed`` becomes a :class:`~ingest.tables.SessionRow` with its segments; every other
type becomes a :class:`~ingest.tables.SignalRow` with its type-specific number in ``value``
(:func:`signal_value`). An ``event_id`` already stored, or seen earlier in the same batch, is
recorded in ``duplicates`` and never stored twice. So is a second ``session.completed`` for a
``session_id`` already stored under another ``event_id`` (a producer that re-sent a session with a
fresh id): a session is one rollout and is stored once.

Safety against a concurrent writer comes from ``INSERT .. ON CONFLICT DO NOTHING RETURNING``
(SQLite 3.35+ and PostgreSQL): whatever a racing transaction stored first is counted as a
duplicate here. The consumer calls :func:`write_events`, :func:`write_dead_letters` and
:func:`store_offsets` in one transaction, so rows and offsets commit together.
"""

from __future__ import annotations

import json
import operator
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
from pydantic import BaseModel
from sqlalchemy import JSON, DateTime, Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ingest import fastpath, schemas
from ingest.arrays import pack_floats, pack_ids
from ingest.tables import ConsumerOffsetRow, DeadLetterRow, DuplicateRow, SegmentRow, SessionRow, SignalRow

_CHUNK = 500
_SESSIONS = cast(Table, SessionRow.__table__)
_SEGMENTS = cast(Table, SegmentRow.__table__)
_SIGNALS = cast(Table, SignalRow.__table__)
_DUPLICATES = cast(Table, DuplicateRow.__table__)
_DEAD_LETTERS = cast(Table, DeadLetterRow.__table__)
_OFFSETS = cast(Table, ConsumerOffsetRow.__table__)


@dataclass(frozen=True)
class Delivery:
    """One validated event and where it was read from (``topic=""`` when it came from elsewhere).

    The event is the contract's pydantic model, or its :mod:`ingest.fastpath` mirror (same attributes).
    """

    event: schemas.Event | fastpath.FastEvent
    topic: str = ""
    partition: int = -1
    offset: int = -1


class JsonText(str):
    """A value that is already JSON text (serialized by pydantic-core): bound as it is, never re-encoded."""


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


def _converters(dialect: str, table: Table, cols: list[str]) -> list[Any]:
    """Per column, the value the driver needs, as SQLAlchemy's types would bind it.

    SQLite: timestamps as naive UTC text, JSON as text. PostgreSQL: JSON wrapped for psycopg.
    A :class:`JsonText` value is already JSON and goes as it is. Every other value goes as it is.
    """
    out: list[Any] = []
    for name in cols:
        kind = table.c[name].type
        if isinstance(kind, JSON):
            if dialect == "sqlite":
                out.append(_json_text)
            else:
                from psycopg.types.json import Json

                out.append(_pg_json(Json))
        elif isinstance(kind, DateTime) and dialect == "sqlite":
            memo: dict[datetime, str] = {}

            def as_text(value: datetime | None, memo: dict[datetime, str] = memo) -> str | None:
                if value is None:
                    return None
                text = memo.get(value)
                if text is None:
                    # SQLAlchemy's SQLite format, "%Y-%m-%d %H:%M:%S.%f" (isoformat is faster than strftime)
                    text = memo[value] = value.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
                return text

            out.append(as_text)
        else:
            out.append(None)
    return out


def _json_text(value: Any) -> str:
    return str.__str__(value) if type(value) is JsonText else json.dumps(value)


def _pg_json(wrapper: Any) -> Any:
    def convert(value: Any) -> Any:
        if value is None:
            return None
        if type(value) is JsonText:
            return wrapper(str.__str__(value), dumps=_same)
        return wrapper(value)

    return convert


def _same(text: str) -> str:
    return text


def _driver_error(session: Session) -> type[Exception]:
    """The driver's base exception class (to re-raise as SQLAlchemy's ``DBAPIError``)."""
    if session.get_bind().dialect.name == "postgresql":
        import psycopg

        return psycopg.Error
    return sqlite3.Error


def _cursor(session: Session) -> Any:
    """A driver cursor on the session's connection, inside its transaction."""
    return session.connection().connection.driver_connection.cursor()  # type: ignore[union-attr]


def _driver_executemany(session: Session, table: Table, rows: list[dict[str, Any]], skip_conflicts: bool) -> int:
    """Insert through the driver in the session's transaction; returns the rows inserted.

    SQLAlchemy's per-row bind processing costs more than the insert itself at these batch sizes.
    """
    dialect = session.get_bind().dialect.name
    cols = list(rows[0])
    columns: list[Any] = []
    for name, convert in zip(cols, _converters(dialect, table, cols), strict=True):
        values = list(map(operator.itemgetter(name), rows))
        columns.append(values if convert is None else list(map(convert, values)))
    params = list(zip(*columns, strict=True))
    names = ", ".join(f'"{c}"' for c in cols)
    base_error: type[Exception]
    if dialect == "sqlite":
        verb, marks, tail, base_error = ("INSERT OR IGNORE" if skip_conflicts else "INSERT"), "?", "", sqlite3.Error
    elif dialect == "postgresql":
        import psycopg

        verb, marks, tail, base_error = (
            "INSERT",
            "%s",
            (" ON CONFLICT DO NOTHING" if skip_conflicts else ""),
            psycopg.Error,
        )
    else:
        raise RuntimeError(f"Unsupported database dialect {dialect!r}: use SQLite or PostgreSQL.")
    statement = f'{verb} INTO "{table.name}" ({names}) VALUES ({", ".join([marks] * len(cols))}){tail}'
    cursor = _cursor(session)
    try:
        cursor.executemany(statement, params)
        return int(cursor.rowcount)
    except base_error as exc:  # raised as SQLAlchemy would (OperationalError: locked, connection lost, ...)
        raise DBAPIError.instance(statement, None, exc, base_error) from exc
    finally:
        cursor.close()


def _insert_all(session: Session, table: Table, rows: list[dict[str, Any]]) -> None:
    """Plain batched insert."""
    _driver_executemany(session, table, rows, skip_conflicts=False)


def _naive_utc(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


def _insert_new(session: Session, table: Table, rows: list[dict[str, Any]], received_at: datetime) -> set[str]:
    """Insert rows whose keys may already exist; returns the ``event_id`` of the rows inserted.

    ``INSERT OR IGNORE`` (SQLite) / ``ON CONFLICT DO NOTHING`` (PostgreSQL). The pre-select
    already removed stored ids, so every row goes in unless a concurrent writer stored some of
    them meanwhile (in SQLite's WAL mode that makes this insert fail and the consumer retry);
    then the rows stamped with this batch's ``received_at`` are ours.
    """
    count = _driver_executemany(session, table, rows, skip_conflicts=True)
    keys = {row["event_id"] for row in rows}
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


def _utc(ts: Any) -> datetime:
    """An event's ``occurred_at`` (an aware datetime on both paths: the fast one parses it after decoding) in UTC."""
    return cast(datetime, ts).astimezone(UTC)


def signal_value(event: schemas.Event | fastpath.FastEvent) -> float | None:
    """The number a signal carries in ``signals.value``.

    ``code.retained``: lines_retained / lines_written (None when nothing was written);
    ``feedback.thumbs``: +1 or -1; ``edit.*``: lines; ``candidates.shown``: K;
    ``user.churned``: inactive days; otherwise None.
    """
    payload: Any = event.payload
    kind = event.type
    if kind == schemas.CODE_RETAINED:
        return payload.lines_retained / payload.lines_written if payload.lines_written else None  # type: ignore[no-any-return]
    if kind == schemas.FEEDBACK_THUMBS:
        return float(payload.value)
    if kind in (schemas.EDIT_ACCEPTED, schemas.EDIT_REJECTED):
        return float(payload.lines) if payload.lines is not None else None
    if kind == schemas.CANDIDATES_SHOWN:
        return float(len(payload.session_ids))
    if kind == schemas.USER_CHURNED:
        return float(payload.inactive_days)
    return None


def payload_json(payload: BaseModel | msgspec.Struct) -> JsonText:
    """A payload as JSON text, serialized in one call (unknown fields kept, None left out)."""
    if isinstance(payload, msgspec.Struct):  # the fast path's structs omit None defaults, in field order
        return JsonText(msgspec.json.encode(payload).decode())
    return JsonText(type(payload).__pydantic_serializer__.to_json(payload, exclude_none=True).decode())


def signal_row(event: schemas.Event | fastpath.FastEvent, received_at: datetime) -> dict[str, Any]:
    """Column values of a ``signals`` row for a non-session event."""
    payload = event.payload
    group_id = (
        getattr(payload, "group_id", None)
        if event.type in (schemas.CANDIDATES_SHOWN, schemas.CANDIDATE_SELECTED)
        else None
    )
    return {
        "event_id": event.event_id,
        "type": event.type,
        "session_id": event.session_id,
        "user_id": event.user_id,
        "group_id": group_id,
        "occurred_at": _utc(event.occurred_at),
        "received_at": received_at,
        "horizon_s": payload.horizon_s if event.type == schemas.CODE_RETAINED else None,  # type: ignore[union-attr]
        "value": signal_value(event),
        "payload": payload_json(payload),
    }


def session_rows(
    event: schemas.SessionCompleted | fastpath.SessionCompleted, received_at: datetime
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Column values of the ``sessions`` row and its ``session_segments`` rows."""
    p: Any = event.payload
    assistant = [s for s in p.segments if s.role == "assistant"]
    extra: dict[str, Any] = dict(p.model_extra or {})
    if p.sampling is not None:
        extra["sampling"] = (
            msgspec.to_builtins(p.sampling)
            if isinstance(p.sampling, msgspec.Struct)
            else p.sampling.model_dump(mode="json", exclude_none=True)
        )
    if p.files is not None:
        extra["files"] = [
            {"path": f.path, "lines_added": f.lines_added, "lines_removed": f.lines_removed, **(f.model_extra or {})}
            for f in p.files
        ]
    if p.prompt.model_extra:
        extra["prompt_extra"] = dict(p.prompt.model_extra)
    if any(s.model_extra for s in p.segments):
        extra["segment_extra"] = [dict(s.model_extra or {}) for s in p.segments]
    row = {
        "session_id": event.session_id,
        "event_id": event.event_id,
        "user_id": event.user_id,
        "occurred_at": _utc(event.occurred_at),
        "received_at": received_at,
        "model": p.model,
        "policy_version": p.policy_version,
        "group_id": p.group_id,
        "candidate_index": p.candidate_index,
        "prompt_text": p.prompt.text,
        "prompt_token_ids": pack_ids(p.prompt.token_ids),
        "completion_text": "".join(s.text or "" for s in assistant),
        "num_completion_tokens": sum(len(s.token_ids or ()) for s in assistant),
        "routed_experts": p.experts_npy(),
        "logprobs_mode": (p.sampling.logprobs_mode if p.sampling and p.sampling.logprobs_mode else "raw"),
        "finish_reason": p.finish_reason,
        "latency_ms": p.latency_ms,
        "extra": extra,
    }
    segments = [
        {
            "session_id": event.session_id,
            "idx": i,
            "role": s.role,
            "text": s.text,
            "token_ids": pack_ids(s.token_ids),
            "logprobs": pack_floats(s.logprobs),
        }
        for i, s in enumerate(p.segments)
    ]
    return row, segments


def existing_event_ids(session: Session, event_ids: Iterable[str]) -> set[str]:
    """Which of ``event_ids`` are already stored (as a session or a signal)."""
    ids = list(event_ids)
    found: set[str] = set()
    if not ids:
        return found
    # One statement per chunk through the driver: SQLAlchemy's expanding IN costs more than the lookup.
    mark = "%s" if session.get_bind().dialect.name == "postgresql" else "?"
    cursor = _cursor(session)
    try:
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ", ".join([mark] * len(chunk))
            statement = (
                f'SELECT event_id FROM "{_SESSIONS.name}" WHERE event_id IN ({marks}) '
                f'UNION ALL SELECT event_id FROM "{_SIGNALS.name}" WHERE event_id IN ({marks})'
            )
            try:
                cursor.execute(statement, chunk + chunk)
                found.update(row[0] for row in cursor.fetchall())
            except _driver_error(session) as exc:  # raised as SQLAlchemy would (locked, connection lost, ...)
                raise DBAPIError.instance(statement, None, exc, _driver_error(session)) from exc
    finally:
        cursor.close()
    return found


def write_events(
    session: Session, deliveries: Sequence[Delivery | schemas.Event], received_at: datetime | None = None
) -> WriteResult:
    """Store each event once; count every other delivery of an ``event_id`` as a duplicate."""
    received_at = received_at or datetime.now(UTC)
    items = [d if isinstance(d, Delivery) else Delivery(d) for d in deliveries]
    result = WriteResult()
    if not items:
        return result
    already = existing_event_ids(session, {d.event.event_id for d in items})
    fresh: dict[str, Delivery] = {}
    dupes: list[Delivery] = []
    for d in items:
        if d.event.event_id in already or d.event.event_id in fresh:
            dupes.append(d)
        else:
            fresh[d.event.event_id] = d

    sessions: list[dict[str, Any]] = []
    segments: dict[str, list[dict[str, Any]]] = {}
    signals: list[dict[str, Any]] = []
    for d in fresh.values():
        if d.event.type == schemas.SESSION_COMPLETED:
            row, segs = session_rows(d.event, received_at)  # type: ignore[arg-type]
            if row["session_id"] in segments:  # the same session twice in one batch, under two event ids
                continue  # counted below: not inserted
            sessions.append(row)
            segments[row["session_id"]] = segs
        else:
            signals.append(signal_row(d.event, received_at))

    # A fixed key order keeps two concurrent writers from deadlocking on each other's rows.
    sessions.sort(key=lambda r: r["session_id"])
    signals.sort(key=lambda r: r["event_id"])
    inserted: set[str] = set()
    if sessions:
        inserted |= _insert_new(session, _SESSIONS, sessions, received_at)
        seg_rows = [seg for row in sessions if row["event_id"] in inserted for seg in segments[row["session_id"]]]
        if seg_rows:
            _insert_all(session, _SEGMENTS, seg_rows)
    if signals:
        inserted |= _insert_new(session, _SIGNALS, signals, received_at)
    dupes.extend(d for eid, d in fresh.items() if eid not in inserted)

    if dupes:
        _insert_all(
            session,
            _DUPLICATES,
            [
                {
                    "event_id": d.event.event_id,
                    "topic": d.topic,
                    "partition": d.partition,
                    "offset": d.offset,
                    "received_at": received_at,
                }
                for d in dupes
            ],
        )
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
