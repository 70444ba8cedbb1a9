"""Signals whose session never arrived: moved to the dead letters (``unknown_session``) after a wait.

A signal may arrive before its session (CONTRACTS.md section 1): it is stored, and joined to the
session whenever that arrives (:mod:`ingest.joins`). One whose session has still not arrived
``ingest.unmatched_signal_ttl_s`` seconds after the signal was received (its ``received_at``) is
moved, in one transaction, from ``signals`` to the dead letters with reason ``unknown_session``:
the row is deleted and a dead letter holding the event's envelope as JSON is written, so nothing
is lost or doubled if the sweep dies midway, and ``undertow dlq replay`` can send it again later
(it is then stored again, and joined if its session has arrived by then: the writer de-duplicates
on the ids in ``sessions`` and ``signals`` only, and the moved row is gone from ``signals``).

What counts as the session: a stored session with the signal's ``session_id``, or, for a signal
about a whole agent session ``S``, one of its turns (stored as ``S.t{n}`` or ``S.t{n}-{k}``,
``docs/telemetry.md``). ``user.churned`` has no session and is never moved.

Cost: the sweep walks ``signals`` in primary-key order from a cursor (:class:`UnmatchedSweeper`
keeps it between sweeps), reads only ids and ``received_at``, stops at the first signal not
waited out yet (ids grow with ``received_at``), and deletes a chunk's waited-out, unmatched rows
with one ``DELETE .. RETURNING`` whose session checks are lookups in the sessions' primary key.
Each sweep examines at most ``max_rows`` signals, so a consumer started on a large table catches
up over several sweeps. ``DELETE .. RETURNING`` makes concurrent sweeps (several consumers of a
group) safe: a row is moved by the one that deleted it. Works on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.schemas import USER_CHURNED
from ingest.tables import DeadLetterRow, SessionRow, SignalRow
from ingest.writer import DeadLetter

UNKNOWN_SESSION = "unknown_session"
"""The dead-letter reason of a signal whose session did not arrive in time."""

_SIGNALS = cast(Table, SignalRow.__table__)
_SESSIONS = cast(Table, SessionRow.__table__)


@dataclass(frozen=True)
class MovedSignal:
    """A signal moved to the dead letters."""

    dead_letter_id: int
    event_id: str
    type: str
    session_id: str
    waited_s: float
    """Seconds between the signal's ``received_at`` and the sweep."""


@dataclass
class SweepResult:
    """What one sweep did."""

    examined: int = 0
    """Signals looked at (waited out; matched or moved)."""
    caught_up: bool = True
    """False when the sweep stopped at ``max_rows`` with waited-out signals left to examine."""
    moved: list[MovedSignal] = field(default_factory=list)
    letters: list[DeadLetter] = field(default_factory=list)
    """The dead letters written, as the consumer publishes them on the dead-letter topic."""

    def as_dict(self) -> dict[str, Any]:
        """Plain data, for ``undertow ingest sweep --json``."""
        return {
            "moved": len(self.moved),
            "examined": self.examined,
            "caught_up": self.caught_up,
            "signals": [vars(m) for m in self.moved],
        }


def envelope(row: Any) -> dict[str, Any]:
    """The event envelope of a ``signals`` row (the wire contract, version 1)."""
    event: dict[str, Any] = {
        "schema_version": 1,
        "event_id": row.event_id,
        "type": row.type,
        "occurred_at": row.occurred_at.astimezone(UTC).isoformat(),
        "session_id": row.session_id,
    }
    if row.user_id is not None:
        event["user_id"] = row.user_id
    event["payload"] = row.payload if row.payload is not None else {}
    return event


class UnmatchedSweeper:
    """Moves waited-out signals without their session to the dead letters, sweep after sweep, from a cursor.

    ``cursor``: every signal with an id at or below it was waited out when examined, and was either
    matched to its session or moved (a session never goes away once stored, so the first holds). A
    new sweeper starts from 0.
    """

    def __init__(self, engine: Engine, ttl_s: float, topic: str, *, chunk: int = 2000, max_rows: int = 20_000) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.topic = topic
        self.chunk = chunk
        self.max_rows = max_rows
        self.cursor = 0

    def sweep(self, now: datetime | None = None, max_rows: int | None = None) -> SweepResult:
        """One sweep: at most ``max_rows`` signals examined (default: the sweeper's), one transaction per chunk."""
        now = now or datetime.now(UTC)
        cutoff = now - timedelta(seconds=self.ttl_s)
        budget = self.max_rows if max_rows is None else max_rows
        result = SweepResult()
        while True:
            if budget <= 0:
                result.caught_up = False
                return result
            limit = min(self.chunk, budget)
            with transaction(self.engine) as session:
                rows = session.execute(
                    select(SignalRow.id, SignalRow.received_at)
                    .where(SignalRow.id > self.cursor)
                    .order_by(SignalRow.id)
                    .limit(limit)
                ).all()
            waited = 0
            for _, received_at in rows:
                if received_at >= cutoff:
                    break
                waited += 1
            if waited:
                high = int(rows[waited - 1][0])
                self._move(self.cursor, high, cutoff, now, result)
                self.cursor = high
                result.examined += waited
                budget -= waited
            if waited < limit:
                return result  # reached a signal not waited out yet, or the end

    def _move(self, low: int, high: int, cutoff: datetime, now: datetime, result: SweepResult) -> None:
        """Move the waited-out, unmatched signals with ids in ``(low, high]``: one transaction."""
        sig, ses = _SIGNALS, _SESSIONS
        exact = select(ses.c.session_id).where(ses.c.session_id == sig.c.session_id).exists()
        turns = (
            select(ses.c.session_id)
            .where(ses.c.session_id >= sig.c.session_id + ".t", ses.c.session_id < sig.c.session_id + ".u")
            .exists()
        )
        statement = (
            delete(sig)
            .where(
                sig.c.id > low,
                sig.c.id <= high,
                sig.c.received_at < cutoff,
                sig.c.session_id.is_not(None),
                sig.c.type != USER_CHURNED,
                ~exact,
                ~turns,
            )
            .returning(
                sig.c.id,
                sig.c.event_id,
                sig.c.type,
                sig.c.session_id,
                sig.c.user_id,
                sig.c.occurred_at,
                sig.c.received_at,
                sig.c.payload,
            )
        )
        with transaction(self.engine) as session:
            gone = sorted(session.execute(statement).all(), key=lambda r: r.id)
            if not gone:
                return
            rows: list[DeadLetterRow] = []
            letters: list[DeadLetter] = []
            for row in gone:
                waited_s = (now - row.received_at).total_seconds()
                letter = DeadLetter(
                    topic=self.topic,
                    partition=-1,
                    offset=-1,
                    key=row.session_id.encode(),
                    value=json.dumps(envelope(row), ensure_ascii=False, separators=(",", ":")).encode(),
                    reason=UNKNOWN_SESSION,
                    detail=(
                        f"session {row.session_id!r} had not arrived {waited_s:.0f} s after this signal was "
                        f"received (ingest.unmatched_signal_ttl_s = {self.ttl_s:g}); replay it once the session "
                        "is stored"
                    ),
                )
                letters.append(letter)
                rows.append(
                    DeadLetterRow(
                        topic=letter.topic,
                        partition=letter.partition,
                        offset=letter.offset,
                        key=letter.key,
                        value=letter.value,
                        reason=letter.reason,
                        detail=letter.detail,
                        created_at=now,
                        replayed_at=None,
                        replay_count=0,
                    )
                )
            session.add_all(rows)
            session.flush()
            for row, dead in zip(gone, rows, strict=True):
                waited_s = round((now - row.received_at).total_seconds(), 3)
                result.moved.append(MovedSignal(int(dead.id), row.event_id, row.type, row.session_id, waited_s))
            result.letters.extend(letters)


def sweep_unmatched(engine: Engine, ttl_s: float, topic: str, now: datetime | None = None) -> SweepResult:
    """A whole sweep from the first signal (``undertow ingest sweep``): every waited-out signal examined."""
    sweeper = UnmatchedSweeper(engine, ttl_s, topic)
    total = SweepResult()
    while True:
        part = sweeper.sweep(now)
        total.examined += part.examined
        total.moved += part.moved
        total.letters += part.letters
        if part.caught_up:
            return total
