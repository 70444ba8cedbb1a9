"""Request-rate traces: load, validate, and mask collection gaps.

Two formats are read:

- a CSV with a header holding at least ``window_start_s`` and ``total_rate_rps`` (optionally
  ``cv``, the inter-arrival coefficient of variation), like ServeGen's derived
  ``total_rate_10min.csv``;
- a directory of ServeGen client files ``chunk-*-trace.csv`` without a header, one row per window:
  ``window_start_s, rate_rps, cv, iat_dist, param1, param2``; rates are summed per window.

Windows must be evenly spaced and sorted; a window whose total rate is exactly zero is a
collection gap (masked: neither planned on nor scored), not idle time. Each window also carries a
*dispersion* ``D = sum_i cv_i^2 * rate_i`` (requests/s): for a renewal process the count in an
interval ``tau`` has variance ``cv^2 * rate * tau`` (Cox, *Renewal Theory*, 1962), so the rate
averaged over ``tau`` has variance ``D / tau``; :mod:`scheduler.planner.demand` uses it to model
bursts inside a window. Anything malformed raises :class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_GAP_FRACTION = 0.5


class TraceError(ValueError):
    """A trace file is unusable; the message says where and what to fix."""


@dataclass(frozen=True)
class Trace:
    """Per-window mean request rate and burst dispersion; gaps are NaN."""

    window_s: int
    start_s: np.ndarray
    """Window start times in seconds (int64, evenly spaced)."""
    rate: np.ndarray
    """Mean arrival rate per window in requests/s; NaN marks a gap."""
    dispersion: np.ndarray
    """``sum_i cv_i^2 rate_i`` per window (requests/s); NaN on gaps."""
    source: str
    client_rate: np.ndarray | None = None
    """Per-client rates, shape ``(clients, windows)``, when the trace has them (client files)."""
    client_dispersion: np.ndarray | None = None
    """Per-client ``cv^2 * rate``, same shape: bursts are drawn per client, then summed."""

    def __len__(self) -> int:
        return len(self.rate)

    @property
    def gaps(self) -> np.ndarray:
        """Boolean mask of masked (all-zero) windows."""
        return np.isnan(self.rate)

    @property
    def windows_per_day(self) -> int:
        return 86400 // self.window_s

    def shifted(self, hours: float) -> Trace:
        """The same trace as seen from a region ``hours`` ahead: rotated by whole windows."""
        steps = round(hours * 3600 / self.window_s)
        return Trace(
            self.window_s,
            self.start_s,
            np.roll(self.rate, -steps),
            np.roll(self.dispersion, -steps),
            f"{self.source} (shifted {hours:+g} h)",
            None if self.client_rate is None else np.roll(self.client_rate, -steps, axis=1),
            None if self.client_dispersion is None else np.roll(self.client_dispersion, -steps, axis=1),
        )

    def days(self, first: int, last: int) -> Trace:
        """Whole days ``first`` (inclusive) to ``last`` (exclusive) of the trace, a held-out subset."""
        a, b = first * self.windows_per_day, min(len(self), last * self.windows_per_day)
        if not 0 <= a < b:
            have = len(self) / self.windows_per_day
            raise TraceError(f"{self.source}: has {have:.1f} days; days {first}..{last} is empty")
        return Trace(
            self.window_s,
            self.start_s[a:b],
            self.rate[a:b],
            self.dispersion[a:b],
            f"{self.source} (days {first}-{last})",
            None if self.client_rate is None else self.client_rate[:, a:b],
            None if self.client_dispersion is None else self.client_dispersion[:, a:b],
        )


def _number(text: str, where: str, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {column} is {text!r}, not a number") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: {column} is {text!r}; rates must be finite numbers")
    return value


def _check_grid(starts: list[float], where: list[str], source: str) -> int:
    """Validate sorted, evenly spaced window starts; return the window length."""
    if len(starts) < 2:
        raise TraceError(f"{source}: needs at least 2 windows, found {len(starts)}")
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise TraceError(
                f"{where[i]}: window_start_s {starts[i]:g} does not come after {starts[i - 1]:g}; "
                "windows must be sorted and unique (sort the file by window_start_s)"
            )
    step = starts[1] - starts[0]
    if step != int(step) or step <= 0 or 86400 % int(step) != 0:
        raise TraceError(f"{source}: window length {step:g} s does not divide a day; use e.g. 600 s windows")
    for i in range(1, len(starts)):
        if starts[i] - starts[i - 1] != step:
            raise TraceError(
                f"{where[i]}: window starts at {starts[i]:g} s but {starts[i - 1] + step:g} s was expected; "
                "windows must be evenly spaced: write missing windows as rows with rate 0 (they are masked as gaps)"
            )
    return int(step)


def _finish(
    starts: list[float],
    rates: list[float],
    disp: list[float],
    window_s: int,
    source: str,
    clients: tuple[np.ndarray, np.ndarray] | None = None,
) -> Trace:
    rate = np.asarray(rates, dtype=np.float64)
    dispersion = np.asarray(disp, dtype=np.float64)
    gap = rate == 0.0
    if gap.all():
        raise TraceError(f"{source}: every window has rate 0; there is no demand to plan for")
    if gap.mean() > MAX_GAP_FRACTION:
        raise TraceError(
            f"{source}: {int(gap.sum())} of {len(rate)} windows are gaps (rate 0); "
            f"more than {MAX_GAP_FRACTION:.0%} missing is not a usable trace"
        )
    rate[gap] = np.nan
    dispersion[gap] = np.nan
    client_rate, client_disp = clients if clients is not None else (None, None)
    return Trace(window_s, np.asarray(starts, dtype=np.int64), rate, dispersion, source, client_rate, client_disp)


def load_total_csv(path: Path, default_cv: float = 1.0) -> Trace:
    """Read a CSV with a header naming ``window_start_s`` and ``total_rate_rps`` (``cv`` optional)."""
    source = str(path)
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{source}: the file is empty; expected a header with window_start_s,total_rate_rps")
        names = [h.strip() for h in header]
        missing = [c for c in ("window_start_s", "total_rate_rps") if c not in names]
        if missing:
            raise TraceError(f"{source}: header {names} lacks {missing}; expected window_start_s,total_rate_rps[,cv]")
        i_start, i_rate = names.index("window_start_s"), names.index("total_rate_rps")
        i_cv = names.index("cv") if "cv" in names else None
        starts: list[float] = []
        rates: list[float] = []
        disp: list[float] = []
        where: list[str] = []
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            loc = f"{source}:{lineno}"
            if len(row) != len(names):
                raise TraceError(f"{loc}: {len(row)} fields, the header has {len(names)}")
            start = _number(row[i_start], loc, "window_start_s")
            rate = _number(row[i_rate], loc, "total_rate_rps")
            if rate < 0:
                raise TraceError(f"{loc}: total_rate_rps is {rate:g}; rates cannot be negative")
            cv = default_cv
            if i_cv is not None and row[i_cv].strip():
                cv = _number(row[i_cv], loc, "cv")
                if cv < 0:
                    raise TraceError(f"{loc}: cv is {cv:g}; a coefficient of variation cannot be negative")
            starts.append(start)
            rates.append(rate)
            disp.append(cv * cv * rate)
            where.append(loc)
    if not starts:
        raise TraceError(f"{source}: the header is there but no windows follow")
    window_s = _check_grid(starts, where, source)
    return _finish(starts, rates, disp, window_s, source)


def load_client_dir(path: Path, default_cv: float = 1.0) -> Trace:
    """Sum a directory of ServeGen client files (``chunk-*-trace.csv``, no header) per window."""
    files = sorted(path.glob("chunk-*-trace.csv"))
    if not files:
        raise TraceError(f"{path}: no ServeGen client files (chunk-*-trace.csv) in this directory")
    grid: list[float] | None = None
    grid_where: list[str] = []
    total: np.ndarray | None = None
    disp: np.ndarray | None = None
    per_rate: list[np.ndarray] = []
    per_disp: list[np.ndarray] = []
    for f in files:
        starts: list[float] = []
        rates: list[float] = []
        cvs: list[float] = []
        where: list[str] = []
        with f.open(newline="") as fh:
            for lineno, row in enumerate(csv.reader(fh), start=1):
                if not row or all(not c.strip() for c in row):
                    continue
                loc = f"{f}:{lineno}"
                if len(row) != 6:
                    raise TraceError(f"{loc}: {len(row)} fields; expected 6 (window_start_s,rate_rps,cv,dist,p1,p2)")
                start = _number(row[0], loc, "window_start_s")
                rate = _number(row[1], loc, "rate_rps")
                if rate < 0:
                    raise TraceError(f"{loc}: rate_rps is {rate:g}; rates cannot be negative")
                cv = _number(row[2], loc, "cv") if row[2].strip() else default_cv
                if cv < 0:
                    raise TraceError(f"{loc}: cv is {cv:g}; a coefficient of variation cannot be negative")
                starts.append(start)
                rates.append(rate)
                cvs.append(cv)
                where.append(loc)
        if not starts:
            raise TraceError(f"{f}: the file is empty")
        _check_grid(starts, where, str(f))
        if grid is None:
            grid, grid_where = starts, where
            total = np.zeros(len(starts))
            disp = np.zeros(len(starts))
        elif starts != grid:
            raise TraceError(
                f"{f}: its windows differ from those of {grid_where[0].rsplit(':', 1)[0]}; "
                "all client files must cover the same windows"
            )
        r = np.asarray(rates)
        c = np.asarray(cvs)
        assert total is not None and disp is not None
        total += r
        disp += c * c * r
        per_rate.append(r)
        per_disp.append(c * c * r)
    assert grid is not None and total is not None and disp is not None
    window_s = _check_grid(grid, grid_where, str(path))
    clients = (np.vstack(per_rate), np.vstack(per_disp))
    return _finish(grid, total.tolist(), disp.tolist(), window_s, str(path), clients)


def load_trace(path: str | Path, default_cv: float = 1.0) -> Trace:
    """Load a trace file or a directory of client files (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    if p.is_dir():
        return load_client_dir(p, default_cv)
    return load_total_csv(p, default_cv)
