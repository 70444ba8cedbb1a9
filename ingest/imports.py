"""What every file importer shares: the result, rows skipped with their reasons, and the checks an event passes.

An importer (:mod:`ingest.realhumaneval`, :mod:`ingest.table_import`) reads a file row by row into
wire-contract envelopes. A row that cannot become events raises :class:`BadRow` with the reason; the
importer records it as a :class:`SkippedRow` and goes on, so one bad row loses nothing else. A file it
cannot read at all (no header, a mapped column missing) raises :class:`FormatError` before any row.
"""

from __future__ import annotations

import contextlib
import csv
import json
import unicodedata
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ingest import schemas

CSV_FIELD_LIMIT = 64 << 20
"""The CSV reader's field limit while reading; a longer field is an unreadable record."""


class FormatError(ValueError):
    """The file is not in the format the importer reads: nothing was read."""


class BadRow(ValueError):
    """A row that cannot become events; its message is the reason reported."""


@dataclass(frozen=True)
class SkippedRow:
    """A row left out: ``row`` counts data records from 1 (the header is not one), ``line`` is where it starts."""

    row: int
    line: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"row": self.row, "line": self.line, "reason": self.reason}


@dataclass
class ImportResult:
    """The envelopes of the rows read (each row's session, then its signal), and the rows skipped."""

    events: list[dict[str, Any]] = field(default_factory=list)
    rows: int = 0
    """Data records read (skipped ones included)."""
    skipped: list[SkippedRow] = field(default_factory=list)

    def count(self, kind: str) -> int:
        """Events of one type."""
        return sum(1 for e in self.events if e["type"] == kind)

    @property
    def sessions(self) -> int:
        return self.count(schemas.SESSION_COMPLETED)

    @property
    def signals(self) -> int:
        return len(self.events) - self.sessions

    @property
    def conversations(self) -> int:
        return len({e["payload"]["conversation_id"] for e in self.events if e["type"] == schemas.SESSION_COMPLETED})

    def summary(self) -> dict[str, Any]:
        """Counts and the skipped rows with their reasons, as plain data."""
        return {
            "rows": self.rows,
            "sessions": self.sessions,
            "signals": self.signals,
            "accepted": self.count(schemas.EDIT_ACCEPTED),
            "rejected": self.count(schemas.EDIT_REJECTED),
            "conversations": self.conversations,
            "users": len({e["user_id"] for e in self.events}),
            "skipped": len(self.skipped),
            "skipped_rows": [s.as_dict() for s in self.skipped],
        }


@contextlib.contextmanager
def csv_field_limit(limit: int) -> Iterator[None]:
    """Raise the CSV module's (process-wide) field limit while reading, then put it back."""
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, limit))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def csv_records(reader: Any) -> Iterator[tuple[int, list[str] | BadRow]]:
    """Each data record of a ``csv.reader`` (past its header) with the line it starts on, blank lines left
    out; a record the reader cannot parse comes as a :class:`BadRow` and the next one is read."""
    line = reader.line_num
    while True:
        start = line + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            line = reader.line_num
            yield start, BadRow(f"unreadable CSV record: {exc}")
            continue
        line = reader.line_num
        if cells:
            yield start, cells


def check_text(name: str, value: str, max_bytes: int) -> None:
    """A cell's text is valid UTF-8 (no lone surrogate from undecodable bytes) and fits in one event."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadRow(f"{name} is not valid UTF-8 text") from None
    if size > max_bytes:
        raise BadRow(f"oversized: {name} is {size:,} bytes; one event carries at most {max_bytes:,}")


def yesterday() -> datetime:
    """00:00 UTC yesterday: the default start of imported data whose times are offsets or absent. Recent
    enough for ``ingest.retention_days`` and in the past, so reward training windows hold it."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=1)


def stable_id(namespace: uuid.UUID, *parts: str) -> str:
    """A uuid5 of ``parts``: the same row gives the same id on every import, so ingest stores it once."""
    return str(uuid.uuid5(namespace, "\x1f".join(parts)))


def plain_name(field_name: str, value: str) -> str:
    """A model or task name: at most 128 characters, no control characters (NUL, escapes, newlines)."""
    name = value.strip()
    if len(name) > 128:
        raise BadRow(f"{field_name} is {len(name)} characters; at most 128")
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise BadRow(f"{field_name} {name[:40]!r} contains control characters (NUL, escapes or newlines)")
    return name


def checked(event: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """``event`` once it validates against the contract and fits ``max_bytes`` on the wire."""
    try:
        json.dumps(event, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRow("a message holds text that is not valid UTF-8 (a lone surrogate)") from None
    try:
        wire = schemas.encode_event(schemas.validate_event(event))
    except schemas.InvalidEvent as exc:
        raise BadRow(f"breaks the wire contract ({exc})") from None
    if len(wire) > max_bytes:
        raise BadRow(f"oversized: its {event['type']} event is {len(wire):,} bytes; the limit is {max_bytes:,}")
    return event
