"""Start and cancel jobs: the one way a job enters the loop, for the API, the CLI and the demo.

:func:`submit` records the job and each of its steps (:data:`scheduler.loop.state.JOB_STEPS`) with
task ids chosen here, then sends one canvas chain whose first task carries the
:class:`LoopState`. Knowing every step's task id up front is what lets :func:`cancel` stop the
queued steps of a chain as well as the running one.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from celery import chain

from scheduler.loop import jobs
from scheduler.loop.state import JOB_STEPS, LoopState, Step

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings
    from scheduler.tables import JobRow


class QueueUnavailable(RuntimeError):
    """The broker did not take the job (the job row says FAILURE and why)."""


def new_job_id() -> str:
    """A fresh job id."""
    return uuid.uuid4().hex


def producer(settings: Settings) -> Celery:
    """A Celery app that sends to the configured broker."""
    from scheduler.loop.app import make_celery

    celery = make_celery(settings)
    if str(celery.conf.broker_url).startswith("sqla+"):
        # kombu's SQLAlchemy transport hands every transport option to ``create_engine``, which
        # refuses ``polling_interval`` (a consumer-side setting a producer does not need).
        options = dict(celery.conf.broker_transport_options or {})
        options.pop("polling_interval", None)
        celery.conf.broker_transport_options = options
    return celery


def submit(engine: Engine, settings: Settings, state: LoopState, *, celery: Celery | None = None) -> str:
    """Record the job ``state.run_id`` of kind ``state.kind`` and queue its chain; returns the job id.

    Raises :class:`QueueUnavailable` when the broker cannot be reached (the job row then says
    ``FAILURE`` and why)."""
    job_id = state.run_id
    plan = [(f"{job_id}-{i}-{step.value}", step) for i, step in enumerate(_steps(state))]
    jobs.create(engine, job_id, state.kind, state.wire(), [(task_id, step.task_name) for task_id, step in plan])
    celery = celery or producer(settings)
    signatures = [
        celery.signature(step.task_name, args=(state.wire(),) if i == 0 else ()).set(task_id=task_id)
        for i, (task_id, step) in enumerate(plan)
    ]
    # Every task of the chain reports ``root_id``: the job id, though no task has it as its own id.
    canvas = chain(*signatures) if len(signatures) > 1 else signatures[0]
    try:
        canvas.apply_async(
            root_id=job_id,
            retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
        )
    except Exception as exc:  # the broker is down or misconfigured: say so, keep the record
        jobs.record(engine, job_id, state="FAILURE", error=f"could not queue: {type(exc).__name__}: {exc}")
        raise QueueUnavailable(
            f"the job queue did not accept the job ({type(exc).__name__}); check the Celery broker"
        ) from exc
    return job_id


def _steps(state: LoopState) -> list[Step]:
    steps = list(JOB_STEPS[state.kind])
    if state.kind == "loop" and not state.evaluate:
        steps.remove(Step.EVALUATE)
    return steps


def cancel(engine: Engine, settings: Settings, job_id: str, actor: str) -> tuple[JobRow, bool] | None:
    """Cancel a job (see :mod:`scheduler.loop.jobs`); returns its row and whether this call cancelled
    it (False: it had already finished, its state says how), None when there is no such job."""
    found = jobs.cancel(engine, job_id, actor)
    if found is None:
        return None
    row, task_ids = found
    if task_ids and settings.scheduler.celery_broker_url:
        # Brokers with remote control drop the queued messages too; the database flag covers the
        # SQLAlchemy transport and a step that is already running (it stops at its next check).
        producer(settings).control.revoke(task_ids)
    return row, task_ids is not None
