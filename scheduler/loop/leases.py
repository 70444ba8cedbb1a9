"""Replica leases in the database: acquire, renew, recall, release, and reap the expired.

A borrowed replica always has a lease with an expiry. Its holder (a task id) renews it at every
step; :func:`renew` also tells the holder when a recall (preemption) was requested. A lease that
is not renewed in ``ttl`` expires: :func:`reap_expired` (run by celery beat) releases it and the
caller returns the replica to serving, so a killed worker never keeps a replica forever. Every
change is appended to ``borrow_events``. All writes are single transactions with conditional
updates, so two workers never hold one replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import select, update
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.orm import Session

from ingest.db import transaction
from scheduler.planner.borrow import ReplicaState, check_transition
from scheduler.tables import BorrowEventRow, LeaseRow


class LeaseLost(RuntimeError):
    """The holder no longer holds this lease (it expired and was reaped, or was released)."""


@dataclass(frozen=True)
class LeaseStatus:
    """What a holder learns when it renews."""

    replica_id: str
    expires_at: datetime
    recall_requested: bool
    recall_deadline: datetime | None


def utcnow() -> datetime:
    return datetime.now(UTC)


def log_event(
    session: Session, replica_id: str, pool: str, event: str, holder: str | None, at: datetime, **detail: Any
) -> None:
    session.add(BorrowEventRow(replica_id=replica_id, pool=pool, event=event, holder=holder, at=at, detail=detail))


def acquire(
    engine: Engine, replica_id: str, pool: str, holder: str, purpose: str, ttl_s: float, now: datetime | None = None
) -> bool:
    """Take the lease of ``replica_id`` for ``holder``; False when someone else holds it.

    Idempotent: the same holder acquiring again just renews.
    """
    now = now or utcnow()
    expires = now + timedelta(seconds=ttl_s)
    with transaction(engine) as s:
        row = s.get(LeaseRow, replica_id, with_for_update=True)
        if row is None:
            s.add(
                LeaseRow(
                    replica_id=replica_id,
                    pool=pool,
                    holder=holder,
                    purpose=purpose,
                    state=ReplicaState.DRAINING.value,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    recall_requested=False,
                    recall_deadline=None,
                    released_at=None,
                )
            )
        elif row.released_at is None and row.holder != holder:
            return False
        elif row.released_at is None:
            row.renewed_at, row.expires_at = now, expires
            return True
        else:
            row.pool, row.holder, row.purpose = pool, holder, purpose
            row.state = ReplicaState.DRAINING.value
            row.acquired_at = row.renewed_at = now
            row.expires_at = expires
            row.recall_requested, row.recall_deadline, row.released_at = False, None, None
        log_event(s, replica_id, pool, "lent", holder, now, purpose=purpose)
    return True


def renew(engine: Engine, replica_id: str, holder: str, ttl_s: float, now: datetime | None = None) -> LeaseStatus:
    """Extend the lease; raises :class:`LeaseLost` when ``holder`` no longer holds it."""
    now = now or utcnow()
    with transaction(engine) as s:
        row = s.get(LeaseRow, replica_id, with_for_update=True)
        if row is None or row.holder != holder or row.released_at is not None:
            raise LeaseLost(f"replica {replica_id} is no longer leased to {holder}")
        row.renewed_at = now
        row.expires_at = now + timedelta(seconds=ttl_s)
        status = LeaseStatus(replica_id, row.expires_at, row.recall_requested, row.recall_deadline)
    return status


def set_state(engine: Engine, replica_id: str, holder: str, state: ReplicaState) -> None:
    """Move a leased replica along the borrowing state machine (illegal moves raise)."""
    with transaction(engine) as s:
        row = s.get(LeaseRow, replica_id, with_for_update=True)
        if row is None or row.holder != holder or row.released_at is not None:
            raise LeaseLost(f"replica {replica_id} is no longer leased to {holder}")
        row.state = check_transition(ReplicaState(row.state), state).value
        log_event(s, replica_id, row.pool, f"state:{state.value}", holder, utcnow())


def request_recall(engine: Engine, replica_ids: list[str], deadline_s: float, now: datetime | None = None) -> list[str]:
    """Ask the holders of these replicas to hand them back within ``deadline_s``; returns those asked."""
    now = now or utcnow()
    asked: list[str] = []
    with transaction(engine) as s:
        rows = s.scalars(
            select(LeaseRow).where(LeaseRow.replica_id.in_(replica_ids), LeaseRow.released_at.is_(None))
        ).all()
        for row in rows:
            if not row.recall_requested:
                row.recall_requested = True
                row.recall_deadline = now + timedelta(seconds=deadline_s)
                log_event(s, row.replica_id, row.pool, "recalled", row.holder, now, deadline_s=deadline_s)
            asked.append(row.replica_id)
    return asked


def release(engine: Engine, replica_id: str, holder: str, event: str = "returned", **detail: Any) -> bool:
    """End ``holder``'s lease (idempotent: False when it was not held by ``holder`` any more)."""
    now = utcnow()
    with transaction(engine) as s:
        result = s.execute(
            update(LeaseRow)
            .where(LeaseRow.replica_id == replica_id, LeaseRow.holder == holder, LeaseRow.released_at.is_(None))
            .values(released_at=now, state=ReplicaState.SERVING.value)
        )
        done = cast("CursorResult[Any]", result).rowcount
        if done:
            pool = s.scalar(select(LeaseRow.pool).where(LeaseRow.replica_id == replica_id)) or ""
            deadline = s.scalar(select(LeaseRow.recall_deadline).where(LeaseRow.replica_id == replica_id))
            extra = dict(detail)
            if deadline is not None:
                extra["within_deadline"] = now <= deadline
            log_event(s, replica_id, pool, event, holder, now, **extra)
    return bool(done)


def reap_expired(engine: Engine, now: datetime | None = None) -> list[tuple[str, str, str, str]]:
    """Release every lease past its expiry; returns ``(replica_id, pool, holder, purpose)`` of each."""
    now = now or utcnow()
    reaped: list[tuple[str, str, str, str]] = []
    with transaction(engine) as s:
        rows = s.scalars(
            select(LeaseRow).where(LeaseRow.released_at.is_(None), LeaseRow.expires_at < now).with_for_update()
        ).all()
        for row in rows:
            row.released_at = now
            row.state = ReplicaState.SERVING.value
            log_event(s, row.replica_id, row.pool, "expired", row.holder, now, expired_at=str(row.expires_at))
            reaped.append((row.replica_id, row.pool, row.holder, row.purpose))
    return reaped


def active_leases(engine: Engine) -> list[dict[str, Any]]:
    """Leases currently held, as plain data."""
    with transaction(engine) as s:
        rows = s.scalars(select(LeaseRow).where(LeaseRow.released_at.is_(None)).order_by(LeaseRow.replica_id)).all()
        return [
            {
                "replica_id": r.replica_id,
                "pool": r.pool,
                "holder": r.holder,
                "purpose": r.purpose,
                "state": r.state,
                "expires_at": r.expires_at,
                "recall_requested": r.recall_requested,
            }
            for r in rows
        ]
