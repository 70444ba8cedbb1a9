"""Any table of answers and adoption labels as telemetry: CSV, TSV or JSON Lines, read by a column mapping.

Logs of code assistants come in many shapes: an export of accepted and rejected suggestions, a study's
chat log, a warehouse query. :func:`read_events` turns one into the envelopes
:mod:`ingest.realhumaneval` makes of its data set, given which column holds what (a
:class:`ColumnMap`, ``role=column``)::

    columns = ColumnMap.parse(["user=programmer", "prompt=prefix", "response=suggestion", "label=accepted"])
    result = read_events("suggestions.jsonl", columns)

Roles (``user`` and ``response`` are required):

- ``user``: who was served (``user_id``, as the file spells it); folds and hold-outs group by it.
- ``response``: the answer shown. ``prompt``: what was asked (empty when not mapped).
- ``label``: whether the user adopted the answer: true, 1, yes, y, accepted or accept is an
  ``edit.accepted``; false, 0, no, n, rejected or reject an ``edit.rejected`` (case-insensitive; in JSON
  Lines also booleans and the numbers 0 and 1); an empty cell or JSON ``null`` is a session without a
  signal, as most production sessions are. Anything else skips the row.
- ``time``: when, read as ``time_format`` says: ``iso`` (ISO 8601; without an offset it is UTC),
  ``unix`` or ``unix_ms`` (epoch seconds or milliseconds), ``offset`` (seconds after ``start``). Not
  mapped: row *n* is ``start`` plus *n* seconds, in file order.
- ``conversation``: rows of one user with the same value are turns of one chat, in time order; their
  sessions carry ``turn = {session_id, index}`` like the gateway's, so reward models see the chat.
- ``model`` (also the ``policy_version``; ``unknown`` when not mapped), ``task`` (``task_name``),
  ``logprob`` (the served mean token logprob, at most 0: ``served_logprobs.mean``, a reward-model
  feature), ``id`` (a row's own id).

Event ids are uuid5 of the row's identity: its ``id`` when mapped, else the user, the time and a hash of
prompt and response. A re-import, whole or in part, sends the same ids and ingest stores nothing twice;
without ``id`` and ``time`` the identity follows the file order. Two rows with one identity: the second
is skipped.

In JSON Lines a column may be a dotted path into nested objects (``meta.user``). Malformed rows (a line
that is not a JSON object, a required cell empty, an unknown label, a time that does not parse, text that
is not UTF-8, an identifier with control characters, an event over ``max_bytes``) are skipped and
reported with their row, line and reason; the other rows are kept. A file whose header lacks a mapped
column raises :class:`FormatError` before any row is read.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import structlog

from ingest import imports, schemas
from ingest.imports import BadRow, FormatError, ImportResult, SkippedRow

log = structlog.get_logger(__name__)

REQUIRED = ("user", "response")
OPTIONAL = ("prompt", "label", "time", "conversation", "model", "task", "logprob", "id")
ROLES = REQUIRED + OPTIONAL
TimeFormat = Literal["iso", "unix", "unix_ms", "offset"]
TIME_FORMATS: tuple[TimeFormat, ...] = ("iso", "unix", "unix_ms", "offset")
FileFormat = Literal["csv", "tsv", "jsonl"]
SUFFIXES: dict[str, FileFormat] = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
ACCEPTED = frozenset({"true", "1", "yes", "y", "accepted", "accept"})
REJECTED = frozenset({"false", "0", "no", "n", "rejected", "reject"})
SOURCE = "table"

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "undertow:import:table")


@dataclass(frozen=True)
class ColumnMap:
    """Which column holds each role (``role -> column``)."""

    columns: dict[str, str]

    @classmethod
    def parse(cls, items: Iterable[str]) -> ColumnMap:
        """From ``role=column`` items (an item may hold several, comma-separated); raises ``ValueError``."""
        columns: dict[str, str] = {}
        for item in (part.strip() for text in items for part in text.split(",")):
            if not item:
                continue
            role, sep, column = item.partition("=")
            role, column = role.strip(), column.strip()
            if not sep or not column:
                raise ValueError(f"{item!r} is not role=column (e.g. user=programmer_id)")
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
            if role in columns:
                raise ValueError(f"role {role!r} is mapped twice")
            columns[role] = column
        missing = [r for r in REQUIRED if r not in columns]
        if missing:
            raise ValueError(f"map the required role(s) {', '.join(missing)} (e.g. user=user_id,response=answer)")
        return cls(columns)


def file_format(path: str | Path, given: str | None = None) -> FileFormat:
    """``given``, or the format the file's suffix names; raises ``ValueError`` when neither says."""
    if given is not None:
        if given not in ("csv", "tsv", "jsonl"):
            raise ValueError(f"unknown format {given!r}; one of csv, tsv, jsonl")
        return given  # type: ignore[return-value]
    fmt = SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell the format of {path} from its suffix; pass csv, tsv or jsonl")
    return fmt


@dataclass
class _Row:
    """One row's values by role, before its events are built."""

    number: int
    line: int
    cells: dict[str, Any]
    occurred_at: datetime
    identity: str
    """What its event ids derive from (:func:`_identity`)."""


def read_events(
    path: str | Path,
    columns: ColumnMap,
    *,
    fmt: str | None = None,
    time_format: str = "iso",
    start: datetime | None = None,
    limit: int | None = None,
    source: str = SOURCE,
    max_bytes: int = schemas.DEFAULT_MAX_BYTES,
) -> ImportResult:
    """Read the table at ``path`` into contract-valid envelopes (plain dicts, validated).

    ``fmt``: csv, tsv or jsonl (default: from the suffix). ``time_format``: how the ``time`` column reads
    (module docstring). ``start``: a timezone-aware instant for ``offset`` times and files without a time
    column (default: 00:00 UTC yesterday). ``limit``: read at most this many data records. ``source``: the
    payload's ``source``. ``max_bytes``: the largest event. Raises :class:`FormatError` when a mapped column
    is missing, ``ValueError`` for bad arguments, ``OSError`` when the file cannot be read.
    """
    if time_format not in TIME_FORMATS:
        raise ValueError(f"unknown time format {time_format!r}; one of {', '.join(TIME_FORMATS)}")
    if start is None:
        start = imports.yesterday()
    if start.tzinfo is None:
        raise ValueError("start must be timezone-aware (e.g. 2024-06-01T00:00:00+00:00)")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    kind = file_format(path, fmt)
    source = imports.plain_name("source", source) or SOURCE
    result = ImportResult()
    rows: list[_Row] = []
    seen: dict[str, int] = {}
    records = _json_records(path, columns) if kind == "jsonl" else _csv_records(path, columns, kind)
    for number, line, cells in records:
        if limit is not None and result.rows >= limit:
            break
        result.rows += 1
        try:
            if isinstance(cells, BadRow):
                raise cells
            checked = _checked_cells(cells, max_bytes)
            when = _when(checked, time_format, start, number)
            row = _Row(number, line, checked, when, _identity(number, checked, when))
            if row.identity in seen:
                raise BadRow(f"the same identity as row {seen[row.identity]} (its id, or user, time and text)")
        except BadRow as exc:
            result.skipped.append(SkippedRow(result.rows, line, str(exc)))
            continue
        seen[row.identity] = number
        rows.append(row)
    turns = _turns(rows)
    for row in rows:
        try:
            result.events.extend(_row_events(row, turns.get(row.number), source, max_bytes))
        except BadRow as exc:
            result.skipped.append(SkippedRow(row.number, row.line, str(exc)))
    result.skipped.sort(key=lambda s: s.row)
    log.info("table_import.read", rows=result.rows, events=len(result.events), skipped=len(result.skipped))
    return result


Record = tuple[int, int, dict[str, Any] | BadRow]
"""``(row number, line, cells by role)``, or the reason the record cannot be read."""


def _csv_records(path: str | Path, columns: ColumnMap, kind: FileFormat) -> Iterator[Record]:
    with (
        imports.csv_field_limit(imports.CSV_FIELD_LIMIT),
        open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as handle,
    ):
        reader = csv.reader(handle, delimiter="\t" if kind == "tsv" else ",")
        header = next(reader, None)
        if header is None:
            raise FormatError(f"{path} is empty; expected a header row naming the columns")
        names = [h.strip() for h in header]
        missing = [f"{c} ({r})" for r, c in columns.columns.items() if c not in names]
        if missing:
            raise FormatError(f"{path}: its header lacks the mapped column(s) {', '.join(missing)}")
        index = {role: names.index(column) for role, column in columns.columns.items()}
        number = 0
        for start, cells in imports.csv_records(reader):
            number += 1
            if isinstance(cells, BadRow):
                yield number, start, cells
                continue
            if len(cells) != len(names):
                yield number, start, BadRow(f"{len(cells)} cells where the header has {len(names)}")
                continue
            yield number, start, {role: cells[i] for role, i in index.items()}


def _json_records(path: str | Path, columns: ColumnMap) -> Iterator[Record]:
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as handle:
        number = 0
        first = True
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            number += 1
            try:
                record = json.loads(text)
            except (ValueError, RecursionError) as exc:
                yield number, line, BadRow(f"not a JSON object: {str(exc)[:120]}")
                continue
            if not isinstance(record, dict):
                yield number, line, BadRow(f"a JSON {type(record).__name__}, not an object")
                continue
            cells = {role: _path(record, column) for role, column in columns.columns.items()}
            if first:  # the first object tells whether a required column is misnamed
                first = False
                absent = [f"{columns.columns[r]} ({r})" for r in REQUIRED if cells[r] is _ABSENT]
                if absent:
                    raise FormatError(f"{path}: its first object lacks the mapped key(s) {', '.join(absent)}")
            yield number, line, {role: (None if value is _ABSENT else value) for role, value in cells.items()}


_ABSENT = object()


def _path(record: dict[str, Any], column: str) -> Any:
    """``record[column]``, or the value a dotted path leads to (``_ABSENT`` when there is none)."""
    if column in record:
        return record[column]
    value: Any = record
    for key in column.split("."):
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


def _checked_cells(cells: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """Text cells as strings within ``max_bytes``; required ones present; raises :class:`BadRow`."""
    out: dict[str, Any] = {}
    for role, value in cells.items():
        if isinstance(value, str):
            imports.check_text(role, value, max_bytes)
        elif value is not None and role in ("user", "response", "prompt", "conversation", "model", "task", "id"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadRow(f"{role} is a JSON {type(value).__name__}, not text")
            value = str(value)
        out[role] = value
    for role in REQUIRED:
        if out.get(role) is None or (role == "user" and not str(out[role]).strip()):
            raise BadRow(f"{role} is empty")
    return out


def _when(cells: dict[str, Any], time_format: str, start: datetime, number: int) -> datetime:
    """The row's time (``start`` plus ``number`` seconds when no column holds it); raises :class:`BadRow`."""
    if "time" not in cells:
        return start + timedelta(seconds=number)
    value = cells["time"]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BadRow("time is empty")
    if time_format == "iso":
        if not isinstance(value, str):
            raise BadRow(f"time {value!r} is not an ISO 8601 string")
        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError:
            raise BadRow(f"time {value[:40]!r} is not ISO 8601") from None
        return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    number_value = _number("time", value)
    try:
        if time_format == "offset":
            return start + timedelta(seconds=number_value)
        seconds = number_value / 1000 if time_format == "unix_ms" else number_value
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        raise BadRow(f"time {value!r} is out of range") from None


def _number(role: str, value: Any) -> float:
    if isinstance(value, bool):
        raise BadRow(f"{role} {value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadRow(f"{role} {str(value)[:40]!r} is not a number") from None
    if not math.isfinite(number):
        raise BadRow(f"{role} {value!r} is not finite")
    return number


def _label(value: Any) -> bool | None:
    """Adopted (True), not adopted (False) or no signal (None); raises :class:`BadRow`."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ACCEPTED:
        return True
    if text in REJECTED:
        return False
    raise BadRow(f"label {str(value)[:40]!r} is none of true/false, 1/0, yes/no, accepted/rejected (or empty)")


def _identity(number: int, cells: dict[str, Any], occurred_at: datetime) -> str:
    if cells.get("id") is not None and str(cells["id"]).strip():
        return f"id\x1f{str(cells['id']).strip()}"
    if "time" not in cells:
        return f"row\x1f{number}"
    text = f"{cells.get('prompt') or ''}\x1f{cells['response']}".encode("utf-8", "surrogateescape")
    return f"{str(cells['user']).strip()}\x1f{occurred_at.isoformat()}\x1f{hashlib.sha256(text).hexdigest()[:32]}"


def _turns(rows: list[_Row]) -> dict[int, tuple[str, int]]:
    """Per row number, its chat's id and its index among the chat's turns (rows with a ``conversation``)."""
    chats: dict[tuple[str, str], list[_Row]] = {}
    for row in rows:
        conversation = row.cells.get("conversation")
        if conversation is not None and str(conversation).strip():
            chats.setdefault((str(row.cells["user"]).strip(), str(conversation).strip()), []).append(row)
    out: dict[int, tuple[str, int]] = {}
    for (user, conversation), turns in chats.items():
        chat_id = f"{SOURCE}-conv-{imports.stable_id(_NAMESPACE, 'conversation', user, conversation)}"
        for index, row in enumerate(sorted(turns, key=lambda r: (r.occurred_at, r.number))):
            out[row.number] = (chat_id, index)
    return out


def _row_events(row: _Row, turn: tuple[str, int] | None, source: str, max_bytes: int) -> list[dict[str, Any]]:
    """One row's session and, when it has a label, its edit signal; raises :class:`BadRow`."""
    cells, identity = row.cells, row.identity
    user_id = imports.plain_name("user", str(cells["user"]))
    model = imports.plain_name("model", str(cells.get("model") or "")) or "unknown"
    session_id = f"{SOURCE}-{imports.stable_id(_NAMESPACE, 'session', identity)}"
    occurred_at = row.occurred_at.isoformat()
    payload: dict[str, Any] = {
        "model": model,
        "policy_version": model,
        "prompt": {"text": str(cells.get("prompt") or "")},
        "segments": [{"role": "assistant", "text": str(cells["response"])}],
        "conversation_id": turn[0] if turn else session_id,
        "source": source,
    }
    if turn:
        payload["turn"] = {"session_id": turn[0], "index": turn[1]}
    if cells.get("task") not in (None, ""):
        payload["task_name"] = imports.plain_name("task", str(cells["task"]))
    if cells.get("logprob") not in (None, ""):
        mean = _number("logprob", cells["logprob"])
        if mean > 0:
            raise BadRow(f"logprob {mean} is positive; a mean token log probability is at most 0")
        payload["served_logprobs"] = {"mean": mean}
    session = {
        "schema_version": schemas.SCHEMA_VERSION,
        "event_id": imports.stable_id(_NAMESPACE, "session.completed", identity),
        "type": schemas.SESSION_COMPLETED,
        "occurred_at": occurred_at,
        "session_id": session_id,
        "user_id": user_id,
        "payload": payload,
    }
    events = [imports.checked(session, max_bytes)]
    adopted = _label(cells.get("label"))
    if adopted is not None:
        signal = {
            "schema_version": schemas.SCHEMA_VERSION,
            "event_id": imports.stable_id(_NAMESPACE, "edit", identity),
            "type": schemas.EDIT_ACCEPTED if adopted else schemas.EDIT_REJECTED,
            "occurred_at": occurred_at,
            "session_id": session_id,
            "user_id": user_id,
            "payload": {"edit_id": session_id, "source": source},
        }
        events.append(imports.checked(signal, max_bytes))
    return events
