"""The loop as Celery tasks: thin, idempotent, taking ids (the chain's JSON state), chained with
canvas: ``collect -> retrain -> rl_update -> snapshot -> canary -> promote`` and optionally
``-> evaluate`` (promote rolls back when the canary failed; evaluate reports the version's
held-out metrics). No task waits on another. ``plan_capacity`` and ``reap_leases`` run
periodically under celery beat.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from celery import chain

from scheduler.celery_app import app, worker_engine, worker_settings
from scheduler.planner.capacity import hot_fraction, hot_reserve, lendable_replicas, replicas_needed, split_borrowed
from scheduler.planner.forecast import forecast_from_history
from scheduler.planner.pools import PoolOffer, allocate
from scheduler.tasks import leases
from scheduler.tasks.base import JobTask, Preempted
from scheduler.tasks.borrowing import FleetControl, fleet_control, give_back, lend, reap, resolve
from scheduler.tasks.preemptible import run_preemptible
from scheduler.tasks.steps import State, step

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings

log = structlog.get_logger(__name__)
PREEMPT_MAX_RETRIES = 1000


def _run_step(name: str, state: State) -> State:
    settings = worker_settings()
    out = step(settings, name)(settings, worker_engine(), state)
    return {**state, **out}


@app.task(base=JobTask, name="undertow.collect")
def collect(state: State) -> State:
    """Ingest health (first link of the loop)."""
    return _run_step("collect", state)


@app.task(base=JobTask, name="undertow.retrain")
def retrain(state: State) -> State:
    """Retrain the reward model if the triggers say so."""
    return _run_step("retrain", state)


@app.task(base=JobTask, name="undertow.snapshot")
def snapshot(state: State) -> State:
    """Store the new weights version and its delta."""
    return _run_step("snapshot", state)


@app.task(base=JobTask, name="undertow.canary")
def canary(state: State) -> State:
    """Canary the new version."""
    return _run_step("canary", state)


@app.task(base=JobTask, name="undertow.promote")
def promote(state: State) -> State:
    """Promote the canaried version, or roll it back when the canary failed."""
    if not state.get("canary", {}).get("passed", False):
        return _run_step("rollback", state)
    return _run_step("promote", state)


@app.task(base=JobTask, name="undertow.rollback")
def rollback(state: State) -> State:
    """Put the previous version back."""
    return _run_step("rollback", state)


@app.task(base=JobTask, name="undertow.evaluate")
def evaluate(state: State) -> State:
    """Evaluate a version on held-out tasks."""
    return _run_step("evaluate", state)


def plan_pool(fleet: FleetControl, settings: Settings, pool: str, replicas: int) -> dict[str, Any]:
    """Forecast the next window of ``pool`` from its load history and size what it can lend."""
    cfg = settings.scheduler
    history = fleet.load_history(pool, cfg.window_s)
    wpd = 86400 // cfg.window_s
    upper, tail = forecast_from_history(
        history,
        wpd,
        cfg.forecast_history_days,
        cfg.forecast_trend_windows,
        cfg.forecast_quantile,
        cfg.burst_reserve_quantile,
    )
    if upper is None:
        return {"pool": pool, "forecast_rps": None, "needed": replicas, "lendable": 0, "generation": 0}
    capacity = fleet.capacity_rps(pool)
    needed = replicas_needed(upper, capacity, cfg.headroom)
    lendable = lendable_replicas(replicas, needed, min(cfg.min_serving_replicas, replicas))
    hot = hot_fraction(cfg.generation_return_s, cfg.burst_interval_s)
    reserve = hot_reserve(tail or upper, upper, capacity, cfg.headroom, hot)
    generation, _ = split_borrowed(
        lendable, cfg.generation_cost_per_token, cfg.training_cost_per_token, reserve, cfg.max_generation_share
    )
    return {
        "pool": pool,
        "forecast_rps": upper,
        "tail_forecast_rps": tail,
        "capacity_rps": capacity,
        "needed": needed,
        "lendable": lendable,
        "hot_reserve": reserve,
        "generation": generation,
    }


def choose_replicas(fleet: FleetControl, engine: Engine, settings: Settings, wanted: int) -> list[tuple[str, str]]:
    """``(replica_id, pool)`` to borrow now: pools deepest in their night first, unleased replicas."""
    held = {lease["replica_id"] for lease in leases.active_leases(engine)}
    offers, free = [], {}
    for pool in settings.scheduler.pools:
        ids = fleet.replicas(pool.name)
        plan = plan_pool(fleet, settings, pool.name, len(ids))
        lent_now = sum(1 for r in ids if r in held)
        offers.append(PoolOffer(pool.name, len(ids), max(0, plan["lendable"] - lent_now)))
        free[pool.name] = [r for r in ids if r not in held]
    picked = []
    for pool_name, n in allocate(offers, wanted).items():
        picked += [(r, pool_name) for r in free[pool_name][:n]]
    return picked


@app.task(base=JobTask, bind=True, name="undertow.rl_update")
def rl_update(self: Any, state: State) -> State:
    """RL update on borrowed replicas; yields to recalls and resumes from its checkpoint."""
    settings = worker_settings()
    engine = worker_engine()
    cfg = settings.scheduler
    fleet = fleet_control(settings)
    holder = self.request.id
    replicas = state.get("_replicas") or choose_replicas(fleet, engine, settings, cfg.training_replicas)
    replicas = [(r, p) for r, p in replicas if lend(fleet, engine, r, p, holder, "training", cfg.lease_ttl_s)]
    if not replicas:
        raise self.retry(
            exc=Preempted("no replica can be lent now"), countdown=cfg.preempt_resume_s, max_retries=PREEMPT_MAX_RETRIES
        )
    session = resolve(cfg.rl_trainer)(settings, state)
    checkpoint = Path(settings.home) / cfg.checkpoint_dir / f"{state.get('run_id', holder)}.ckpt"
    outcome = run_preemptible(
        session, checkpoint, engine, [r for r, _ in replicas], holder, cfg.lease_ttl_s, cfg.checkpoint_every_steps
    )
    for replica_id, pool in replicas:
        give_back(fleet, engine, replica_id, pool, holder, event="returned" if outcome.finished else "preempted")
    if not outcome.finished:
        raise self.retry(
            exc=Preempted(f"yielded after {outcome.steps} steps"),
            countdown=cfg.preempt_resume_s,
            max_retries=PREEMPT_MAX_RETRIES,
        )
    return {**state, "rl_update": {**outcome.result, "resumed": outcome.resumed}}


@app.task(base=JobTask, name="undertow.plan_capacity")
def plan_capacity() -> dict[str, Any]:
    """Plan every pool for the next window; recall borrowed replicas beyond what a pool can lend."""
    settings = worker_settings()
    engine = worker_engine()
    fleet = fleet_control(settings)
    held = leases.active_leases(engine)
    plans = []
    for pool in settings.scheduler.pools:
        ids = fleet.replicas(pool.name)
        plan = plan_pool(fleet, settings, pool.name, len(ids))
        lent = [lease["replica_id"] for lease in held if lease["pool"] == pool.name and not lease["recall_requested"]]
        excess = max(0, len(lent) - plan["lendable"])
        plan["recalled"] = (
            leases.request_recall(engine, lent[:excess], settings.scheduler.preempt_deadline_s) if excess else []
        )
        plans.append(plan)
    return {"plans": plans}


@app.task(base=JobTask, name="undertow.reap_leases")
def reap_leases() -> dict[str, Any]:
    """Return every replica whose lease expired (its holder died)."""
    settings = worker_settings()
    return {"returned": reap(fleet_control(settings), worker_engine())}


def loop_chain(
    celery: Celery | None = None, run_id: str | None = None, *, evaluate: bool = False, **inputs: Any
) -> Any:
    """The loop as one canvas chain; ``.apply_async()`` it. Signatures go by name so any
    configured app (``make_celery(settings)``) can send them; ``evaluate`` appends the held-out
    evaluation of the new version."""
    celery = celery or app
    state: State = {"run_id": run_id or uuid.uuid4().hex[:12], **inputs}
    names = ["collect", "retrain", "rl_update", "snapshot", "canary", "promote"] + (["evaluate"] if evaluate else [])
    first, *rest = names
    return chain(
        celery.signature(f"undertow.{first}", args=(state,)), *(celery.signature(f"undertow.{n}") for n in rest)
    )
