"""The loop as Celery tasks: thin, idempotent, each running one step of :mod:`scheduler.loop.steps`
on the typed :class:`LoopState` it receives, and chained with canvas by
:func:`scheduler.loop.submit.submit` (no task waits on another). Every task records its run in the
job table (:mod:`scheduler.loop.jobs`), renews a heartbeat while it runs, and ends without running
when its job was cancelled. ``rl_update`` trains on borrowed replicas and yields to recalls;
``plan_capacity``, ``reap_leases``, ``reap_jobs`` and ``check_retrain`` (the reward-model retrain
triggers, score drift included) run periodically under celery beat.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from celery import Task, signals
from celery.exceptions import Ignore
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from scheduler.loop import jobs, leases, steps
from scheduler.loop.app import app, worker_engine, worker_settings
from scheduler.loop.borrowing import FleetControl, fleet_control, give_back, lend, reap
from scheduler.loop.planning import choose_replicas, plan_pools
from scheduler.loop.preemptible import run_preemptible
from scheduler.loop.state import LoopState, Step
from scheduler.loop.submit import new_job_id, submit
from scheduler.loop.training import outcome, trainer

log = structlog.get_logger(__name__)
PREEMPT_MAX_RETRIES = 1000
StepFn = Callable[[steps.StepContext, LoopState], LoopState]


class TransientError(RuntimeError):
    """A failure worth retrying (a replica or service that did not answer in time)."""


class Preempted(RuntimeError):
    """A training job handed its borrowed capacity back; it resumes from its checkpoint."""


_BEATS: dict[str, threading.Event] = {}
"""The heartbeat of each running task, by task id (one task instance serves every run of its name)."""


class LoopTask(Task):  # type: ignore[misc]
    """Base of every Undertow task: late acknowledgement, retries with backoff, a job-table row and a
    heartbeat while it runs (see :mod:`scheduler.loop.jobs`)."""

    acks_late = True
    reject_on_worker_lost = True
    autoretry_for = (TransientError, OperationalError)
    retry_backoff = 2
    retry_backoff_max = 300
    retry_jitter = True
    max_retries = 3

    def _engine(self) -> Engine:
        return worker_engine()

    def _job_id(self) -> str | None:
        return self.request.root_id or self.request.id  # type: ignore[no-any-return]

    def _last(self) -> bool:
        return not self.request.callbacks and not self.request.chain

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        req = self.request
        jobs.step_started(
            self._engine(),
            task_id,
            self._job_id(),
            name=self.name,
            chain_id=self._job_id(),
            worker=req.hostname or socket.gethostname(),
        )
        stop = _BEATS[task_id] = threading.Event()
        every = worker_settings().scheduler.job_heartbeat_s
        engine, job_id = self._engine(), self._job_id()

        def beat() -> None:
            while not stop.wait(every):
                try:
                    jobs.beat(engine, task_id, job_id)
                except Exception as exc:  # the database blinked: the next beat tries again
                    log.warning("job heartbeat failed", task=task_id, error=str(exc))

        threading.Thread(target=beat, name=f"beat-{task_id[:8]}", daemon=True).start()

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        stop = _BEATS.pop(self.request.id, None)
        if stop is not None:
            stop.set()

    def cancelled(self) -> bool:
        """True when this task's job was cancelled."""
        return jobs.cancelled(self._engine(), self._job_id())

    def stop_if_cancelled(self) -> None:
        """End this task without running (and the chain with it) when its job was cancelled."""
        if self.cancelled():
            self.after_return()  # Celery skips it for an ignored task: stop the heartbeat here
            jobs.step_finished(self._engine(), self.request.id, None, jobs.CANCELLED, last=False, error="job cancelled")
            raise Ignore()

    def run_step(self, step: StepFn, state: dict[str, Any]) -> Any:
        """Validate the state, run ``step`` unless the job was cancelled, hand the new state on."""
        self.stop_if_cancelled()
        loop_state = LoopState.model_validate(state)
        out = step(steps.StepContext(worker_settings(), self._engine()), loop_state)
        return out.wire()

    def on_success(self, retval: Any, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        outputs = retval if isinstance(retval, dict) else {"result": retval}
        jobs.step_finished(self._engine(), task_id, self._job_id(), "SUCCESS", last=self._last(), outputs=outputs)

    def on_retry(
        self, exc: BaseException, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], einfo: Any
    ) -> None:
        state = "PREEMPTED" if isinstance(exc, Preempted) else "RETRY"
        jobs.step_finished(self._engine(), task_id, self._job_id(), state, last=False, error=_why(exc))

    def on_failure(
        self, exc: BaseException, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], einfo: Any
    ) -> None:
        jobs.step_finished(self._engine(), task_id, self._job_id(), "FAILURE", last=True, error=_why(exc))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _step_task(step: Step, run: StepFn) -> Any:
    """Register the Celery task that runs ``run`` for ``step`` (its docstring is the step's)."""

    def task(self: LoopTask, state: dict[str, Any]) -> Any:
        return self.run_step(run, state)

    task.__name__, task.__qualname__, task.__doc__ = step.value, step.value, run.__doc__
    return app.task(base=LoopTask, bind=True, name=step.task_name)(task)


collect = _step_task(Step.COLLECT, steps.collect)
retrain = _step_task(Step.RETRAIN, steps.retrain)
snapshot = _step_task(Step.SNAPSHOT, steps.snapshot)
rollout = _step_task(Step.ROLLOUT, steps.rollout)
promote = _step_task(Step.PROMOTE, steps.promote)
rollback = _step_task(Step.ROLLBACK, steps.rollback)
evaluate = _step_task(Step.EVALUATE, steps.evaluate)


@app.task(base=LoopTask, bind=True, name=Step.RL_UPDATE.task_name)
def rl_update(self: LoopTask, state: dict[str, Any]) -> Any:
    """RL update on borrowed replicas; yields to recalls, stops when cancelled, resumes from its checkpoint."""
    self.stop_if_cancelled()
    loop_state = LoopState.model_validate(state)
    settings = worker_settings()
    engine = worker_engine()
    cfg = settings.scheduler
    fleet = fleet_control(settings)
    holder = self.request.id
    replicas = choose_replicas(fleet, engine, settings, cfg.training_replicas)
    replicas = [(r, p) for r, p in replicas if lend(fleet, engine, r, p, holder, "training", cfg.lease_ttl_s)]
    if not replicas:
        raise self.retry(
            exc=Preempted("no replica can be lent now"), countdown=cfg.preempt_resume_s, max_retries=PREEMPT_MAX_RETRIES
        )
    checkpoint = Path(settings.home) / cfg.checkpoint_dir / f"{loop_state.run_id}.ckpt"
    finished = False
    try:
        session = trainer(settings, loop_state)
        result = run_preemptible(
            session,
            checkpoint,
            engine,
            [r for r, _ in replicas],
            holder,
            cfg.lease_ttl_s,
            cfg.checkpoint_every_steps,
            cancelled=self.cancelled,
        )
        finished = result.finished
    finally:
        for replica_id, pool in replicas:
            give_back(fleet, engine, replica_id, pool, holder, event="returned" if finished else "preempted")
    if result.cancelled:
        self.stop_if_cancelled()
    if not result.finished:
        raise self.retry(
            exc=Preempted(f"yielded after {result.steps} steps"),
            countdown=cfg.preempt_resume_s,
            max_retries=PREEMPT_MAX_RETRIES,
        )
    return loop_state.model_copy(update={"rl_update": outcome(result.result, result.resumed)}).wire()


@app.task(base=LoopTask, name="undertow.plan_capacity")
def plan_capacity() -> dict[str, Any]:
    """Plan every pool for the next window; recall borrowed replicas beyond what a pool can lend."""
    settings = worker_settings()
    engine = worker_engine()
    fleet: FleetControl = fleet_control(settings)
    held = leases.active_leases(engine)
    plans = []
    for _ids, plan in plan_pools(fleet, settings):
        pool = plan["pool"]
        lent = [lease["replica_id"] for lease in held if lease["pool"] == pool and not lease["recall_requested"]]
        excess = max(0, len(lent) - plan["lendable"])
        plan["recalled"] = (
            leases.request_recall(engine, lent[:excess], settings.scheduler.preempt_deadline_s) if excess else []
        )
        plans.append(plan)
    return {"plans": plans}


@app.task(base=LoopTask, name="undertow.reap_leases")
def reap_leases() -> dict[str, Any]:
    """Return every replica whose lease expired (its holder died)."""
    return {"returned": reap(fleet_control(worker_settings()), worker_engine())}


@app.task(base=LoopTask, name="undertow.reap_jobs")
def reap_jobs() -> dict[str, Any]:
    """Mark steps whose worker stopped beating LOST."""
    return {"lost": jobs.reap_lost(worker_engine(), worker_settings().scheduler.job_lost_after_s)}


@app.task(base=LoopTask, name="undertow.enforce_retention")
def enforce_retention() -> dict[str, Any]:
    """Delete telemetry older than ``ingest.retention_days`` and audit entries older than
    ``api.audit_retention_days`` (:func:`scheduler.privacy.enforce_retention`)."""
    from scheduler.privacy import enforce_retention as run

    return run(worker_engine(), worker_settings())


NO_MODEL = "no promoted reward model"


@app.task(base=LoopTask, name="undertow.check_retrain")
def check_retrain() -> dict[str, Any]:
    """Ask the reward-model retrain triggers (new labels, age, drift of the promoted model's scores on recent
    sessions); when one holds, start a ``reward_model_retrain`` job (its reason ``drift`` when the scores
    drifted). Nothing is started while such a job is still queued or running, nor before a first model was
    promoted (an operator or a loop job trains that one)."""
    settings, engine = worker_settings(), worker_engine()
    decision = steps.decide_retrain(steps.StepContext(settings, engine))
    out: dict[str, Any] = {"retrain": decision.retrain, "reasons": decision.reasons, "job_id": None}
    out["details"] = jobs._jsonable(decision.details)
    if not decision.retrain or decision.reasons == [NO_MODEL]:
        return out
    busy = jobs.unfinished(engine, "reward_model_retrain", settings.scheduler.longest_step_s)
    if busy is not None:
        out["skipped"] = f"reward-model retrain job {busy} is still queued or running"
        return out
    reason = "drift" if decision.drifted else "; ".join(decision.reasons)
    state = LoopState(run_id=new_job_id(), kind="reward_model_retrain", requested_by="retrain-trigger", reason=reason)
    out["job_id"] = submit(engine, settings, state)
    log.info("retrain triggered", job=out["job_id"], reason=reason, reasons=decision.reasons)
    return out


@signals.worker_ready.connect
def _reap_on_start(**_: Any) -> None:
    """A worker that starts marks what a dead worker left STARTED (its own earlier run, say) LOST."""
    try:
        lost = jobs.reap_lost(worker_engine(), worker_settings().scheduler.job_lost_after_s)
    except Exception as exc:  # the database is not reachable yet: beat and the API reap later
        log.warning("job reaper at start failed", error=str(exc))
        return
    if lost:
        log.warning("jobs lost by a dead worker", steps=lost)
