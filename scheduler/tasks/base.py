"""The base task class: acknowledge late, retry transient errors with backoff, and keep one row
per task run in the ``jobs`` table (state, inputs, outputs, error, attempts, timings).

States: ``STARTED`` -> ``SUCCESS`` | ``FAILURE`` | ``RETRY`` | ``PREEMPTED`` (a training job
that handed its replicas back and will resume from its checkpoint) | ``LOST`` (its worker died:
set by the lease reaper). A retry keeps the task id, so it updates the same row.
"""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from typing import Any, cast

from celery import Task
from sqlalchemy import select, update
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.exc import OperationalError

from ingest.db import transaction
from scheduler.tables import JobRow


class TransientError(RuntimeError):
    """A failure worth retrying (a replica or service that did not answer in time)."""


class Preempted(RuntimeError):
    """A training job handed its borrowed capacity back; it resumes from its checkpoint."""


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)


def record(engine: Engine, task_id: str, **values: Any) -> None:
    """Insert or update the job row of ``task_id``."""
    now = datetime.now(UTC)
    with transaction(engine) as s:
        row = s.get(JobRow, task_id, with_for_update=True)
        if row is None:
            row = JobRow(
                id=task_id, name=values.pop("name", "?"), state="PENDING", inputs={}, attempts=0, created_at=now
            )
            s.add(row)
        for key, value in values.items():
            setattr(row, key, _jsonable(value) if key in ("inputs", "outputs") else value)


def mark_lost(engine: Engine, task_id: str, reason: str) -> bool:
    """Mark a job whose worker died (it still shows STARTED) as LOST."""
    with transaction(engine) as s:
        result = s.execute(
            update(JobRow)
            .where(JobRow.id == task_id, JobRow.state == "STARTED")
            .values(state="LOST", error=reason, finished_at=datetime.now(UTC))
        )
        n = cast("CursorResult[Any]", result).rowcount
    return bool(n)


def list_jobs(engine: Engine, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
    """Recent jobs, newest first, as plain data."""
    with transaction(engine) as s:
        q = select(JobRow).order_by(JobRow.created_at.desc()).limit(limit)
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


class JobTask(Task):  # type: ignore[misc]
    """Base of every Undertow task (see the module docstring)."""

    acks_late = True
    reject_on_worker_lost = True
    autoretry_for = (TransientError, OperationalError)
    retry_backoff = 2
    retry_backoff_max = 300
    retry_jitter = True
    max_retries = 3

    def _engine(self) -> Engine:
        from scheduler.celery_app import worker_engine

        return worker_engine()

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        req = self.request
        started = datetime.now(UTC)
        self._started = started
        record(
            self._engine(),
            task_id,
            name=self.name,
            state="STARTED",
            chain_id=req.root_id,
            inputs={"args": list(args), "kwargs": kwargs},
            attempts=(req.retries or 0) + 1,
            worker=req.hostname or socket.gethostname(),
            started_at=started,
            finished_at=None,
            error=None,
        )

    def _finish(self, task_id: str, state: str, **values: Any) -> None:
        now = datetime.now(UTC)
        started = getattr(self, "_started", None)
        record(
            self._engine(),
            task_id,
            state=state,
            finished_at=now,
            duration_s=(now - started).total_seconds() if started else None,
            **values,
        )

    def on_success(self, retval: Any, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._finish(task_id, "SUCCESS", outputs=retval if isinstance(retval, dict) else {"result": retval})

    def on_retry(
        self, exc: BaseException, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], einfo: Any
    ) -> None:
        state = "PREEMPTED" if isinstance(exc, Preempted) else "RETRY"
        self._finish(task_id, state, error=f"{type(exc).__name__}: {exc}")

    def on_failure(
        self, exc: BaseException, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], einfo: Any
    ) -> None:
        self._finish(task_id, "FAILURE", error=f"{type(exc).__name__}: {exc}")
