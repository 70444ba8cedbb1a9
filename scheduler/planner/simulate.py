"""Replay a request-rate trace through the real planner, with replicas as simulated capacity.

For every pool (the trace shifted to the pool's daily phase) the simulator draws the arrival rate
over every ``tau``-second interval (:mod:`scheduler.planner.demand`), then replays three lending
policies through the same borrowing machinery:

- **planner**: the production path: :class:`~scheduler.planner.forecast.DemandForecaster` sees only
  what the fleet has measured by decision time (``return_s`` before the window starts, so a
  returning replica is serving on time), sizes the serving set with headroom at the SLO capacity,
  and lends the rest, with a hot reserve of generation replicas sized by the forecaster's tail;
  when a burst outgrows the plan it recalls replicas (preemption);
- **fixed window**: the usual operator rule: lend a fixed number of replicas every night between
  two local hours, sized from the warm-up days with the same headroom (and the same preemption);
- **oracle**: knows every window's true peak in hindsight and lends exactly what it does not need
  (same window granularity and hand-over costs, never preempted): the upper bound.

Harvest counts only usable borrowed time: a replica lent at a window start is usable after
draining and sleeping; one handed back loses the checkpoint, wake and verify time; a preempted
one stops at the recall. A window violates the SLO through borrowing when demand over some interval exceeds
the serving replicas' capacity at the SLO while the whole pool would have covered it; intervals
beyond the whole pool's capacity are counted apart (``no_borrow_slo_violations``). Gaps are
neither planned nor scored. Windows of the first ``warmup_days`` only feed the forecaster's history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler.planner.borrow import BorrowTimings, replicas_to_recall
from scheduler.planner.capacity import hot_fraction, hot_reserve, lendable_replicas, replicas_needed, split_borrowed
from scheduler.planner.demand import sample_interval_demand, window_peaks
from scheduler.planner.forecast import DemandForecaster
from scheduler.planner.trace import Trace, TraceError
from scheduler.settings.sections import PoolConfig, SchedulerConfig

FLEET_MARGIN = 1.1
FLEET_PEAK_QUANTILE = 0.99


@dataclass
class PolicyResult:
    """What one lending policy achieved on one pool."""

    harvested_replica_s: float = 0.0
    generation_replica_s: float = 0.0
    slo_violation_windows: int = 0
    slo_violation_intervals: int = 0
    preempt_latencies_s: list[float] = field(default_factory=list)
    deadline_misses: int = 0
    violated: list[int] = field(default_factory=list)
    """Indices of the windows that violated the SLO through borrowing."""

    def merge(self, other: PolicyResult) -> None:
        self.harvested_replica_s += other.harvested_replica_s
        self.generation_replica_s += other.generation_replica_s
        self.slo_violation_windows += other.slo_violation_windows
        self.slo_violation_intervals += other.slo_violation_intervals
        self.preempt_latencies_s += other.preempt_latencies_s
        self.deadline_misses += other.deadline_misses
        self.violated += other.violated


@dataclass(frozen=True)
class PoolSetup:
    """A pool's fixed facts during a replay."""

    replicas: int
    capacity_rps: float
    min_serving: int


def planner_targets(
    peaks_seen: np.ndarray, setup: PoolSetup, cfg: SchedulerConfig, wpd: int
) -> tuple[np.ndarray, np.ndarray]:
    """Replicas the planner lends per window, and the hot reserve it asks for among them, from
    what was measured before each decision."""
    f = DemandForecaster(wpd, cfg.forecast_history_days, cfg.forecast_trend_windows, cfg.forecast_quantile)
    targets = np.zeros(len(peaks_seen), dtype=np.int64)
    reserve = np.zeros(len(peaks_seen), dtype=np.int64)
    hot = hot_fraction(cfg.generation_return_s, cfg.burst_interval_s)
    for w in range(len(peaks_seen)):
        upper = f.forecast(w)
        # After a telemetry gap the planner has no recent measurement: it lends nothing until it has one.
        if upper is not None and w > 0 and not math.isnan(peaks_seen[w - 1]):
            needed = replicas_needed(upper, setup.capacity_rps, cfg.headroom)
            targets[w] = lendable_replicas(setup.replicas, needed, setup.min_serving)
            tail = f.forecast(w, cfg.burst_reserve_quantile) or upper
            reserve[w] = hot_reserve(tail, upper, setup.capacity_rps, cfg.headroom, hot)
        f.observe(w, float(peaks_seen[w]))
    return targets, reserve


def oracle_targets(peaks: np.ndarray, setup: PoolSetup) -> np.ndarray:
    """Hindsight: lend whatever the true peak of the window does not need."""
    out = np.zeros(len(peaks), dtype=np.int64)
    for w, p in enumerate(peaks):
        if not math.isnan(p):
            out[w] = lendable_replicas(setup.replicas, replicas_needed(p, setup.capacity_rps, 0.0), setup.min_serving)
    return out


def fixed_window_targets(
    peaks: np.ndarray, trace: Trace, setup: PoolSetup, cfg: SchedulerConfig, warmup: int
) -> np.ndarray:
    """Lend a constant number of replicas inside the nightly window, sized on the warm-up days."""
    hours = (trace.start_s % 86400) / 3600.0
    start, end = cfg.fixed_window_start_h, cfg.fixed_window_end_h
    inside = (hours >= start) & (hours < end) if start < end else (hours >= start) | (hours < end)
    seen = peaks[:warmup][inside[:warmup]]
    if len(seen) == 0 or np.isnan(seen).all():
        return np.zeros(len(peaks), dtype=np.int64)
    needed = replicas_needed(float(np.nanmax(seen)), setup.capacity_rps, cfg.headroom)
    k = lendable_replicas(setup.replicas, needed, setup.min_serving)
    return np.where(inside, k, 0).astype(np.int64)


@dataclass
class _Lent:
    """The replicas lent in one window: role, when each becomes usable, until when it stays lent."""

    is_gen: list[bool]
    usable_from: list[float]
    until: list[float]

    def order(self, window_s: float) -> list[int]:
        """Replicas still lent, cheapest to recall first: generation, then not yet handed over."""
        live = [j for j in range(len(self.until)) if self.until[j] >= window_s]
        return sorted(live, key=lambda j: (not self.is_gen[j], self.usable_from[j] == 0.0, -self.usable_from[j]))


def _recall(
    lent: _Lent,
    j: int,
    t: float,
    timings: BorrowTimings,
    cfg: SchedulerConfig,
    rng: np.random.Generator,
    res: PolicyResult,
) -> float:
    """Hand replica ``j`` back at time ``t``; returns the recall latency."""
    if lent.is_gen[j]:
        latency = timings.generation_return_s
    elif lent.usable_from[j] > t:  # still draining (abort) or asleep (wake, no checkpoint)
        latency = timings.wake_s + timings.verify_s if t >= cfg.drain_s else 0.0
    else:  # training yields at its next step boundary, then checkpoints, wakes and verifies
        latency = float(rng.uniform(0.0, cfg.train_step_s)) + timings.return_s
    lent.until[j] = min(lent.until[j], t)
    res.preempt_latencies_s.append(latency)
    res.deadline_misses += latency > cfg.preempt_deadline_s
    return latency


def replay(
    targets: np.ndarray,
    demand: np.ndarray,
    setup: PoolSetup,
    cfg: SchedulerConfig,
    first: int,
    preempt: bool = True,
    seed: int = 0,
    reserve: np.ndarray | None = None,
) -> PolicyResult:
    """Run lending targets against the interval demand from window ``first`` on.

    Borrowed replicas split into generation and training (:func:`split_borrowed`). When an
    interval's demand overflows the serving replicas, awake generation replicas take the overflow
    after ``generation_return_s`` (they keep the serving weights); past the trigger utilization,
    replicas are recalled (generation first, then those still asleep, then training, which yields
    at its next step boundary and checkpoints). ``reserve`` (the planner's hot reserve per window)
    moves borrowed replicas from training to generation (:func:`split_borrowed`).
    """
    timings = BorrowTimings(
        cfg.drain_s, cfg.sleep_s, cfg.checkpoint_s, cfg.wake_s, cfg.verify_s, cfg.generation_return_s
    )
    rng = np.random.default_rng(seed + 7919)
    n_windows, k = demand.shape
    window_s = float(cfg.window_s)
    tau = window_s / k
    cap = setup.capacity_rps
    hot_share = hot_fraction(cfg.generation_return_s, cfg.burst_interval_s)
    res = PolicyResult()
    lent_end = 0
    prev_gen_share = 0.0
    for w in range(first, n_windows):
        gap = bool(np.isnan(demand[w]).all())
        target = 0 if gap else int(targets[w])
        if preempt and target > lent_end and w > 0 and not np.isnan(demand[w - 1, -3:]).all():
            # Hand-over gate: drain new replicas only if the load right now leaves room for it.
            now = float(np.nanmax(demand[w - 1, -3:]))
            allowed = lendable_replicas(setup.replicas, replicas_needed(now, cap, cfg.headroom), setup.min_serving)
            target = min(target, max(lent_end, allowed))
        returning = max(0, lent_end - target)
        if returning and w > first:
            # Planned return: the end of the previous window is spent checkpointing and waking.
            lost = returning * min(timings.return_s + cfg.train_step_s, window_s)
            res.harvested_replica_s -= lost
            res.generation_replica_s -= lost * prev_gen_share
        gen, _ = split_borrowed(
            target,
            cfg.generation_cost_per_token,
            cfg.training_cost_per_token,
            int(reserve[w]) if reserve is not None else 0,
            cfg.max_generation_share,
        )
        kept = min(lent_end, target)
        is_gen = [j < gen for j in range(target)]
        usable_from = [
            0.0 if j < kept else min(cfg.drain_s if is_gen[j] else timings.lend_s, window_s) for j in range(target)
        ]
        until = [window_s] * target
        arrivals: list[tuple[float, int]] = []
        serving = setup.replicas - target
        violated = False

        lent = _Lent(is_gen, usable_from, until)

        if not gap:
            for i in range(k):
                t0 = i * tau
                while arrivals and arrivals[0][0] <= t0:
                    serving += arrivals.pop(0)[1]
                d = float(demand[w, i])
                capacity = serving * cap
                if preempt and d > capacity:
                    # Spill-over onto awake generation replicas within the interval.
                    hot = [j for j in lent.order(window_s) if is_gen[j]]
                    need = math.ceil((d - capacity) / (cap * hot_share) - 1e-9) if hot_share > 0 else 0
                    for j in hot[:need]:
                        _recall(lent, j, t0, timings, cfg, rng, res)
                        capacity += cap * hot_share
                        arrivals.append((t0 + tau, 1))
                    arrivals.sort()
                if capacity < d <= setup.replicas * cap:
                    violated = True
                    res.slo_violation_intervals += 1
                if not preempt:
                    continue
                live = lent.order(window_s)
                in_flight = sum(n for _, n in arrivals)
                r = replicas_to_recall(
                    d, serving + in_flight, len(live), cap, cfg.headroom, cfg.preempt_trigger_utilization
                )
                for j in live[:r]:
                    arrivals.append((t0 + tau + _recall(lent, j, t0 + tau, timings, cfg, rng, res), 1))
                arrivals.sort()
        res.slo_violation_windows += violated
        if violated:
            res.violated.append(w)
        prev_gen_share = gen / target if target else 0.0
        used = sum(max(0.0, u - f) for f, u in zip(usable_from, until, strict=True))
        res.harvested_replica_s += used
        res.generation_replica_s += sum(
            max(0.0, u - f) for f, u, g in zip(usable_from, until, is_gen, strict=True) if g
        )
        lent_end = sum(1 for u in until if u >= window_s)
    return res


def _pool_setup(pool: PoolConfig, peak: float, cfg: SchedulerConfig, capacity_rps: float | None) -> PoolSetup:
    cap = capacity_rps if capacity_rps else peak * FLEET_MARGIN / pool.replicas
    return PoolSetup(pool.replicas, cap, min(cfg.min_serving_replicas, pool.replicas))


def simulate(
    trace: Trace,
    cfg: SchedulerConfig,
    *,
    warmup_days: int = 2,
    capacity_rps: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay ``trace`` on every configured pool; returns the report (see the module docstring).

    ``capacity_rps`` is a replica's capacity at the SLO; by default (trace rates are relative
    load) each pool is sized like an operator would: its whole fleet serves the 99th percentile
    of the window peaks with a 10% margin. Rarer bursts overload even the full fleet; they are
    reported as ``no_borrow_slo_violations`` and not charged to borrowing.
    """
    if trace.window_s != cfg.window_s:
        cfg = cfg.model_copy(update={"window_s": trace.window_s})
    if trace.window_s % cfg.burst_interval_s:
        raise TraceError(f"burst interval {cfg.burst_interval_s} s must divide the window length {trace.window_s} s")
    wpd = trace.windows_per_day
    first = warmup_days * wpd
    if len(trace) <= first + wpd // 4:
        raise TraceError(
            f"{trace.source}: {len(trace)} windows ({len(trace) / wpd:.1f} days); the simulation needs "
            f"{warmup_days} warm-up day(s) of history plus at least a quarter day to score"
        )
    k = trace.window_s // cfg.burst_interval_s
    lead_intervals = min(
        k, math.ceil((cfg.checkpoint_s + cfg.wake_s + cfg.verify_s + cfg.train_step_s) / cfg.burst_interval_s)
    )
    totals = {name: PolicyResult() for name in ("planner", "fixed", "oracle")}
    idle_replica_s = 0.0
    no_borrow_violations = 0
    pools_out = []
    gpu_h = 0.0
    for n, pool in enumerate(cfg.pools):
        local = trace.shifted(pool.utc_offset_h) if pool.utc_offset_h else trace
        demand = sample_interval_demand(local, cfg.burst_interval_s, seed=seed + n)
        peaks = window_peaks(demand)
        setup = _pool_setup(pool, float(np.nanquantile(peaks, FLEET_PEAK_QUANTILE)), cfg, capacity_rps)
        # What the fleet has measured when it decides: the previous window up to `lead` before its end.
        seen = demand[:, : k - lead_intervals] if lead_intervals < k else demand[:, :1]
        peaks_seen = window_peaks(seen)
        planned, reserve = planner_targets(peaks_seen, setup, cfg, wpd)
        policies = {
            "planner": (planned, True, reserve),
            "fixed": (fixed_window_targets(peaks, local, setup, cfg, first), True, None),
            "oracle": (oracle_targets(peaks, setup), False, None),
        }
        scale = pool.gpus_per_replica / 3600.0
        pool_out: dict[str, Any] = {
            "name": pool.name,
            "region": pool.region,
            "replicas": pool.replicas,
            "utc_offset_h": pool.utc_offset_h,
            "replica_capacity_rps": round(setup.capacity_rps, 3),
        }
        for name, (targets, preempt, hot_replicas) in policies.items():
            r = replay(targets, demand, setup, cfg, first, preempt=preempt, seed=seed + n, reserve=hot_replicas)
            pool_out[f"{name}_gpu_h"] = round(r.harvested_replica_s * scale, 3)
            r.harvested_replica_s *= pool.gpus_per_replica
            r.generation_replica_s *= pool.gpus_per_replica
            totals[name].merge(r)
        scored = ~np.isnan(peaks[first:])
        needed = np.array([replicas_needed(p, setup.capacity_rps, 0.0) for p in peaks[first:][scored]])
        idle = np.maximum(0, np.minimum(pool.replicas - needed, pool.replicas - setup.min_serving))
        idle_replica_s += float(idle.sum()) * cfg.window_s * pool.gpus_per_replica
        no_borrow_violations += int((demand[first:][scored] > pool.replicas * setup.capacity_rps).any(axis=1).sum())
        gpu_h += pool.replicas * pool.gpus_per_replica * int(scored.sum()) * cfg.window_s / 3600.0
        pools_out.append(pool_out)
    ours, fixed, oracle = totals["planner"], totals["fixed"], totals["oracle"]
    lat = np.asarray(ours.preempt_latencies_s)
    return {
        "trace": trace.source,
        "windows": len(trace),
        "gap_windows": int(trace.gaps.sum()),
        "scored_windows": int((~trace.gaps[first:]).sum()),
        "warmup_days": warmup_days,
        "fleet_gpu_h": round(gpu_h, 3),
        "harvested_gpu_h": round(ours.harvested_replica_s / 3600.0, 3),
        "generation_gpu_h": round(ours.generation_replica_s / 3600.0, 3),
        "training_gpu_h": round((ours.harvested_replica_s - ours.generation_replica_s) / 3600.0, 3),
        "oracle_gpu_h": round(oracle.harvested_replica_s / 3600.0, 3),
        "fixed_window_gpu_h": round(fixed.harvested_replica_s / 3600.0, 3),
        "idle_gpu_h": round(idle_replica_s / 3600.0, 3),
        "harvest_ratio": round(ours.harvested_replica_s / oracle.harvested_replica_s, 4)
        if oracle.harvested_replica_s
        else 0.0,
        "fixed_window_ratio": round(fixed.harvested_replica_s / oracle.harvested_replica_s, 4)
        if oracle.harvested_replica_s
        else 0.0,
        "slo_violations": ours.slo_violation_windows,
        "slo_violation_intervals": ours.slo_violation_intervals,
        "slo_violation_windows": sorted(ours.violated),
        "fixed_window_slo_violations": fixed.slo_violation_windows,
        "oracle_slo_violations": oracle.slo_violation_windows,
        "no_borrow_slo_violations": no_borrow_violations,
        "preemptions": len(lat),
        "fixed_window_preemptions": len(fixed.preempt_latencies_s),
        "p99_preempt_s": round(float(np.quantile(lat, 0.99)), 2) if len(lat) else 0.0,
        "max_preempt_s": round(float(lat.max()), 2) if len(lat) else 0.0,
        "preempt_deadline_s": cfg.preempt_deadline_s,
        "preempt_deadline_misses": ours.deadline_misses,
        "pools": pools_out,
    }
