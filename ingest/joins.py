"""Late and early signals joined to their sessions.

Signals keep no foreign key: a ``code.retained`` may arrive a day after its session, and an
``edit.accepted`` may arrive before it. The join is by ``session_id`` at query time, so a signal
stored early is joined automatically once its session arrives; nothing is moved or rewritten.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.tables import SessionRow, SignalRow


@dataclass(frozen=True)
class SignalView:
    """One signal of a session, as the reward layer reads it."""

    event_id: str
    type: str
    occurred_at: datetime
    horizon_s: int | None
    value: float | None
    payload: dict[str, object]


@dataclass
class SessionSignals:
    """A session (when it has arrived) and every signal about it, in order of occurrence."""

    session_id: str
    arrived: bool
    signals: list[SignalView] = field(default_factory=list)

    def horizons(self, kind: str = "code.retained") -> dict[int, float | None]:
        """``{horizon_s: value}`` of this session's signals of ``kind`` (latest per horizon)."""
        return {s.horizon_s: s.value for s in self.signals if s.type == kind and s.horizon_s is not None}


def signals_by_session(engine: Engine, session_ids: Iterable[str] | None = None) -> dict[str, SessionSignals]:
    """Per session id, every signal with its horizon; sessions without signals are included.

    Signals whose session has not arrived are listed too, with ``arrived=False``.
    """
    ids = None if session_ids is None else list(session_ids)
    out: dict[str, SessionSignals] = {}
    with transaction(engine) as session:
        sess_q = select(SessionRow.session_id)
        sig_q = select(SignalRow).where(SignalRow.session_id.is_not(None)).order_by(SignalRow.occurred_at, SignalRow.id)
        if ids is not None:
            sess_q = sess_q.where(SessionRow.session_id.in_(ids))
            sig_q = sig_q.where(SignalRow.session_id.in_(ids))
        for sid in session.execute(sess_q).scalars():
            out[sid] = SessionSignals(sid, arrived=True)
        for row in session.execute(sig_q).scalars():
            assert row.session_id is not None
            entry = out.setdefault(row.session_id, SessionSignals(row.session_id, arrived=False))
            entry.signals.append(
                SignalView(row.event_id, row.type, row.occurred_at, row.horizon_s, row.value, row.payload)
            )
    return out


def orphan_signal_counts(engine: Engine) -> dict[str, int]:
    """Signals whose session has not arrived yet, by type (``user.churned`` has no session)."""
    with transaction(engine) as session:
        has_session = select(SessionRow.session_id).where(SessionRow.session_id == SignalRow.session_id).exists()
        rows = session.execute(
            select(SignalRow.type, func.count())
            .where(SignalRow.session_id.is_not(None), ~has_session)
            .group_by(SignalRow.type)
        ).tuples()
        return {str(k): int(v) for k, v in rows}
