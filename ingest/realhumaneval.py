"""RealHumanEval's chat log as wire-contract telemetry: each answer a ``session.completed`` and an edit signal.

RealHumanEval (Mozannar et al. 2024, CC0 1.0) logged 1,055 answers of four chat assistants to 107
programmers solving Python tasks (``chat_data.csv``). A row holds the conversation so far (``request``,
a Python literal: parsed with :func:`ast.literal_eval`, never ``eval``), the answer (``response``), what
the programmer copied from it (``copy_events``), a summary of the served token logprobs (``logprobs``),
the programmer, seconds since their start (``timestamp``), the model and the task. :func:`read_events`
turns the file into envelopes the producer SDK sends, so the data flows through ingest, labels and
reward models like production telemetry::

    result = read_events("chat_data.csv")
    sessions = session_records([e for e in result.events if e["type"] == "session.completed"])
    signals = signal_records(result.events)  # reward_models.data; acceptance 1 = copied

Per row:

- ``session.completed``: ``user_id`` ``rhe-<programmer_id>``; ``occurred_at`` ``study_start`` plus
  ``timestamp`` (the data set has offsets only, so every programmer starts at ``study_start``);
  ``model`` and ``policy_version`` the row's model; ``prompt.text`` the last user message and
  ``prompt.messages`` the whole conversation as sent (as the gateway records a chat request); one
  ``assistant`` segment, the answer. Extra payload fields: ``conversation_id``, ``served_logprobs``
  (the summary's finite numbers: mean, median, min, max, std, first/middle/last element),
  ``task_name`` and ``source: "realhumaneval"``.
- Conversations: a programmer's rows in one task that start with the same first message are one chat
  (in the file, 633 rows extend an earlier row's request by exactly its answer and one message; none
  crosses tasks). They share ``conversation_id`` and carry ``turn = {session_id: conversation_id,
  index: answers before this one}``, the gateway's link between a chat's turns, so they load with
  ``agent_session`` set (:func:`reward_models.data.load_sessions`).
- The label: a non-empty ``copy_events`` is an ``edit.accepted`` (``lines``: non-blank lines copied;
  ``copies``: how many copies), an empty one an ``edit.rejected``, both with ``edit_id`` the session id
  (one edit per answer) and the session's ``occurred_at``. Rejection is the right mapping: the answer was
  shown in the programmer's chat pane and the study logged every copy from it, so an empty log means
  the programmer saw the answer and took nothing, the "discarded" of the contract. The study's own
  adoption measure is this binary, and :func:`reward_models.labels.acceptance_labels` is the fraction
  accepted, so without rejections every labelled answer would score 1. Its noise: code retyped by hand,
  or an answer with nothing to copy, counts as rejected.
- Ids are uuid5 of the row's identity (programmer, task, timestamp), so a re-import (of the whole file,
  a ``limit``, or a reordered copy) sends the same ``event_id`` and ingest stores nothing twice.

A malformed row (a column missing, a value that is not a literal of the right shape, an identifier
with control characters or NUL, text that is not UTF-8, an event over ``max_bytes``, the identity of an
earlier row) is skipped and
reported in :attr:`ImportResult.skipped` with its row, line and reason; the other rows are kept. Free
text may hold NUL, as the contract allows. A file whose header lacks a column raises :class:`FormatError`.

Left out: earlier turns are not segments. Ingest's ``completion_text`` (what the reward models read)
joins every assistant segment, so an earlier answer, labelled by its own row, would be scored again
under this row's label; it is in ``prompt.messages``. There are no token ids or per-token logprobs
(the data set has only their summary): these sessions train reward models, not the policy, whose
rollouts need token ids.
"""

from __future__ import annotations

import ast
import csv
import math
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import structlog

from ingest import imports, schemas
from ingest.imports import (
    CSV_FIELD_LIMIT,
    BadRow,
    ImportResult,
    SkippedRow,
    check_text,
    checked,
    csv_field_limit,
    csv_records,
    plain_name,
    stable_id,
)

log = structlog.get_logger(__name__)

SOURCE = "realhumaneval"
STUDY_START = datetime(2024, 6, 1, tzinfo=UTC)
"""Default start of every programmer's study session (nominal: the data set gives offsets only)."""
COLUMNS = ("request", "response", "copy_events", "logprobs", "programmer_id", "timestamp", "model", "task_name")
ROLES = ("system", "user", "assistant")
LOGPROB_KEYS = ("mean", "median", "min", "max", "std", "firstElement", "middleElement", "lastElement")
MAX_TIMESTAMP_S = 10 * 365 * 86400
"""A study session longer than ten years is a broken row."""

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "undertow:import:realhumaneval")
_PROGRAMMER = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def default_path(repo_root: Path | None = None) -> Path | None:
    """The full chat log beside the project (``../shared/data/real/realhumaneval/chat_data.csv``), if present."""
    root = repo_root or Path(__file__).resolve().parent.parent
    path = root.parent / "shared" / "data" / "real" / "realhumaneval" / "chat_data.csv"
    return path if path.exists() else None


class FormatError(imports.FormatError):
    """The file is not RealHumanEval's ``chat_data.csv``: nothing was read."""


def read_events(
    path: str | Path,
    *,
    limit: int | None = None,
    study_start: datetime = STUDY_START,
    max_bytes: int = schemas.DEFAULT_MAX_BYTES,
) -> ImportResult:
    """Read ``chat_data.csv`` at ``path`` into contract-valid envelopes (plain dicts, validated).

    ``limit``: read at most this many data records. ``study_start``: a timezone-aware instant every
    programmer's ``timestamp`` counts from. ``max_bytes``: the largest event (ingest's
    ``kafka.max_message_bytes``); a row whose session would be larger is skipped. Raises
    :class:`FormatError` when the header lacks a column, ``OSError`` when the file cannot be read.
    """
    if study_start.tzinfo is None:
        raise ValueError("study_start must be timezone-aware (e.g. 2024-06-01T00:00:00+00:00)")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    result = ImportResult()
    seen: dict[str, int] = {}
    with (
        csv_field_limit(max(CSV_FIELD_LIMIT, 4 * max_bytes)),
        open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as handle,
    ):
        reader = csv.reader(handle)
        index = _header(next(reader, None), path)
        for start, cells in csv_records(reader):
            if limit is not None and result.rows >= limit:
                break
            result.rows += 1
            if isinstance(cells, BadRow):
                result.skipped.append(SkippedRow(result.rows, start, str(cells)))
                continue
            try:
                identity, events = _row_events(cells, index, study_start, max_bytes)
                if identity in seen:
                    raise BadRow(
                        f"same programmer_id, task_name and timestamp as row {seen[identity]}: the two would share "
                        "event ids and ingest would keep one"
                    )
            except BadRow as exc:
                result.skipped.append(SkippedRow(result.rows, start, str(exc)))
                continue
            seen[identity] = result.rows
            result.events.extend(events)
    log.info("realhumaneval.read", rows=result.rows, events=len(result.events), skipped=len(result.skipped))
    return result


def _header(header: list[str] | None, path: str | Path) -> dict[str, int]:
    if header is None:
        raise FormatError(f"{path} is empty; expected RealHumanEval's chat_data.csv with columns {', '.join(COLUMNS)}")
    names = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise FormatError(f"{path} is not RealHumanEval's chat_data.csv: its header lacks {', '.join(missing)}")
    return {name: names.index(name) for name in COLUMNS} | {"": len(names)}


def _row_events(
    cells: list[str], index: dict[str, int], study_start: datetime, max_bytes: int
) -> tuple[str, list[dict[str, Any]]]:
    """The identity of one record and its session and signal, validated; raises :class:`BadRow` with the reason."""
    if len(cells) != index[""]:
        raise BadRow(f"{len(cells)} cells where the header has {index['']}: a column is missing or extra")
    cell = {name: cells[i] for name, i in index.items() if name}
    for name, value in cell.items():
        check_text(name, value, max_bytes)
        if not value.strip():
            raise BadRow(f"{name} is empty")
    programmer = cell["programmer_id"].strip()
    if not _PROGRAMMER.fullmatch(programmer):
        raise BadRow(f"programmer_id {programmer[:40]!r} is not 1-64 letters, digits, '.', '_' or '-'")
    model = plain_name("model", cell["model"])
    task = plain_name("task_name", cell["task_name"])
    seconds = _seconds(cell["timestamp"])
    messages = _messages(_literal("request", cell["request"], list))
    copied = _copies(_literal("copy_events", cell["copy_events"], list))
    served = _served_logprobs(_literal("logprobs", cell["logprobs"], dict))

    identity = f"{programmer}\x1f{task}\x1f{seconds!r}"
    session_id = f"rhe-{_uuid('session', identity)}"
    first = messages[0]["content"] if messages else f"\x1frow {identity}"  # no message: a chat of its own
    conversation_id = f"rhe-conv-{_uuid('conversation', programmer, task, first)}"
    user_id = f"rhe-{programmer}"
    occurred_at = (study_start + timedelta(seconds=seconds)).isoformat()
    prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    session = {
        "schema_version": schemas.SCHEMA_VERSION,
        "event_id": _uuid("session.completed", identity),
        "type": schemas.SESSION_COMPLETED,
        "occurred_at": occurred_at,
        "session_id": session_id,
        "user_id": user_id,
        "payload": {
            "model": model,
            "policy_version": model,
            "prompt": {"text": prompt, "messages": messages},
            "segments": [{"role": "assistant", "text": cell["response"]}],
            "turn": {"session_id": conversation_id, "index": sum(m["role"] == "assistant" for m in messages)},
            "conversation_id": conversation_id,
            "served_logprobs": served,
            "task_name": task,
            "source": SOURCE,
        },
    }
    edit: dict[str, Any] = {"edit_id": session_id, "source": SOURCE}
    if copied:
        edit |= {"lines": sum(_code_lines(text) for text in copied), "copies": len(copied)}
    signal = {
        "schema_version": schemas.SCHEMA_VERSION,
        "event_id": _uuid("edit", identity),
        "type": schemas.EDIT_ACCEPTED if copied else schemas.EDIT_REJECTED,
        "occurred_at": occurred_at,
        "session_id": session_id,
        "user_id": user_id,
        "payload": edit,
    }
    return identity, [checked(session, max_bytes), checked(signal, max_bytes)]


def _uuid(*parts: str) -> str:
    return stable_id(_NAMESPACE, *parts)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise BadRow(f"timestamp {value[:40]!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_TIMESTAMP_S:
        raise BadRow(f"timestamp {value[:40]!r} is not between 0 and {MAX_TIMESTAMP_S} seconds")
    return seconds


def _literal(field_name: str, text: str, kind: type) -> Any:
    """A Python literal of type ``kind`` (``ast.literal_eval``: no code runs)."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise BadRow(f"{field_name} is not a Python literal ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(value, kind):
        raise BadRow(f"{field_name} is a {type(value).__name__} literal, not a {kind.__name__}")
    return value


def _messages(request: list[Any]) -> list[dict[str, str]]:
    messages = []
    for i, m in enumerate(request):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadRow(f"request message {i} is not a {{'role': system|user|assistant, 'content': str}} dict")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def _copies(events: list[Any]) -> list[str]:
    """The texts copied (one per copy event)."""
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("copied"), str):
            raise BadRow(f"copy_events item {i} is not a {{'type': ..., 'copied': str}} dict")
    return [e["copied"] for e in events]


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def _served_logprobs(summary: dict[Any, Any]) -> dict[str, float]:
    """The summary's known statistics that are finite numbers."""
    out = {}
    for key in LOGPROB_KEYS:
        value = summary.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf
            if math.isfinite(number):
                out[key] = number
    return out
