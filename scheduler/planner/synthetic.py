"""A synthetic request-rate trace for checks on data the planner was never tuned on.

Two daily peaks (10:00 and 20:00 local) over a 35% floor, a compounding daily trend, AR(1)
log-noise (phi 0.8, sigma 4%), an inter-arrival CV drawn in [1.5, 3.5] per window, a phase shift
and one three-window collection gap. Nothing in it is fitted to the ServeGen trace.
"""

from __future__ import annotations

import numpy as np

from scheduler.planner.trace import Trace


def synthetic_trace(
    days: int = 6, seed: int = 0, shift_h: float = 7.0, trend: float = 0.05, level_rps: float = 800.0
) -> Trace:
    """The trace described in the module docstring (10-minute windows)."""
    rng = np.random.default_rng(seed)
    w = 144
    t = np.arange(days * w)
    hour = ((t % w) / 6.0 + shift_h) % 24
    shape = 0.35 + 0.65 * np.exp(-(((hour - 10) / 2.5) ** 2)) + 0.8 * np.exp(-(((hour - 20) / 3) ** 2))
    noise = np.zeros(len(t))
    shocks = rng.standard_normal(len(t)) * 0.04
    for i in range(1, len(t)):
        noise[i] = 0.8 * noise[i - 1] + shocks[i]
    rate = level_rps * (1 + trend) ** (t / w) * shape * np.exp(noise)
    cv = 1.5 + 2 * rng.random(len(t))
    rate[200:203] = np.nan
    return Trace(600, t * 600, rate, cv * cv * rate, f"synthetic(seed={seed}, shift={shift_h:+g} h)")
