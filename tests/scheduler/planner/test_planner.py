"""Pure planning logic: forecast, capacity at the SLO, lending, the generation/training split,
the borrowing state machine, preemption sizing, pools by region, and within-window demand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from scheduler.planner.borrow import (
    BorrowTimings,
    IllegalTransition,
    ReplicaState,
    check_transition,
    replicas_to_recall,
    return_path,
)
from scheduler.planner.capacity import (
    capacity_at_slo,
    hot_fraction,
    hot_reserve,
    lendable_replicas,
    queueing_p99_latency,
    replicas_needed,
    split_borrowed,
)
from scheduler.planner.demand import interval_means, sample_interval_demand, window_peaks
from scheduler.planner.forecast import DemandForecaster, forecast_from_history
from scheduler.planner.pools import PoolOffer, allocate, local_hour
from scheduler.planner.trace import Trace

W = 144


def _daily(days: int, level: float = 1000.0, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    t = np.arange(days * W)
    rng = np.random.default_rng(seed)
    return level * (1.0 + 0.4 * np.sin(2 * np.pi * t / W)) * (1.0 + noise * rng.standard_normal(len(t)))


def test_forecast_follows_the_daily_profile() -> None:
    y = _daily(5)
    f = DemandForecaster(W, history_days=3, quantile=0.95)
    for i in range(4 * W):
        f.point(i)
        f.observe(i, y[i])
    for i in range(4 * W, 4 * W + 20):
        assert f.point(i) == pytest.approx(y[i], rel=0.03)
        f.observe(i, y[i])
    assert f.margin(4 * W + 20) == pytest.approx(1.0, abs=0.03)  # a perfect fit needs no margin


def test_forecast_trend_correction_follows_a_level_shift() -> None:
    y = _daily(5)
    y[4 * W :] *= 1.5  # the fifth day runs 50% hotter
    f = DemandForecaster(W, history_days=3, trend_windows=6)
    for i in range(4 * W + 10):
        f.point(i)
        f.observe(i, y[i])
    assert f.point(4 * W + 10) == pytest.approx(y[4 * W + 10], rel=0.05)


def test_forecast_margin_widens_with_noise_and_stays_an_upper_bound() -> None:
    calm, noisy = _daily(6, noise=0.01, seed=1), _daily(6, noise=0.1, seed=1)
    m = []
    covered = 0
    for y in (calm, noisy):
        f = DemandForecaster(W, history_days=3, quantile=0.95)
        for i in range(6 * W):
            up = f.forecast(i)
            if i >= 3 * W and y is noisy:
                covered += up is not None and y[i] <= up
            f.observe(i, y[i])
        m.append(f.margin(6 * W))
    assert m[1] > m[0] > 1.0
    assert covered / (3 * W) > 0.9  # the 95% upper forecast covers most windows


def test_forecast_handles_gaps_and_cold_start() -> None:
    f = DemandForecaster(W)
    assert f.forecast(0) is None
    f.observe(0, float("nan"))
    assert f.forecast(1) is None
    f.observe(1, 500.0)
    assert f.forecast(2) == pytest.approx(500.0 * f.cold_margin)
    y = _daily(3)
    y[100:110] = np.nan
    up, tail = forecast_from_history(y, W, history_days=2, quantile=0.8, tail_quantile=0.999)
    assert up is not None and math.isfinite(up) and up >= y[-W + 1] * 0.9
    assert tail is not None and tail >= up


def test_forecast_never_plans_below_the_peak_just_measured() -> None:
    y = _daily(5)
    with_floor, without = (
        DemandForecaster(W, history_days=3),
        DemandForecaster(W, history_days=3, persistence_floor=False),
    )
    for f in (with_floor, without):
        for i in range(4 * W):
            f.forecast(i)
            f.observe(i, y[i])
        f.observe(4 * W, 3.0 * y[4 * W])  # a surge the median level has not caught up with
    assert without.forecast(4 * W + 1) < 3.0 * y[4 * W]
    assert with_floor.forecast(4 * W + 1) == pytest.approx(3.0 * y[4 * W])
    # The tail quantile of the same errors is at least the planning one.
    assert with_floor.margin(4 * W + 1, 0.999) >= with_floor.margin(4 * W + 1, 0.8)


def test_capacity_at_slo_interpolates_a_measured_curve() -> None:
    loads = [10, 20, 30, 40]
    lat = [0.5, 0.8, 1.6, 3.2]
    assert capacity_at_slo(loads, lat, 2.0) == pytest.approx(30 + 10 * (2.0 - 1.6) / (3.2 - 1.6))
    assert capacity_at_slo(loads, lat, 5.0) == 40
    # A noisy dip cannot raise the capacity: latency is taken as non-decreasing in load.
    assert capacity_at_slo([10, 20, 30], [0.5, 2.5, 1.0], 2.0) < 20
    with pytest.raises(ValueError, match="over the SLO"):
        capacity_at_slo(loads, lat, 0.1)
    with pytest.raises(ValueError):
        capacity_at_slo([], [], 1.0)
    curve = [queueing_p99_latency(x, 100.0, 0.5) for x in (0, 50, 75, 100)]
    assert curve == [0.5, 1.0, 2.0, math.inf]


def test_lending_and_split() -> None:
    assert replicas_needed(950, 100, 0.05) == 10
    assert replicas_needed(1000, 100, 0.0) == 10
    assert lendable_replicas(32, 10, 1) == 22
    assert lendable_replicas(32, 40, 1) == 0
    assert lendable_replicas(1, 0, 1) == 0
    assert split_borrowed(0, 1, 2) == (0, 0)
    assert split_borrowed(1, 1, 2) == (0, 1)
    assert split_borrowed(9, 1, 2) == (3, 6)  # a third generates
    assert split_borrowed(8, 1, 3) == (2, 6)  # a quarter at 1:3
    assert split_borrowed(2, 1, 100) == (1, 1)
    # The hot reserve moves replicas from training to generation, up to the share cap, and
    # training keeps at least one replica.
    assert split_borrowed(9, 1.5, 3, reserve=5, max_generation_share=0.6) == (5, 4)
    assert split_borrowed(10, 1.5, 3, reserve=9, max_generation_share=0.6) == (6, 4)
    assert split_borrowed(9, 1.5, 3, reserve=1, max_generation_share=0.6) == (3, 6)  # cost share wins
    assert split_borrowed(2, 1.5, 3, reserve=5, max_generation_share=1.0) == (1, 1)


def test_hot_reserve_covers_the_tail_beyond_the_plan() -> None:
    assert hot_fraction(2.0, 10.0) == pytest.approx(0.8)
    assert hot_fraction(20.0, 10.0) == 0.0
    # Tail needs 13 replicas, the plan 10: 3 replicas of burst, each recalled one serves 80% of it.
    assert hot_reserve(1300, 1000, 100, 0.0, 0.8) == 4
    assert hot_reserve(1000, 1000, 100, 0.0, 0.8) == 0
    assert hot_reserve(1300, 1000, 100, 0.0, 0.0) == 0


def test_state_machine() -> None:
    s = ReplicaState
    assert check_transition(s.SERVING, s.DRAINING) is s.DRAINING
    with pytest.raises(IllegalTransition, match="cannot move"):
        check_transition(s.SERVING, s.LENT)
    with pytest.raises(IllegalTransition):
        check_transition(s.LENT, s.SERVING)  # must wake and verify first
    assert return_path(s.LENT) == [s.CHECKPOINTING, s.WAKING, s.VERIFYING, s.SERVING]
    assert return_path(s.LENT, generation=True) == [s.VERIFYING, s.SERVING]
    assert return_path(s.DRAINING) == [s.SERVING]
    for start in s:
        path = [start, *return_path(start)]
        for a, b in itertools.pairwise(path):
            check_transition(a, b)
    t = BorrowTimings(drain_s=20, sleep_s=5, checkpoint_s=15, wake_s=20, verify_s=5)
    assert t.lend_s == 25 and t.return_s == 40


def test_replicas_to_recall() -> None:
    assert replicas_to_recall(800, 10, 5, 100, 0.1, 0.9) == 0
    assert replicas_to_recall(950, 10, 5, 100, 0.1, 0.9) == 1  # 950 * 1.1 / 100 = 10.45 -> 11
    assert replicas_to_recall(2000, 10, 5, 100, 0.1, 0.9) == 5  # bounded by what is borrowed
    assert replicas_to_recall(2000, 10, 0, 100, 0.1, 0.9) == 0


def test_pools_borrow_where_it_is_night() -> None:
    offers = [PoolOffer("eu", 10, 2), PoolOffer("ap", 10, 8), PoolOffer("us", 20, 10)]
    assert allocate(offers, 5) == {"ap": 5}
    assert allocate(offers, 12) == {"ap": 8, "us": 4}
    assert allocate(offers, 100) == {"ap": 8, "us": 10, "eu": 2}
    assert allocate(offers, 0) == {}
    with pytest.raises(ValueError):
        allocate(offers, -1)
    assert local_hour(3600 * 23, 2) == pytest.approx(1.0)
    assert local_hour(0, -5) == pytest.approx(19.0)


def _trace(rates: list[float], disp: list[float] | None = None) -> Trace:
    r = np.asarray(rates, dtype=float)
    d = np.asarray(disp if disp is not None else rates, dtype=float)
    r[r == 0] = np.nan
    d[np.isnan(r)] = np.nan
    return Trace(600, np.arange(len(r)) * 600, r, d, "test")


def test_interval_demand_keeps_the_mean_and_models_bursts() -> None:
    t = _trace([1000.0] * 50)
    calm = sample_interval_demand(t, 10, seed=1)
    assert calm.shape == (50, 60)
    assert calm.mean() == pytest.approx(1000, rel=0.01)
    assert calm.std() == pytest.approx(math.sqrt(1000 / 10), rel=0.1)  # Poisson: var = rate / tau
    bursty = sample_interval_demand(_trace([1000.0] * 50, [1000.0 * 25**2] * 50), 10, seed=1)
    assert bursty.std() > 10 * calm.std()
    # No interval holds more than the window's arrivals (mean rate times k intervals).
    assert np.nanmax(window_peaks(bursty)) <= 1000 * 60 * (1 + 1e-9)
    wild = sample_interval_demand(_trace([10.0] * 200, [10.0 * 100**2] * 200), 10, seed=2)
    assert np.nanmax(wild) <= 10.0 * 60 * (1 + 1e-9) and np.nanmax(wild) > 10.0 * 30
    assert (sample_interval_demand(t, 10, seed=1) == calm).all()  # seeded


def test_interval_means_ramp_between_windows_and_gaps_are_nan() -> None:
    t = _trace([100.0, 200.0, 0.0, 300.0])
    m = interval_means(t, 10)
    assert m[0, 0] == pytest.approx(100) and m[0, -1] == pytest.approx(100 + 100 * (59.5 / 60 - 0.5), rel=1e-6)
    assert m[1, 0] < 200 < m[1, 30] + 1  # leans towards the previous window at its start
    d = sample_interval_demand(t, 10)
    assert np.isnan(d[2]).all() and np.isnan(window_peaks(d)[2])
    with pytest.raises(ValueError, match="must divide"):
        sample_interval_demand(t, 7)
