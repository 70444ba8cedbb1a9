"""The job table: one row per job (its kind, the state it carries, where it stands) and one row per
step of it, written by the workers as they run, and the rules that keep them true under faults.

A job row has ``id == chain_id``; its steps' rows share its ``chain_id``. States: ``PENDING`` ->
``STARTED`` -> ``SUCCESS`` | ``FAILURE`` | ``REVOKED`` (cancelled) | ``LOST`` (its worker died), and
``RETRY`` / ``PREEMPTED`` for a step that will run again (a training step that handed its replicas
back resumes from its checkpoint).

- **Cancel** (:func:`cancel`) marks the job and its unfinished steps ``REVOKED`` in the database,
  which every transport shares: a step that starts later sees it and ends without running, so the
  chain stops (the SQLAlchemy transport cannot revoke a queued message; Redis and RabbitMQ are also
  told by remote control). A running training step checks at every optimizer step, checkpoints and
  stops.
- **A worker killed mid-step**: a running step renews ``heartbeat_at`` every ``job_heartbeat_s``;
  :func:`reap_lost` marks steps (and their job) silent for ``job_lost_after_s`` ``LOST``. It runs
  under celery beat, when a worker starts, and when the API reads jobs. Redis (after the visibility
  timeout, set from the longest step) and RabbitMQ (when the connection drops) deliver the message
  again; the step then runs again (steps are idempotent) and the job goes back to ``STARTED``. The
  SQLAlchemy transport never redelivers an unacknowledged message: there the job stays ``LOST``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import transaction
from scheduler.tables import JobRow

FINISHED = frozenset({"SUCCESS", "FAILURE", "REVOKED", "LOST"})
"""States after which a job has nothing left to run (a LOST one may still be redelivered)."""
CANCELLED = "REVOKED"


def _now() -> datetime:
    return datetime.now(UTC)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)


def create(engine: Engine, job_id: str, kind: str, state: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    """Record a job and its steps (``(task_id, task_name)`` in order), all ``PENDING``."""
    now = _now()
    with transaction(engine) as s:
        s.add(
            JobRow(
                id=job_id,
                name=kind,
                state="PENDING",
                chain_id=job_id,
                inputs=_jsonable({"state": state, "steps": [t for t, _ in steps]}),
                attempts=0,
                created_at=now,
            )
        )
        for task_id, name in steps:
            s.add(
                JobRow(id=task_id, name=name, state="PENDING", chain_id=job_id, inputs={}, attempts=0, created_at=now)
            )


def unfinished(engine: Engine, kind: str, newer_than_s: float) -> str | None:
    """The id of a job of ``kind`` created in the last ``newer_than_s`` seconds that has not finished, if any."""
    cutoff = _now() - timedelta(seconds=newer_than_s)
    with engine.connect() as conn:
        return conn.scalar(  # type: ignore[no-any-return]
            select(JobRow.id)
            .where(
                JobRow.id == JobRow.chain_id,
                JobRow.name == kind,
                JobRow.state.in_(("PENDING", "STARTED", "RETRY", "PREEMPTED")),
                JobRow.created_at >= cutoff,
            )
            .limit(1)
        )


def record(engine: Engine, task_id: str, **values: Any) -> None:
    """Insert or update the row of ``task_id`` (a step run outside a job gets a row of its own)."""
    with transaction(engine) as s:
        row = s.get(JobRow, task_id, with_for_update=True)
        if row is None:
            row = JobRow(
                id=task_id,
                name=values.pop("name", "?"),
                state="PENDING",
                chain_id=task_id,
                inputs={},
                attempts=0,
                created_at=_now(),
            )
            s.add(row)
        for key, value in values.items():
            setattr(row, key, _jsonable(value) if key in ("inputs", "outputs") else value)


def cancelled(engine: Engine, job_id: str | None) -> bool:
    """True when the job was cancelled."""
    if not job_id:
        return False
    with transaction(engine) as s:
        row = s.get(JobRow, job_id)
        return row is not None and row.state == CANCELLED


def step_started(engine: Engine, task_id: str, job_id: str | None, **values: Any) -> None:
    """A step began (or began again after a redelivery or a retry)."""
    now = _now()
    with transaction(engine) as s:
        row = s.get(JobRow, task_id, with_for_update=True)
        if row is None:
            row = JobRow(id=task_id, state="PENDING", inputs={}, attempts=0, created_at=now)
            s.add(row)
        for key, value in values.items():
            setattr(row, key, _jsonable(value) if key in ("inputs", "outputs") else value)
        row.attempts = (row.attempts or 0) + 1
        if row.state == CANCELLED:
            return  # delivered after its job was cancelled: the task ends without running
        row.state, row.started_at, row.heartbeat_at, row.finished_at, row.error = "STARTED", now, now, None, None
        job = s.get(JobRow, job_id, with_for_update=True) if job_id and job_id != task_id else None
        if job is not None and job.state != CANCELLED:
            job.state, job.heartbeat_at, job.finished_at, job.error = "STARTED", now, None, None
            job.started_at = job.started_at or now
            job.attempts = max(job.attempts or 0, 1)


def step_finished(
    engine: Engine, task_id: str, job_id: str | None, state: str, *, last: bool, outputs: Any = None, error: str = ""
) -> None:
    """A step ended: ``SUCCESS`` (the job succeeds with its last step), ``FAILURE``, ``RETRY``, ..."""
    now = _now()
    with transaction(engine) as s:
        row = s.get(JobRow, task_id, with_for_update=True)
        if row is not None:
            row.state, row.finished_at, row.error = state, now, error or None
            if row.started_at is not None:
                row.duration_s = (now - row.started_at).total_seconds()
            if outputs is not None:
                row.outputs = _jsonable(outputs)
        job = s.get(JobRow, job_id, with_for_update=True) if job_id and job_id != task_id else None
        if job is None or job.state == CANCELLED:
            return
        if state == "SUCCESS" and not last:
            job.heartbeat_at = now
            return
        if state in ("RETRY", "PREEMPTED"):
            job.state, job.error = state, error or None
            return
        job.state, job.finished_at, job.error = state, now, error or None
        if job.started_at is not None:
            job.duration_s = (now - job.started_at).total_seconds()
        if outputs is not None:
            job.outputs = _jsonable(outputs)


def beat(engine: Engine, task_id: str, job_id: str | None) -> None:
    """The running step is alive."""
    now = _now()
    ids = [i for i in (task_id, job_id) if i]
    with transaction(engine) as s:
        s.execute(update(JobRow).where(JobRow.id.in_(ids), JobRow.state == "STARTED").values(heartbeat_at=now))


def cancel(engine: Engine, job_id: str, actor: str) -> tuple[JobRow, list[str] | None] | None:
    """Mark a job and its unfinished steps cancelled; returns the job row and every step's task id
    (to revoke on brokers that can), None when there is no such job. A finished job is returned
    unchanged with ``None`` for the ids: the caller reports it."""
    now = _now()
    with transaction(engine) as s:
        job = s.get(JobRow, job_id, with_for_update=True)
        if job is None:
            return None
        if job.state in FINISHED:
            s.expunge(job)
            return job, None
        job.state, job.finished_at, job.error = CANCELLED, now, f"cancelled by {actor}"
        steps = list(s.scalars(select(JobRow).where(JobRow.chain_id == job_id, JobRow.id != job_id)))
        for step in steps:
            if step.state not in FINISHED:
                step.state, step.finished_at, step.error = CANCELLED, now, f"cancelled by {actor}"
        ids = [step.id for step in steps]
        s.flush()
        s.expunge(job)
    return job, ids


def reap_lost(engine: Engine, lost_after_s: float, now: datetime | None = None) -> list[str]:
    """Mark ``STARTED`` rows silent for ``lost_after_s`` ``LOST`` (their worker died); returns their ids."""
    now = now or _now()
    cutoff = now - timedelta(seconds=lost_after_s)
    why = f"no sign of life from its worker for {lost_after_s:.0f}s (killed or cut off)"
    with transaction(engine) as s:
        # Task runs only (named ``undertow.*``): a job between two steps waits in the queue, silent.
        stale = list(
            s.scalars(
                select(JobRow).where(
                    JobRow.state == "STARTED",
                    JobRow.name.like("undertow.%"),
                    or_(JobRow.heartbeat_at < cutoff, JobRow.heartbeat_at.is_(None) & (JobRow.started_at < cutoff)),
                )
            )
        )
        for row in stale:
            _lose(s, row, why, now)
        return [row.id for row in stale]


def _lose(s: Session, row: JobRow, why: str, now: datetime) -> None:
    """Mark a step run LOST, and its job with it."""
    row.state, row.finished_at, row.error = "LOST", now, why
    job = s.get(JobRow, row.chain_id) if row.chain_id and row.chain_id != row.id else None
    if job is not None and job.state in ("STARTED", "PENDING"):
        job.state, job.finished_at, job.error = "LOST", now, f"step {row.name} lost: {why}"


def mark_lost(engine: Engine, task_id: str, reason: str) -> bool:
    """Mark a step whose worker died (it still shows STARTED), and its job, LOST."""
    now = _now()
    with transaction(engine) as s:
        row = s.get(JobRow, task_id, with_for_update=True)
        if row is None or row.state != "STARTED":
            return False
        _lose(s, row, reason, now)
    return True


def list_jobs(engine: Engine, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
    """Recent jobs (not their steps), newest first, as plain data."""
    with transaction(engine) as s:
        q = select(JobRow).where(JobRow.id == JobRow.chain_id).order_by(JobRow.created_at.desc()).limit(limit)
        if state:
            q = q.where(JobRow.state == state)
        return [
            {
                "id": r.id,
                "name": r.name,
                "state": r.state,
                "chain_id": r.chain_id,
                "attempts": r.attempts,
                "inputs": r.inputs,
                "outputs": r.outputs,
                "error": r.error,
                "worker": r.worker,
                "created_at": r.created_at,
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "duration_s": r.duration_s,
            }
            for r in s.scalars(q).all()
        ]


def steps_of(engine: Engine, job_id: str) -> list[JobRow]:
    """The step rows of a job, in the order they were planned."""
    with transaction(engine) as s:
        job = s.get(JobRow, job_id)
        order = list((job.inputs or {}).get("steps", [])) if job is not None else []
        rows = {r.id: r for r in s.scalars(select(JobRow).where(JobRow.chain_id == job_id, JobRow.id != job_id))}
        for r in rows.values():
            s.expunge(r)
    return [rows[i] for i in order if i in rows] + [r for i, r in rows.items() if i not in order]
