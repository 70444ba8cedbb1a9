"""Sizing what the loop may borrow: forecast each pool's next window from its load history
(:mod:`scheduler.planner`) and pick the replicas an RL update borrows, pools deepest in their
night first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.loop import leases
from scheduler.loop.borrowing import FleetControl
from scheduler.planner.capacity import hot_fraction, hot_reserve, lendable_replicas, replicas_needed, split_borrowed
from scheduler.planner.forecast import forecast_from_history
from scheduler.planner.pools import PoolOffer, allocate

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings


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


def plan_pools(fleet: FleetControl, settings: Settings) -> list[tuple[list[str], dict[str, Any]]]:
    """Every configured pool's replica ids and its plan (:func:`plan_pool`), in configuration order."""
    planned = []
    for pool in settings.scheduler.pools:
        ids = fleet.replicas(pool.name)
        planned.append((ids, plan_pool(fleet, settings, pool.name, len(ids))))
    return planned


def choose_replicas(fleet: FleetControl, engine: Engine, settings: Settings, wanted: int) -> list[tuple[str, str]]:
    """``(replica_id, pool)`` to borrow now: pools deepest in their night first, unleased replicas."""
    held = {lease["replica_id"] for lease in leases.active_leases(engine)}
    offers, free = [], {}
    for ids, plan in plan_pools(fleet, settings):
        lent_now = sum(1 for r in ids if r in held)
        offers.append(PoolOffer(plan["pool"], len(ids), max(0, plan["lendable"] - lent_now)))
        free[plan["pool"]] = [r for r in ids if r not in held]
    picked = []
    for pool_name, n in allocate(offers, wanted).items():
        picked += [(r, pool_name) for r in free[pool_name][:n]]
    return picked
