"""What each dashboard page shows: data gathered through :mod:`scheduler.api.sources` and
:mod:`scheduler.api.analytics`, drawn by :mod:`scheduler.api.charts`. No HTTP here."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pandas as pd
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ingest.db import as_utc
from ingest.tables import DeadLetterRow, SessionRow, SignalRow
from scheduler.api import analytics, charts, queue, sources
from scheduler.settings import Settings

WINDOWS = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "all": None}
SIGNAL_LABELS = {
    "retention": "lines retained",
    "acceptance": "edits accepted",
    "selection_win": "win rate",
    "switch": "switch rate",
    "thumbs": "mean thumbs",
}


def reward_filter(window: str, model: str | None, now: datetime) -> analytics.RewardFilter:
    """The filter of a dashboard's window and model selectors (unknown values mean 'all')."""
    seconds = WINDOWS.get(window)
    since = now - timedelta(seconds=seconds) if seconds else None
    return analytics.RewardFilter(since=since, model=model or None)


def models_seen(session: Session) -> list[str]:
    """Served model names, for the model selector."""
    return sorted(session.scalars(select(SessionRow.model).distinct().limit(100)))


def _guard(session: Session, settings: Settings) -> dict[str, Any]:
    report = sources.divergence(session, settings)
    return {
        "guard_chart": charts.guard_state(report["versions"]),
        "guard": report,
        "flagged": [p["policy_version"] for p in report["versions"] if p["flagged"]],
    }


def _jobs(session: Session, limit: int) -> tuple[list[Any], str | None]:
    try:
        return queue.list_jobs(session, kind=None, state=None, limit=limit, offset=0)[0], None
    except sources.Unavailable as exc:
        return [], str(exc)


def overview(session: Session, settings: Settings, now: datetime) -> dict[str, Any]:
    """Headline numbers, reward by version, the guard, what each pool serves, latest jobs."""
    f = analytics.RewardFilter()
    outcomes = analytics.load_outcomes(session, f)
    rows = analytics.select_signal(outcomes, "retention")
    _, points = analytics.timeseries(rows)
    horizon = int(rows["horizon_s"].iloc[0]) if not rows.empty else None
    label = f"at {charts.horizon_label(horizon)}" if horizon else ""
    jobs, jobs_error = _jobs(session, 8)
    stats = [
        ("sessions", session.scalar(select(func.count()).select_from(SessionRow)) or 0),
        ("signals", session.scalar(select(func.count()).select_from(SignalRow)) or 0),
        ("dead letters", session.scalar(select(func.count()).select_from(DeadLetterRow)) or 0),
        ("policy versions seen", session.scalar(select(func.count(SessionRow.policy_version.distinct()))) or 0),
    ]
    return {
        "stats": stats,
        "reward_chart": charts.reward_over_time(points, SIGNAL_LABELS["retention"], label),
        "pools": sources.current_deployments(session),
        "jobs": jobs,
        "jobs_error": jobs_error,
        **_guard(session, settings),
    }


def rewards(session: Session, f: analytics.RewardFilter, signal: str) -> dict[str, Any]:
    """A signal over time, retention curves, selection win rates, and the per-signal table."""
    outcomes = analytics.load_outcomes(session, f)
    rows = analytics.select_signal(outcomes, signal)
    _, points = analytics.timeseries(rows)
    title = (
        f"at {charts.horizon_label(int(rows['horizon_s'].iloc[0]))}" if signal == "retention" and not rows.empty else ""
    )
    wins = [r for r in analytics.summary(outcomes) if r["signal"] == "selection_win"]
    chance = None
    shown = session.scalar(select(func.avg(SignalRow.value)).where(SignalRow.type == "candidates.shown"))
    if shown:
        chance = 1.0 / float(shown)
    elif wins:
        chance = float(pd.Series([r["mean"] for r in wins]).mean())
    return {
        "series_chart": charts.reward_over_time(points, SIGNAL_LABELS.get(signal, signal), title),
        "retention_chart": charts.retention_curves(analytics.retention_curves(outcomes)),
        "win_chart": charts.win_rates(wins, chance),
        "summary": analytics.summary(outcomes),
    }


def models(session: Session, settings: Settings) -> dict[str, Any]:
    """Reward-model and policy versions, and the guard."""
    reward_models, _ = sources.reward_model_versions(session, status=None, limit=50, offset=0)
    try:
        policies, policy_error = sources.policy_versions(session, settings, limit=50, offset=0)[0], None
    except sources.Unavailable as exc:
        policies, policy_error = [], str(exc)
    return {
        "reward_models": reward_models,
        "policies": policies,
        "policy_error": policy_error,
        **_guard(session, settings),
    }


def fleet(session: Session, f: analytics.RewardFilter, now: datetime) -> dict[str, Any]:
    """Capacity (replicas not lent) against demand (sessions per minute), borrowed windows shaded."""
    replicas = sources.replicas(session, pool=None, state=None)
    try:
        windows = sources.borrow_windows(session, pool=None, since=f.since, until=None)
        borrow_error = None
    except sources.Unavailable as exc:
        windows, borrow_error = [], str(exc)
    stmt = select(SessionRow.occurred_at)
    if f.since is not None:
        stmt = stmt.where(SessionRow.occurred_at >= as_utc(f.since))
    if f.model:
        stmt = stmt.where(SessionRow.model == f.model)
    served = pd.to_datetime(pd.Series(list(session.scalars(stmt)), dtype="object"), utc=True)
    times: list[datetime] = []
    demand: list[float] = []
    capacity: list[float] = []
    spans = [(w["start"], w["end"] or now) for w in windows]
    if not served.empty or spans:
        starts = [*served.tolist(), *(s for s, _ in spans)]
        start, end = min(starts), max([*served.tolist(), *(e for _, e in spans)])
        width = analytics.auto_bucket_s(pd.Timestamp(start), pd.Timestamp(end), target=60)
        edges = pd.date_range(
            pd.Timestamp(start).floor(f"{width}s"), pd.Timestamp(end) + pd.Timedelta(seconds=width), freq=f"{width}s"
        )
        counts = pd.cut(served, edges, right=False).value_counts(sort=False) if not served.empty else None
        total = len(replicas)
        for i, left in enumerate(edges[:-1]):
            t = left.to_pydatetime()
            lent = sum(1 for s, e in spans if s <= t < e)
            times.append(t)
            demand.append(float(counts.iloc[i]) * 60.0 / width if counts is not None else 0.0)
            capacity.append(float(max(total - lent, 0)))
    deployments, _ = sources.deployments(session, pool=None, status=None, limit=20, offset=0)
    return {
        "capacity_chart": charts.fleet_capacity(times, demand, capacity, spans, "sessions/min"),
        "borrow_error": borrow_error,
        "replicas": replicas,
        "deployments": deployments,
    }


def jobs(session: Session, now: datetime) -> dict[str, Any]:
    """The job timeline and table."""
    items, error = _jobs(session, 100)
    return {
        "timeline_chart": charts.job_timeline([j.model_dump() for j in items], now.replace(second=0, microsecond=0)),
        "jobs": items,
        "jobs_error": error,
    }
