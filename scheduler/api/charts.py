"""Dashboard charts, drawn server-side by matplotlib's SVG backend and inlined in the pages.

Figures use the object-oriented API (``matplotlib.figure.Figure``), never ``pyplot``, so no
global figure state is shared between request threads. Text stays text in the SVG
(``svg.fonttype = none``): small, crisp, searchable. Each data series carries an SVG id
``series-...``, and an empty chart says so with the id ``nodata``; the browser tests check both.
"""

from __future__ import annotations

import functools
import io
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams.update(
    {
        "svg.fonttype": "none",
        "font.family": "sans-serif",
        "font.size": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "grid.alpha": 0.3,
    }
)

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
STATE_COLORS = {
    "pending": "#bdbdbd",
    "queued": "#bdbdbd",
    "running": "#1f77b4",
    "started": "#1f77b4",
    "succeeded": "#2ca02c",
    "success": "#2ca02c",
    "failed": "#d62728",
    "failure": "#d62728",
    "cancelled": "#7f7f7f",
    "revoked": "#7f7f7f",
    "retry": "#ff7f0e",
    "preempted": "#ff7f0e",
    "lost": "#8c564b",
}


F = TypeVar("F", bound=Callable[..., str])
_CACHE: OrderedDict[str, str] = OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 64


def memoized(func: F) -> F:
    """Reuse the SVG of a chart whose inputs did not change (pages reload far more often than data moves)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> str:
        key = func.__name__ + json.dumps([args, kwargs], default=str, sort_keys=True)
        with _CACHE_LOCK:
            if key in _CACHE:
                _CACHE.move_to_end(key)
                return _CACHE[key]
        svg = func(*args, **kwargs)
        with _CACHE_LOCK:
            _CACHE[key] = svg
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        return svg

    return wrapper  # type: ignore[return-value]


def version_colors(versions: Sequence[str]) -> dict[str, str]:
    """A stable color per policy version (sorted order, cycling the palette)."""
    return {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(sorted(set(versions)))}


def _figure(width: float = 7.0, height: float = 3.0, right: float = 0.98) -> tuple[Figure, Axes]:
    # Fixed margins instead of a layout engine: constrained layout draws every figure twice.
    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(left=0.09, right=right, top=0.88, bottom=0.2)
    return fig, fig.add_subplot()


def _render(fig: Figure, label: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    return svg.replace("<svg ", f'<svg role="img" aria-label="{label}" class="chart" ', 1)


def _legend(ax: Axes, handles: list[Any] | None = None, labels: list[str] | None = None) -> None:
    """One row of legend above the plot (the card around the chart carries its title)."""
    if handles is None or labels is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles,
        labels,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.01),
        ncols=max(len(handles), 1),
        frameon=False,
        fontsize=8,
    )


def _no_data(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="#666", gid="nodata")
    ax.set_xticks([])
    ax.set_yticks([])


@memoized
def reward_over_time(points: Sequence[dict[str, Any]], ylabel: str, title: str) -> str:
    """Mean outcome per policy version over time, with the 95% confidence band shaded."""
    fig, ax = _figure()
    colors = version_colors([p["policy_version"] for p in points])
    if not points:
        _no_data(ax, "no sessions with this signal in the window yet")
    for version, color in colors.items():
        pts = sorted((p for p in points if p["policy_version"] == version), key=lambda p: p["bucket_start"])
        xs = [p["bucket_start"] for p in pts]
        ys = [p["mean"] for p in pts]
        ax.plot(xs, ys, marker="o", ms=3, color=color, label=version, gid=f"series-{version}")
        banded = [p for p in pts if p["ci_low"] is not None]
        if banded:
            ax.fill_between(
                [p["bucket_start"] for p in banded],
                [p["ci_low"] for p in banded],
                [p["ci_high"] for p in banded],
                color=color,
                alpha=0.18,
                linewidth=0,
            )
    if points:
        _legend(ax)
        fig.autofmt_xdate()
    ax.set_ylabel(f"{ylabel} ({title})" if title else ylabel)
    return _render(fig, title or ylabel)


def horizon_label(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


@memoized
def retention_curves(points: Sequence[dict[str, Any]]) -> str:
    """Retention at each horizon, one curve per policy version, 95% CI as error bars."""
    fig, ax = _figure()
    colors = version_colors([p["policy_version"] for p in points])
    if not points:
        _no_data(ax, "no retention reports yet")
    horizons = sorted({p["horizon_s"] for p in points})
    for version, color in colors.items():
        pts = sorted((p for p in points if p["policy_version"] == version), key=lambda p: p["horizon_s"])
        xs = [horizons.index(p["horizon_s"]) for p in pts]
        ys = [p["mean"] for p in pts]
        low = [p["mean"] - p["ci_low"] if p["ci_low"] is not None else 0.0 for p in pts]
        high = [p["ci_high"] - p["mean"] if p["ci_high"] is not None else 0.0 for p in pts]
        ax.errorbar(
            xs, ys, yerr=[low, high], marker="o", ms=4, capsize=3, color=color, label=version, gid=f"series-{version}"
        )
    if points:
        ax.set_xticks(range(len(horizons)), [horizon_label(h) for h in horizons])
        _legend(ax)
        ax.set_ylim(0, 1.05)
    ax.set_xlabel("horizon after the session")
    ax.set_ylabel("lines retained")
    return _render(fig, "Retention curves by horizon")


@memoized
def win_rates(points: Sequence[dict[str, Any]], chance: float | None) -> str:
    """Selection win rate per policy version with 95% CI; the dashed line is chance (1/K)."""
    fig, ax = _figure(7.0, 2.6)
    colors = version_colors([p["policy_version"] for p in points])
    if not points:
        _no_data(ax, "no candidate selections yet")
    for i, p in enumerate(sorted(points, key=lambda p: p["policy_version"])):
        err = None
        if p["ci_low"] is not None:
            err = [[p["mean"] - p["ci_low"]], [p["ci_high"] - p["mean"]]]
        ax.bar(
            [i],
            [p["mean"]],
            yerr=err,
            capsize=4,
            color=colors[p["policy_version"]],
            gid=f"series-{p['policy_version']}",
        )
    if points:
        ax.set_xticks(range(len(points)), sorted(p["policy_version"] for p in points))
        if chance:
            ax.axhline(chance, ls="--", color="#444", lw=1, label=f"chance (1/K = {chance:.2f})")
            _legend(ax)
        ax.set_ylim(0, 1)
    ax.set_ylabel("win rate")
    return _render(fig, "Selection win rate by policy version")


@memoized
def fleet_capacity(
    times: Sequence[datetime],
    demand: Sequence[float],
    serving: Sequence[float],
    borrowed_windows: Sequence[tuple[datetime, datetime]],
    unit: str,
) -> str:
    """Replicas left serving (left axis) over demand (right axis), borrowed windows shaded."""
    fig, ax = _figure(right=0.9)
    if not times:
        _no_data(ax, "no fleet or traffic history yet")
    else:
        from matplotlib.dates import date2num

        xs = date2num(list(times))
        ax.step(xs, serving, where="post", color="#2ca02c", lw=2, label="replicas serving", gid="series-capacity")
        ax.xaxis_date()
        ax.set_ylabel("replicas serving")
        ax.set_ylim(0, max(max(serving, default=1.0), 1.0) * 1.3)
        twin = ax.twinx()
        twin.fill_between(xs, demand, step="post", color="#1f77b4", alpha=0.25, lw=0)
        twin.step(xs, demand, where="post", color="#1f77b4", lw=1, label=f"demand ({unit})", gid="series-demand")
        twin.set_ylabel(f"demand ({unit})")
        twin.set_ylim(0, max(max(demand, default=1.0), 1e-9) * 1.3)
        twin.grid(False)
        for i, (start, end) in enumerate(borrowed_windows):
            ax.axvspan(
                float(date2num(start)),
                float(date2num(end)),
                color="#ff7f0e",
                alpha=0.22,
                lw=0,
                label="borrowed for training" if i == 0 else None,
            )
        handles = ax.get_legend_handles_labels()
        twin_handles = twin.get_legend_handles_labels()
        _legend(ax, handles[0] + twin_handles[0], handles[1] + twin_handles[1])
        fig.autofmt_xdate()
    return _render(fig, "Fleet capacity, demand and borrowed windows")


@memoized
def job_timeline(jobs: Sequence[dict[str, Any]], now: datetime) -> str:
    """One bar per job from start to end (or now), colored by state, one row per task kind."""
    from matplotlib.dates import date2num
    from matplotlib.patches import Patch

    fig, ax = _figure(7.0, 2.8)
    fig.subplots_adjust(left=0.15)
    if not jobs:
        _no_data(ax, "no jobs yet")
        return _render(fig, "Job timeline")
    kinds = sorted({j["kind"] for j in jobs})
    starts = [float(date2num(j["started_at"] or j["created_at"])) for j in jobs]
    ends = [float(date2num(j["finished_at"] or now)) for j in jobs]
    least = (max(ends) - min(starts)) / 150 or 1e-4  # short jobs stay visible
    for j, left, right in zip(jobs, starts, ends, strict=True):
        ax.broken_barh(
            [(left, max(right - left, least))],
            (kinds.index(j["kind"]) - 0.35, 0.7),
            facecolors=STATE_COLORS.get(j["state"].lower(), "#9467bd"),
            gid=f"series-job-{j['id']}",
        )
    ax.set_yticks(range(len(kinds)), [k.removeprefix("undertow.") for k in kinds])
    ax.xaxis_date()
    fig.autofmt_xdate()
    seen = sorted({j["state"] for j in jobs})
    _legend(ax, [Patch(color=STATE_COLORS.get(s.lower(), "#9467bd")) for s in seen], seen)
    return _render(fig, "Job timeline")


@memoized
def guard_state(points: Sequence[dict[str, Any]]) -> str:
    """Proxy reward (left axis, reward-model log-odds) and real outcome (right axis, final
    retention) per policy version in rollout order; a flagged version is circled in red."""
    fig, ax = _figure(7.0, 2.8, right=0.9)
    if not points:
        _no_data(ax, "no policy version has a final retention label yet")
    else:
        xs = list(range(len(points)))
        ax.plot(xs, [p["proxy"] for p in points], marker="o", color="#9467bd", label="proxy reward", gid="series-proxy")
        ax.set_ylabel("proxy (log-odds)")
        twin = ax.twinx()
        twin.plot(
            xs, [p["real"] for p in points], marker="s", color="#2ca02c", label="real: retention", gid="series-real"
        )
        twin.set_ylabel("retention")
        twin.grid(False)
        flagged = [i for i, p in enumerate(points) if p.get("flagged")]
        if flagged:
            twin.scatter(
                flagged,
                [points[i]["real"] for i in flagged],
                s=160,
                facecolors="none",
                edgecolors="#d62728",
                linewidths=2,
                label="divergence flagged",
                gid="series-flagged",
            )
        ax.set_xticks(xs, [p["policy_version"] for p in points])
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        _legend(ax, h1 + h2, l1 + l2)
    return _render(fig, "Reward-hacking guard: proxy vs real")


def warm_up() -> None:
    """Draw one throwaway figure so the first page view does not pay for font loading."""
    fig, ax = _figure(2.0, 1.0)
    ax.plot([0, 1], [0, 1])
    _render(fig, "warm-up")
