"""Demand inside a window: a trace gives one mean rate per 10 minutes, users feel seconds.

Serving capacity has to cover the arrival rate over every short interval ``tau`` (default
10 s), not the window mean. Two effects move the short-interval rate away from the mean:

- the trend: the rate drifts from one window to the next; we interpolate linearly between
  window centres, so the end of a window leans towards the next window's level;
- burstiness: for a renewal process with inter-arrival coefficient of variation ``cv``, the
  count in ``tau`` has variance ``cv^2 * lambda * tau`` (Cox 1962), so the rate over ``tau``
  has variance ``D / tau`` with the trace's dispersion ``D = sum_i cv_i^2 * lambda_i``
  (independent clients add variances; with per-client data each client is drawn on its own
  and the draws summed). It is capped at ``m^2 (k - 1)``, the variance of a
  window whose every arrival lands in one of its ``k`` intervals (heavy-tailed clients in the
  ServeGen data reach a CV of 100 and more), and each draw is cut at that same bound (one
  interval cannot hold more than the window's arrivals: the gamma tail would exceed it).

Each interval's rate is drawn from a gamma distribution with that mean and variance (moment
matching keeps it non-negative and right-skewed like bursty traffic). The draw is seeded, so a
replay is reproducible; the planner never sees the draws of a window before it happens.
"""

from __future__ import annotations

import numpy as np

from scheduler.planner.trace import Trace


def interval_means(trace: Trace, tau_s: int) -> np.ndarray:
    """Trend-following mean rate per ``tau`` interval, shape ``(windows, window_s // tau)``.

    Linear interpolation between window centres; a gap or the trace's edge holds the level.
    """
    k = trace.window_s // tau_s
    rate = trace.rate
    n = len(rate)
    filled = rate.copy()
    prev = np.concatenate([[np.nan], rate[:-1]])
    nxt = np.concatenate([rate[1:], [np.nan]])
    prev = np.where(np.isnan(prev), filled, prev)
    nxt = np.where(np.isnan(nxt), filled, nxt)
    offsets = (np.arange(k) + 0.5) / k - 0.5  # position relative to the window centre, in windows
    left = offsets < 0
    means = np.empty((n, k))
    means[:, left] = filled[:, None] + (filled - prev)[:, None] * offsets[None, left]
    means[:, ~left] = filled[:, None] + (nxt - filled)[:, None] * offsets[None, ~left]
    return means


def _gamma(means: np.ndarray, variance: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Gamma draws with the given means and variances (the mean itself where either is 0)."""
    k = means.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        # A window cannot hold more than all its arrivals in one interval: var <= m^2 (k - 1).
        variance = np.minimum(variance, means * means * (k - 1))
        ok = (means > 0) & (variance > 0)
        shape = np.where(ok, means * means / np.where(ok, variance, 1.0), 1.0)
        scale = np.where(ok, variance / np.where(ok, means, 1.0), 0.0)
    # Nor can one interval hold more arrivals than the whole window: the gamma tail is cut there.
    window_total = np.nansum(np.maximum(np.nan_to_num(means), 0.0), axis=-1, keepdims=True)
    draws = np.minimum(rng.gamma(shape, scale), window_total)
    return np.where(ok, draws, np.maximum(np.nan_to_num(means), 0.0))


def sample_interval_demand(trace: Trace, tau_s: int, seed: int = 0) -> np.ndarray:
    """Seeded draw of the arrival rate over every ``tau`` interval (NaN rows on gaps).

    With per-client data each client is drawn on its own and the draws are summed (a steady
    client stays steady beside a bursty one); otherwise the window is one component.
    """
    if trace.window_s % tau_s:
        raise ValueError(f"burst interval {tau_s} s must divide the window length {trace.window_s} s")
    means = interval_means(trace, tau_s)
    rng = np.random.default_rng(seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        level = means / trace.rate[:, None]  # the trend, relative to the window mean
    if trace.client_rate is None or trace.client_dispersion is None:
        draws = _gamma(means, trace.dispersion[:, None] * level / tau_s, rng)
    else:
        draws = np.zeros_like(means)
        for rate_c, disp_c in zip(trace.client_rate, trace.client_dispersion, strict=True):
            active = rate_c > 0
            if not active.any():
                continue
            m = rate_c[active, None] * level[active]
            draws[active] += _gamma(m, disp_c[active, None] * level[active] / tau_s, rng)
    draws[trace.gaps] = np.nan
    return draws


def window_peaks(demand: np.ndarray) -> np.ndarray:
    """Peak short-interval rate of every window (NaN on gaps): what capacity must cover."""
    out = np.full(demand.shape[0], np.nan)
    ok = ~np.isnan(demand).all(axis=1)
    out[ok] = np.nanmax(demand[ok], axis=1)
    return out
