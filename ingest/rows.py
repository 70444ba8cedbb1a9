"""Events to driver-ready rows: one tuple per row, in each table's column order, built in one pass.

The writer inserts through the database driver (``sqlite3`` or ``psycopg``) with ``executemany``:
SQLAlchemy's per-row bind processing and dict rows cost more than the insert itself at these batch
sizes. So each value is built here as the driver binds it, by a :class:`Codec` per dialect:
timestamps as SQLAlchemy's SQLite text (naive UTC, microseconds) or aware UTC datetimes for
PostgreSQL, JSON columns as JSON text (serialized in C: msgspec for the fast path's structs,
pydantic-core for the contract's models), token ids and logprobs packed by :mod:`ingest.arrays`.

:func:`session_rows` and :func:`signal_row` give the same values as dicts, with plain datetimes
and JSON text (the fast-path tests compare both validation paths through them).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from functools import cache
from typing import Any, cast

import msgspec
from pydantic import BaseModel

from ingest import fastpath, schemas
from ingest.arrays import pack_floats, pack_ids
from ingest.db import as_utc

SESSION_COLUMNS = (
    "session_id",
    "event_id",
    "user_id",
    "occurred_at",
    "received_at",
    "model",
    "policy_version",
    "group_id",
    "candidate_index",
    "prompt_text",
    "prompt_token_ids",
    "completion_text",
    "num_completion_tokens",
    "routed_experts",
    "logprobs_mode",
    "finish_reason",
    "latency_ms",
    "extra",
)
SEGMENT_COLUMNS = ("session_id", "idx", "role", "text", "token_ids", "logprobs")
SIGNAL_COLUMNS = (
    "event_id",
    "type",
    "session_id",
    "user_id",
    "group_id",
    "occurred_at",
    "received_at",
    "horizon_s",
    "value",
    "payload",
)
DUPLICATE_COLUMNS = ("event_id", "topic", "partition", "offset", "received_at")
SESSION_KEY, SESSION_EVENT_ID = 0, 1
"""Positions of ``session_id`` and ``event_id`` in a sessions tuple (``event_id`` is first in signals)."""

Event = schemas.Event | fastpath.FastEvent
Row = tuple[Any, ...]


class JsonText(str):
    """A value that is already JSON text: bound as it is, never re-encoded."""


def sqlite_text(ts: datetime) -> str:
    """SQLAlchemy's SQLite storage of ``DateTime``: naive UTC, ``%Y-%m-%d %H:%M:%S.%f``."""
    return as_utc(ts).replace(tzinfo=None).isoformat(" ", "microseconds")


@dataclass(frozen=True)
class Codec:
    """How one driver binds the values SQLAlchemy's column types would convert."""

    dialect: str
    """``sqlite`` or ``postgresql``."""
    mark: str
    """The driver's parameter placeholder."""
    ts: Callable[[datetime], Any]
    """A timestamp as the driver takes it for a ``DateTime(timezone=True)`` column."""
    json: Callable[[str], Any]
    """JSON text as the driver takes it for a ``JSON`` column."""
    error: type[Exception]
    """The driver's base exception class (re-raised as SQLAlchemy's ``DBAPIError``)."""
    text: Callable[[str | None], str | None] = lambda text: text
    """Free text (prompts, completions, segments) as the database can hold it."""
    redact: Callable[[str | None], str | None] | None = None
    """Secrets redaction (:func:`redacting`), already part of :attr:`text`; also applied to the final text
    of ``code.retained``."""

    @cache  # noqa: B019 (codecs are module-level singletons, never freed)
    def insert(self, table: str, columns: tuple[str, ...], skip_conflicts: bool) -> str:
        """``INSERT`` of one row of ``columns``; with ``skip_conflicts``, a row whose key exists is left out."""
        names = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join([self.mark] * len(columns))
        if self.dialect == "sqlite":
            verb = "INSERT OR IGNORE" if skip_conflicts else "INSERT"
            return f'{verb} INTO "{table}" ({names}) VALUES ({marks})'
        tail = " ON CONFLICT DO NOTHING" if skip_conflicts else ""
        return f'INSERT INTO "{table}" ({names}) VALUES ({marks}){tail}'


def _same(text: str) -> str:
    return text


def no_nul(text: str | None) -> str | None:
    """PostgreSQL text cannot hold NUL: a sampled ``\x00`` is stored as U+FFFD (the token ids keep it exactly)."""
    return text.replace("\x00", "\ufffd") if text and "\x00" in text else text


@cache
def codec_for(dialect: str) -> Codec:
    """The codec of a SQLAlchemy dialect name (SQLite or PostgreSQL)."""
    if dialect == "sqlite":
        return Codec("sqlite", "?", sqlite_text, _same, sqlite3.Error)
    if dialect == "postgresql":
        import psycopg

        # JSON text as it is: binary COPY sends it as the json column's bytes, and psycopg binds a str to the
        # server as untyped text, which the json column parses (no wrapper object per row).
        return Codec("postgresql", "%s", as_utc, _same, psycopg.Error, no_nul)
    raise RuntimeError(f"Unsupported database dialect {dialect!r}: use SQLite or PostgreSQL.")


def redacting(codec: Codec, redact: Callable[[str | None], str | None]) -> Codec:
    """``codec`` with every free text (and ``code.retained``'s final text) passed through ``redact`` first."""
    base = codec.text
    return replace(codec, text=lambda text: base(redact(text)), redact=redact)


_PLAIN = Codec("plain", "?", as_utc, JsonText, Exception)
"""Values as SQLAlchemy's types take them (for :func:`session_rows` and :func:`signal_row`)."""


def signal_value(event: Event) -> float | None:
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


_GROUPED = (schemas.CANDIDATES_SHOWN, schemas.CANDIDATE_SELECTED)


def signal_values(event: Event, received: Any, codec: Codec) -> Row:
    """A ``signals`` row (:data:`SIGNAL_COLUMNS`) for a non-session event; ``received`` is already bound."""
    payload: Any = event.payload
    kind = event.type
    if codec.redact is not None and kind == schemas.CODE_RETAINED and payload.final_text:
        final_text = codec.redact(payload.final_text)
        if isinstance(payload, msgspec.Struct):
            payload = msgspec.structs.replace(payload, final_text=final_text)
        else:
            payload = payload.model_copy(update={"final_text": final_text})
    return (
        event.event_id,
        kind,
        event.session_id,
        event.user_id,
        payload.group_id if kind in _GROUPED else None,
        codec.ts(cast(datetime, event.occurred_at)),  # the fast path parses it after decoding
        received,
        payload.horizon_s if kind == schemas.CODE_RETAINED else None,
        signal_value(event),
        codec.json(payload_json(payload)),
    )


def extra_json(p: schemas.SessionCompletedPayload | fastpath.SessionCompletedPayload) -> str:
    """``sessions.extra``: the agent-session turn, sampling parameters, files and unknown payload
    fields, as JSON text."""
    if isinstance(p, fastpath.SessionCompletedPayload):  # no unknown fields anywhere: sampling and files only
        if p.sampling is None and p.files is None and p.turn is None:
            return "{}"
        fast: dict[str, Any] = {}
        if p.turn is not None:
            fast["turn"] = p.turn
        if p.sampling is not None:
            fast["sampling"] = p.sampling  # encoded without its None fields (omit_defaults)
        if p.files is not None:
            fast["files"] = p.files
        return msgspec.json.encode(fast).decode()
    extra: dict[str, Any] = dict(p.model_extra or {})
    if p.turn is not None:
        extra["turn"] = p.turn.model_dump(mode="json", exclude_none=True)
    if p.sampling is not None:
        extra["sampling"] = p.sampling.model_dump(mode="json", exclude_none=True)
    if p.files is not None:
        extra["files"] = [
            {"path": f.path, "lines_added": f.lines_added, "lines_removed": f.lines_removed, **(f.model_extra or {})}
            for f in p.files
        ]
    if p.prompt.model_extra:
        extra["prompt_extra"] = dict(p.prompt.model_extra)
    if any(s.model_extra for s in p.segments):
        extra["segment_extra"] = [dict(s.model_extra or {}) for s in p.segments]
    return json.dumps(extra)


def session_values(
    event: schemas.SessionCompleted | fastpath.SessionCompleted, received: Any, codec: Codec
) -> tuple[Row, list[Row]]:
    """The ``sessions`` row (:data:`SESSION_COLUMNS`) and its ``session_segments`` rows (:data:`SEGMENT_COLUMNS`)."""
    p: Any = event.payload
    sid = event.session_id
    completion: list[str] = []
    n_tokens = 0
    segments: list[Row] = []
    for i, s in enumerate(p.segments):
        if s.role == "assistant":
            if s.text:
                completion.append(s.text)
            if s.token_ids:
                n_tokens += len(s.token_ids)
        segments.append((sid, i, s.role, codec.text(s.text), pack_ids(s.token_ids), pack_floats(s.logprobs)))
    sampling = p.sampling
    row = (
        sid,
        event.event_id,
        event.user_id,
        codec.ts(cast(datetime, event.occurred_at)),  # the fast path parses it after decoding
        received,
        p.model,
        p.policy_version,
        p.group_id,
        p.candidate_index,
        codec.text(p.prompt.text),
        pack_ids(p.prompt.token_ids),
        codec.text("".join(completion)),
        n_tokens,
        p.experts_npy(),
        sampling.logprobs_mode if sampling is not None and sampling.logprobs_mode else "raw",
        p.finish_reason,
        p.latency_ms,
        codec.json(extra_json(p)),
    )
    return row, segments


def session_rows(
    event: schemas.SessionCompleted | fastpath.SessionCompleted, received_at: datetime
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:func:`session_values` as dicts (UTC datetimes, ``extra`` as JSON text)."""
    row, segments = session_values(event, as_utc(received_at), _PLAIN)
    return dict(zip(SESSION_COLUMNS, row, strict=True)), [dict(zip(SEGMENT_COLUMNS, s, strict=True)) for s in segments]


def signal_row(event: Event, received_at: datetime) -> dict[str, Any]:
    """:func:`signal_values` as a dict (UTC datetimes, ``payload`` as JSON text)."""
    return dict(zip(SIGNAL_COLUMNS, signal_values(event, as_utc(received_at), _PLAIN), strict=True))
