"""Demand forecast per window from the fleet's own load history, as an upper quantile.

For the window ``t`` with time-of-day slot ``s`` (``W`` windows a day, ``D`` days of history):

    baseline(t) = median{ y[t - d*W + o] : d = 1..D, o in {-1, 0, 1}, observed }
    level(t)    = median{ y[j] / baseline(j) : the last ``trend_windows`` observed j < t }
    point(t)    = level(t) * baseline(t)
    upper(t)    = max( point(t) * max(1, Q_q{ y[j] / point(j) : past forecasts of the last D days }),
                       y[t - 1] )

The seasonal profile is the classic multiplicative decomposition (Hyndman & Athanasopoulos,
*Forecasting: Principles and Practice*, 3rd ed., ch. 3); the level ratio is a recent-trend
correction that follows a day that runs hotter or colder than usual; the upper quantile of the
forecaster's *own* relative errors (an empirical prediction interval, ibid. 5.5) sets how much to
add, so a noisy fleet plans wider than a calm one without any per-trace tuning. Before a day of
history exists the point forecast is persistence (the recent peak) and, until enough errors were
seen, the margin is a conservative ``cold_margin``. The last term is a persistence floor: the
forecast never plans below the peak the fleet has just measured, so a surge that started in the
previous window is not averaged away by the median level (the level catches up only after
several windows). The same forecaster at a higher quantile (``tail``) sizes the hot reserve
(see :func:`scheduler.planner.capacity.split_borrowed`).
"""

from __future__ import annotations

import math

import numpy as np

MIN_ERRORS = 36


class DemandForecaster:
    """Stateful one-window-ahead forecaster of peak demand; feed it with :meth:`observe`."""

    def __init__(
        self,
        windows_per_day: int,
        history_days: int = 7,
        trend_windows: int = 6,
        quantile: float = 0.995,
        cold_margin: float = 1.5,
        persistence_floor: bool = True,
    ) -> None:
        self.w = windows_per_day
        self.days = history_days
        self.trend_windows = trend_windows
        self.quantile = quantile
        self.cold_margin = cold_margin
        self.persistence_floor = persistence_floor
        self.history: dict[int, float] = {}
        self._baseline: dict[int, float] = {}
        self._point: dict[int, float] = {}
        self._errors: list[tuple[int, float]] = []

    def observe(self, index: int, value: float) -> None:
        """Record the observed peak demand of window ``index`` (NaN: a gap, ignored)."""
        if value is None or math.isnan(value):
            return
        self.history[index] = float(value)
        predicted = self._point.get(index)
        if predicted is not None and predicted > 0:
            self._errors.append((index, value / predicted))

    def baseline(self, index: int) -> float | None:
        """Median of the same time-of-day slots (and their neighbours) of the past days."""
        if index in self._baseline:
            return self._baseline[index]
        values = [
            self.history[j]
            for d in range(1, self.days + 1)
            for o in (-1, 0, 1)
            if (j := index - d * self.w + o) in self.history and j < index
        ]
        result = float(np.median(values)) if values else None
        if result is not None:
            self._baseline[index] = result
        return result

    def _recent(self, index: int) -> list[int]:
        out: list[int] = []
        j = index - 1
        while len(out) < self.trend_windows and j >= index - 4 * self.w:
            if j in self.history:
                out.append(j)
            j -= 1
        return out

    def point(self, index: int) -> float | None:
        """Seasonal baseline times the recent level; persistence before a day of history."""
        recent = self._recent(index)
        if not recent:
            return None
        base = self.baseline(index)
        ratios = [self.history[j] / b for j in recent if (b := self.baseline(j))]
        if base is None or not ratios:
            value = max(self.history[j] for j in recent)
        else:
            value = float(np.median(ratios)) * base
        self._point[index] = value
        return value

    def margin(self, index: int, quantile: float | None = None) -> float:
        """Upper ``quantile`` (default: the forecaster's) of the recent relative errors, at least 1."""
        horizon = index - self.days * self.w
        self._errors = [(j, e) for j, e in self._errors if j >= horizon]
        if len(self._errors) < MIN_ERRORS:
            return self.cold_margin
        q = float(np.quantile([e for _, e in self._errors], self.quantile if quantile is None else quantile))
        return max(1.0, q)

    def forecast(self, index: int, quantile: float | None = None) -> float | None:
        """Upper forecast of window ``index``'s peak demand (None: no history at all yet).

        ``quantile`` overrides the error quantile (the hot reserve asks for the tail).
        """
        point = self.point(index)
        if point is None:
            return None
        upper = point * self.margin(index, quantile)
        last = self.history.get(index - 1)
        if self.persistence_floor and last is not None:
            upper = max(upper, last)
        return upper


def forecast_from_history(
    history: np.ndarray,
    windows_per_day: int,
    history_days: int = 7,
    trend_windows: int = 6,
    quantile: float = 0.995,
    tail_quantile: float | None = None,
) -> tuple[float | None, float | None]:
    """Upper and tail forecasts of the window right after ``history`` (per-window peaks, NaN for
    gaps): the forecast at ``quantile`` and at ``tail_quantile`` (None when not asked for).

    Replays the forecaster over the last ``2 * history_days`` days so its error quantile is
    measured exactly as in the simulator (used by the live planning task).
    """
    f = DemandForecaster(windows_per_day, history_days, trend_windows, quantile)
    start = max(0, len(history) - 2 * history_days * windows_per_day)
    for i in range(start, len(history)):
        f.point(i)
        f.observe(i, float(history[i]))
    n = len(history)
    return f.forecast(n), (f.forecast(n, tail_quantile) if tail_quantile is not None else None)
