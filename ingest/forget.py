"""Forgetting a user: their telemetry deleted, a tombstone that keeps their late events out.

:func:`forget_user` deletes, in the caller's transaction, every row keyed to the user: their
sessions with the segments, the signals they sent or that refer to their sessions (stored or
still waiting for their session), and the dead letters whose envelope names them (the raw bytes
are searched for the id, then parsed to confirm it; a message that does not parse but carries
``"user_id": "<id>"`` counts too). Labels are computed from signals and never stored, so they go
with them. The tombstone (:class:`~ingest.tables.ForgottenUserRow`) keeps only the SHA-256 of the
id, and the writer (:mod:`ingest.writer`) drops and counts every later event of that user.

Concurrency: on PostgreSQL a batch that checked the tombstones before the forget committed could
still store its rows after the delete. So every ingest batch takes a shared transaction-level
advisory lock before it checks (:func:`lock_shared`), and a forget takes it exclusively
(:func:`lock_exclusive`): the forget waits for the batches in flight, and the batches after it see
its tombstone. SQLite serializes writers already (a batch that read before the forget's commit
cannot write after it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, TextClause, delete, func, select, text, update
from sqlalchemy.orm import Session

from ingest.tables import DeadLetterRow, ForgottenUserRow, SegmentRow, SessionRow, SignalRow

LOCK_KEY = 0x75_6E_64_66  # "undf": the advisory lock ingest batches and forgets share (PostgreSQL)
_CHUNK = 500


def user_hash(user_id: str) -> str:
    """Hex SHA-256 of a user id, as the tombstone stores it."""
    return hashlib.sha256(user_id.encode("utf-8")).hexdigest()


def lock_shared(session: Session) -> None:
    """An ingest batch: wait for a forget in progress (PostgreSQL; nothing on SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": LOCK_KEY})


def lock_exclusive(session: Session) -> None:
    """A forget: wait for the ingest batches in flight (PostgreSQL; nothing on SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": LOCK_KEY})


@dataclass
class Forgotten:
    """What one forget deleted, per table."""

    user_hash: str
    deleted: dict[str, int] = field(default_factory=dict)
    times: list[tuple[datetime, datetime]] = field(default_factory=list)
    """``(occurred_at, received_at)`` of each deleted session: what the registries compare their windows to."""


def user_session_times(session: Session, user_id: str) -> list[tuple[datetime, datetime]]:
    """``(occurred_at, received_at)`` of the user's stored sessions."""
    stmt = select(SessionRow.occurred_at, SessionRow.received_at).where(SessionRow.user_id == user_id)
    return [(o, r) for o, r in session.execute(stmt)]


def _in_chunks(session: Session, ids: list[Any], stmt_for: Any) -> int:
    total = 0
    for start in range(0, len(ids), _CHUNK):
        total += session.execute(stmt_for(ids[start : start + _CHUNK])).rowcount or 0  # type: ignore[attr-defined]
    return total


def _names_user(value: bytes | None, user_id: str) -> bool:
    """True when a dead letter's raw bytes are an envelope of ``user_id``."""
    if not value:
        return False
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        pattern = rb'"user_id"\s*:\s*' + re.escape(json.dumps(user_id).encode())
        return re.search(pattern, value) is not None
    return isinstance(doc, dict) and doc.get("user_id") == user_id


def _dead_letters_of(session: Session, user_id: str) -> list[int]:
    needle = user_id.encode("utf-8")
    found: ColumnElement[bool] | TextClause
    if session.get_bind().dialect.name == "postgresql":
        found = text("position(CAST(:needle AS bytea) IN dead_letters.value) > 0").bindparams(needle=needle)
    else:
        found = func.instr(DeadLetterRow.value, needle) > 0
    rows = session.execute(select(DeadLetterRow.id, DeadLetterRow.value).where(found))
    return [i for i, value in rows if _names_user(value, user_id)]


def delete_user_rows(session: Session, user_id: str) -> dict[str, int]:
    """Delete every row keyed to ``user_id`` (see the module docstring); rows deleted per table."""
    session_ids = list(session.scalars(select(SessionRow.session_id).where(SessionRow.user_id == user_id)))
    deleted = {
        "session_segments": _in_chunks(
            session, session_ids, lambda ids: delete(SegmentRow).where(SegmentRow.session_id.in_(ids))
        ),
        "signals": _in_chunks(session, session_ids, lambda ids: delete(SignalRow).where(SignalRow.session_id.in_(ids))),
    }
    deleted["signals"] += session.execute(delete(SignalRow).where(SignalRow.user_id == user_id)).rowcount or 0  # type: ignore[attr-defined]
    deleted["sessions"] = _in_chunks(
        session, session_ids, lambda ids: delete(SessionRow).where(SessionRow.session_id.in_(ids))
    )
    letters = _dead_letters_of(session, user_id)
    deleted["dead_letters"] = _in_chunks(
        session, letters, lambda ids: delete(DeadLetterRow).where(DeadLetterRow.id.in_(ids))
    )
    return deleted


def forget_user(session: Session, user_id: str, requested_by: str, now: datetime | None = None) -> Forgotten:
    """Tombstone ``user_id`` and delete its rows, in the caller's transaction (which should have taken
    :func:`lock_exclusive` first). Forgetting a user again deletes what arrived meanwhile (nothing, unless
    the tombstone was removed) and adds to the counts."""
    if not user_id or len(user_id) > 128:
        raise ValueError("a user id is 1 to 128 characters (the telemetry contract's limit)")
    if "\x00" in user_id:
        raise ValueError("a user id holds no NUL character (no database stores one, so no stored user has one)")
    now = now or datetime.now(UTC)
    out = Forgotten(user_hash(user_id))
    out.times = user_session_times(session, user_id)
    out.deleted = delete_user_rows(session, user_id)
    row = session.get(ForgottenUserRow, out.user_hash)
    if row is None:
        row = ForgottenUserRow(
            user_hash=out.user_hash, forgotten_at=now, requested_by=requested_by[:128], deleted={}, flagged={}
        )
        row.dropped_events = 0
        session.add(row)
    row.deleted = {k: int((row.deleted or {}).get(k, 0)) + v for k, v in out.deleted.items()}
    row.requested_by = requested_by[:128]
    session.flush()
    return out


def record_flagged(session: Session, hashed: str, flagged: dict[str, list[str]]) -> None:
    """Add the versions flagged for a forgotten user to its tombstone."""
    row = session.get(ForgottenUserRow, hashed)
    if row is None:
        return
    merged = {k: sorted(set((row.flagged or {}).get(k, [])) | set(v)) for k, v in flagged.items()}
    row.flagged = {**(row.flagged or {}), **merged}


def forgotten_among(session: Session, user_ids: Iterable[str | None]) -> set[str]:
    """Which of ``user_ids`` are forgotten (one indexed lookup; an empty set without a query when none is given)."""
    by_hash = {user_hash(u): u for u in set(user_ids) if u}
    if not by_hash:
        return set()
    hashes = list(by_hash)
    found: set[str] = set()
    for start in range(0, len(hashes), _CHUNK):
        stmt = select(ForgottenUserRow.user_hash).where(ForgottenUserRow.user_hash.in_(hashes[start : start + _CHUNK]))
        found.update(by_hash[h] for h in session.scalars(stmt))
    return found


def count_dropped(session: Session, dropped: dict[str, int], now: datetime | None = None) -> None:
    """Add ``dropped`` (events per forgotten user id) to the tombstones' counters."""
    now = now or datetime.now(UTC)
    for uid, n in sorted(dropped.items()):
        session.execute(
            update(ForgottenUserRow)
            .where(ForgottenUserRow.user_hash == user_hash(uid))
            .values(dropped_events=ForgottenUserRow.dropped_events + n, last_dropped_at=now)
        )


def list_forgotten(session: Session) -> list[ForgottenUserRow]:
    """Every tombstone, oldest first."""
    return list(session.scalars(select(ForgottenUserRow).order_by(ForgottenUserRow.forgotten_at)))
