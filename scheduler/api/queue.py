"""Jobs for the scheduler's Celery workers: record a job in the scheduler's job table, send its
tasks, list, read and cancel them.

A job of each kind runs a fixed sequence of the loop's tasks (:data:`JOB_TASKS`); its id is the
first task's id, which is also the chain id every task of it records, and the workers update
the row as they run (:mod:`scheduler.tasks.base`).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import session_factory, transaction
from scheduler.api.schemas import Job
from scheduler.api.sources import Conflict, Unavailable
from scheduler.tables import JobRow

if TYPE_CHECKING:
    from scheduler.settings import Settings

FINISHED_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED", "LOST"})
"""Job states (see :mod:`scheduler.tasks.base`) after which there is nothing left to cancel."""
CANCELLED = "REVOKED"

# Which Celery tasks a job of each kind runs (a chain runs its tasks in order; the job id is
# the first task's, which is also the chain id every task of it records).
JOB_TASKS: dict[str, tuple[str, ...]] = {
    "reward_model_retrain": ("undertow.retrain",),
    "rl_update": ("undertow.rl_update", "undertow.snapshot", "undertow.canary", "undertow.promote"),
    "rollout": ("undertow.canary", "undertow.promote"),
    "promote": ("undertow.promote",),
    "rollback": ("undertow.rollback",),
}


def _job(row: JobRow) -> Job:
    return Job(
        id=row.id,
        kind=row.name,
        state=row.state,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        params=dict(row.inputs or {}),
        result=dict(row.outputs or {}),
        error=row.error,
    )


def _celery(settings: Settings) -> Any:
    from scheduler.celery_app import make_celery

    celery = make_celery(settings)
    if str(celery.conf.broker_url).startswith("sqla+"):
        # kombu's SQLAlchemy transport hands every transport option to ``create_engine``, which
        # refuses ``polling_interval`` (a consumer-side setting a producer does not need).
        options = dict(celery.conf.broker_transport_options or {})
        options.pop("polling_interval", None)
        celery.conf.broker_transport_options = options
    return celery


def _chain_state(kind: str, job_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON state the loop's tasks carry (see :mod:`scheduler.tasks.steps`)."""
    state: dict[str, Any] = {"run_id": job_id, "requested_via": "api", **params}
    if kind == "reward_model_retrain":
        state["force"] = True
        state["window"] = {"since": params.get("since"), "until": params.get("until")}
    if kind in ("rollout", "promote", "rollback"):
        state["policy_version"] = params.get("version")
    if kind == "promote":
        state["canary"] = {"passed": True, "forced_by": params.get("requested_by")}
    return state


def submit_job(engine: Engine, kind: str, params: dict[str, Any], *, actor: str, settings: Settings) -> Job:
    """Record a job of ``kind`` (a row in the scheduler's job table, state ``PENDING``) and send its
    Celery tasks; the workers update the row as it runs. :class:`Unavailable` when the broker
    cannot be reached (the row then says ``FAILURE`` and why)."""
    from celery import chain

    from scheduler.tasks.base import record

    tasks = JOB_TASKS[kind]
    job_id = uuid.uuid4().hex
    state = _chain_state(kind, job_id, {**params, "requested_by": actor})
    record(engine, job_id, name=tasks[0], state="PENDING", inputs={"args": [state], "kwargs": {}, "job_kind": kind})
    celery = _celery(settings)
    first = celery.signature(tasks[0], args=(state,)).set(task_id=job_id)
    canvas = chain(first, *(celery.signature(t) for t in tasks[1:])) if len(tasks) > 1 else first
    try:
        canvas.apply_async(retry=True, retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5})
    except Exception as exc:  # the broker is down or misconfigured: say so, keep the record
        record(engine, job_id, state="FAILURE", error=f"could not queue: {type(exc).__name__}: {exc}")
        raise Unavailable(
            f"the job queue did not accept the job ({type(exc).__name__}); check the Celery broker"
        ) from exc
    with session_factory(engine)() as session:
        job = get_job(session, job_id)
    assert job is not None
    return job


def list_jobs(
    session: Session, *, kind: str | None, state: str | None, limit: int, offset: int
) -> tuple[list[Job], int]:
    """Jobs, newest first, and how many match."""
    stmt = select(JobRow)
    if kind:
        stmt = stmt.where(JobRow.name == kind)
    if state:
        stmt = stmt.where(JobRow.state == state)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(JobRow.created_at.desc(), JobRow.id).limit(limit).offset(offset))
    return [_job(r) for r in rows], total


def get_job(session: Session, job_id: str) -> Job | None:
    """One job, or None."""
    row = session.get(JobRow, job_id)
    return _job(row) if row is not None else None


def cancel_job(engine: Engine, job_id: str, *, actor: str, settings: Settings) -> Job | None:
    """Revoke a queued or running job; None when there is no such job, :class:`Conflict` when it finished."""
    with transaction(engine) as session:
        row = session.get(JobRow, job_id)
        if row is None:
            return None
        if row.state in FINISHED_STATES:
            raise Conflict(f"job {job_id} already finished ({row.state}); nothing to cancel")
        row.state = CANCELLED
        row.finished_at = datetime.now(UTC)
        row.error = f"cancelled by {actor}"
        job = _job(row)
    _revoke(job_id, settings)
    return job


def _revoke(job_id: str, settings: Settings) -> None:
    """Tell the Celery workers to drop the task (remote control needs a broadcast-capable broker:
    Redis or RabbitMQ; on the SQLAlchemy transport the job row's state is what workers see)."""
    if settings.scheduler.celery_broker_url:
        _celery(settings).control.revoke(job_id, terminate=True)


def job_state_counts(session: Session) -> dict[tuple[str, str], int]:
    """Number of jobs per (kind, state)."""
    rows = session.execute(select(JobRow.name, JobRow.state, func.count()).group_by(JobRow.name, JobRow.state))
    return {(kind, state): n for kind, state, n in rows}
