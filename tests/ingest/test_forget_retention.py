"""Forgetting a user at the ingest layer (rows gone, other users kept, late events dropped and counted)
and the retention sweep (old telemetry gone, recent kept), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from ingest_helpers import session_event, signal_event
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.schemas import validate_event
from ingest.tables import DeadLetterRow, ForgottenUserRow, SegmentRow, SessionRow, SignalRow
from ingest.writer import DeadLetter, write_dead_letters, write_events


def _store(engine: Engine, user: str, i: int, at: datetime | None = None) -> str:
    event = session_event(i, user_id=user)
    if at is not None:
        event["occurred_at"] = at.isoformat()
    sid = event["session_id"]
    thumbs = signal_event(f"thumbs-{i}", "feedback.thumbs", sid, {"value": 1})
    thumbs["user_id"] = user
    if at is not None:
        thumbs["occurred_at"] = (at + timedelta(minutes=1)).isoformat()
    with transaction(engine) as session:
        write_events(session, [validate_event(event), validate_event(thumbs)])
    return sid


def _count(engine: Engine, stmt: object) -> int:
    with transaction(engine) as session:
        return int(session.scalar(stmt) or 0)  # type: ignore[call-overload]


def test_forget_deletes_the_users_rows_and_drops_their_late_events(engine: Engine) -> None:
    from ingest.forget import forget_user, user_hash

    gone = [_store(engine, "alice", i) for i in range(3)]
    kept = _store(engine, "bob", 10)
    waiting = signal_event("orphan-1", "edit.accepted", "s-not-yet", {"lines": 3})  # waits for its session
    waiting["user_id"] = "alice"
    with transaction(engine) as session:
        write_events(session, [validate_event(waiting)])
        write_dead_letters(
            session,
            [
                DeadLetter("t", 0, 1, None, json.dumps({"user_id": "alice", "type": "bogus"}).encode(), "unknown_type"),
                DeadLetter("t", 0, 2, None, b'{"user_id": "alice", "oops', "invalid_json"),
                DeadLetter("t", 0, 3, None, json.dumps({"user_id": "alice-2"}).encode(), "unknown_type"),
                DeadLetter("t", 0, 4, None, json.dumps({"user_id": "bob"}).encode(), "unknown_type"),
            ],
        )
    with transaction(engine) as session:
        done = forget_user(session, "alice", "test")
    assert done.deleted == {
        "session_segments": done.deleted["session_segments"],
        "signals": 4,
        "sessions": 3,
        "dead_letters": 2,
    }
    assert done.deleted["session_segments"] > 0 and len(done.times) == 3
    assert _count(engine, select(func.count()).select_from(SessionRow).where(SessionRow.session_id.in_(gone))) == 0
    assert _count(engine, select(func.count()).select_from(SegmentRow).where(SegmentRow.session_id.in_(gone))) == 0
    assert _count(engine, select(func.count()).select_from(SignalRow).where(SignalRow.user_id == "alice")) == 0
    assert _count(engine, select(func.count()).select_from(SessionRow).where(SessionRow.session_id == kept)) == 1
    assert _count(engine, select(func.count()).select_from(SignalRow).where(SignalRow.user_id == "bob")) == 1
    assert _count(engine, select(func.count()).select_from(DeadLetterRow)) == 2  # alice-2 and bob stay

    # Late events of the forgotten user are dropped and counted; other users' events in the batch are stored.
    late = session_event(20, user_id="alice")
    late_signal = signal_event("late-1", "feedback.thumbs", gone[0], {"value": -1})
    late_signal["user_id"] = "alice"
    other = session_event(21, user_id="bob")
    with transaction(engine) as session:
        result = write_events(session, [validate_event(e) for e in (late, late_signal, other, late)])
    assert (result.stored, result.dropped, result.duplicates) == (1, 2, 0)
    assert _count(engine, select(func.count()).select_from(SessionRow).where(SessionRow.user_id == "alice")) == 0
    with transaction(engine) as session:
        tomb = session.get(ForgottenUserRow, user_hash("alice"))
        assert tomb is not None and tomb.dropped_events == 2 and tomb.last_dropped_at is not None
        assert "alice" not in json.dumps([tomb.user_hash, tomb.deleted, tomb.flagged, tomb.requested_by])

    # Forgetting again is harmless: nothing left to delete, the counts stay.
    with transaction(engine) as session:
        again = forget_user(session, "alice", "test")
    assert sum(again.deleted.values()) == 0
    with transaction(engine) as session:
        tomb = session.get(ForgottenUserRow, user_hash("alice"))
        assert tomb is not None and tomb.deleted["sessions"] == 3


def test_forget_refuses_malformed_ids(engine: Engine) -> None:
    import pytest

    from ingest.forget import forget_user

    for bad in ("", "x" * 129):
        with pytest.raises(ValueError, match="1 to 128"), transaction(engine) as session:
            forget_user(session, bad, "test")
    with transaction(engine) as session:  # a hostile id is data, not SQL or a pattern
        done = forget_user(session, "%' OR '1'='1", "test")
    assert sum(done.deleted.values()) == 0


def test_retention_deletes_only_what_is_older_than_the_cutoff(engine: Engine) -> None:
    from ingest.retention import delete_older_than

    now = datetime.now(UTC)
    old = [_store(engine, "carol", 30 + i, now - timedelta(days=40)) for i in range(2)]
    new = _store(engine, "carol", 40, now - timedelta(days=2))
    with transaction(engine) as session:
        write_dead_letters(
            session, [DeadLetter("t", 0, 9, None, b"old", "invalid_json")], created_at=now - timedelta(days=40)
        )
        write_dead_letters(session, [DeadLetter("t", 0, 10, None, b"new", "invalid_json")], created_at=now)
    counts = delete_older_than(engine, now - timedelta(days=30))
    assert counts["sessions"] == 2 and counts["signals"] == 2 and counts["dead_letters"] == 1
    assert _count(engine, select(func.count()).select_from(SessionRow).where(SessionRow.session_id.in_(old))) == 0
    assert _count(engine, select(func.count()).select_from(SessionRow).where(SessionRow.session_id == new)) == 1
    assert _count(engine, select(func.count()).select_from(SignalRow).where(SignalRow.session_id == new)) == 1
    assert _count(engine, select(func.count()).select_from(DeadLetterRow).where(DeadLetterRow.value == b"new")) == 1
    assert sum(delete_older_than(engine, now - timedelta(days=30)).values()) == 0  # idempotent
