"""Jobs for the scheduler's Celery workers, as the API sees them: start one from a request, list,
read and cancel them. The loop itself (what each kind runs, how cancel and lost workers are
handled) is :mod:`scheduler.loop`; this module turns API requests into its typed
:class:`~scheduler.loop.state.LoopState` and its job rows into :class:`Job` responses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import session_factory
from scheduler.api.schemas import Job
from scheduler.api.sources import Conflict, Unavailable
from scheduler.loop import jobs
from scheduler.loop.state import LoopState
from scheduler.loop.submit import QueueUnavailable, new_job_id
from scheduler.tables import JobRow

if TYPE_CHECKING:
    from scheduler.settings import Settings

FINISHED_STATES = jobs.FINISHED
"""Job states after which there is nothing left to cancel."""


def _job(row: JobRow, steps: list[JobRow] | None = None) -> Job:
    inputs = dict(row.inputs or {})
    return Job(
        id=row.id,
        kind=row.name,
        state=row.state,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        params=dict(inputs.get("state") or inputs),
        result=dict(row.outputs or {}),
        error=row.error,
        steps=[{"name": s.name, "state": s.state, "attempts": s.attempts, "error": s.error} for s in steps or []],
    )


def submit_job(engine: Engine, state: LoopState, *, settings: Settings) -> Job:
    """Record a job (state ``PENDING``) and send its chain; the workers update it as it runs.
    :class:`Unavailable` when the broker cannot be reached (the row then says ``FAILURE`` and why)."""
    from scheduler.loop.submit import submit

    try:
        submit(engine, settings, state)
    except QueueUnavailable as exc:
        raise Unavailable(str(exc)) from exc
    with session_factory(engine)() as session:
        job = get_job(session, state.run_id)
    assert job is not None
    return job


def new_state(**values: Any) -> LoopState:
    """A job's first state (a fresh id unless one is given)."""
    return LoopState(**{"run_id": new_job_id(), **values})


def list_jobs(
    session: Session, *, kind: str | None, state: str | None, limit: int, offset: int
) -> tuple[list[Job], int]:
    """Jobs (not their steps), newest first, and how many match."""
    stmt = select(JobRow).where(JobRow.id == JobRow.chain_id)
    if kind:
        stmt = stmt.where(JobRow.name == kind)
    if state:
        stmt = stmt.where(JobRow.state == state)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(JobRow.created_at.desc(), JobRow.id).limit(limit).offset(offset))
    return [_job(r) for r in rows], total


def get_job(session: Session, job_id: str) -> Job | None:
    """One job with its steps, or None."""
    row = session.get(JobRow, job_id)
    if row is None:
        return None
    steps = list(session.scalars(select(JobRow).where(JobRow.chain_id == job_id, JobRow.id != job_id)))
    order = list((row.inputs or {}).get("steps", []))
    steps.sort(key=lambda s: order.index(s.id) if s.id in order else len(order))
    return _job(row, steps)


def reap(engine: Engine, settings: Settings) -> None:
    """Mark steps whose worker died LOST before answering about them (bounded even without beat)."""
    jobs.reap_lost(engine, settings.scheduler.job_lost_after_s)


def cancel_job(engine: Engine, job_id: str, *, actor: str, settings: Settings) -> Job | None:
    """Cancel a queued or running job; None when there is no such job, :class:`Conflict` when it finished."""
    from scheduler.loop.submit import cancel

    found = cancel(engine, settings, job_id, actor)
    if found is None:
        return None
    row, cancelled = found
    if not cancelled:
        raise Conflict(f"job {job_id} already finished ({row.state}); nothing to cancel")
    with session_factory(engine)() as session:
        return get_job(session, job_id)


def job_state_counts(session: Session) -> dict[tuple[str, str], int]:
    """Number of jobs per (kind, state)."""
    rows = session.execute(
        select(JobRow.name, JobRow.state, func.count())
        .where(JobRow.id == JobRow.chain_id)
        .group_by(JobRow.name, JobRow.state)
    )
    return {(kind, state): n for kind, state, n in rows}
