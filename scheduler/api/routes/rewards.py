"""Online rewards per policy version: time series, per-signal summaries, retention curves, and
the proxy-versus-real divergence the reward-hacking guard watches."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query

from scheduler.api import analytics, sources
from scheduler.api.deps import SessionDep, SettingsDep, ViewerDep
from scheduler.api.schemas import NAME_PATTERN, GuardReport, RewardPoint, RewardSeries, SignalSummary, UtcDateTime

router = APIRouter(prefix="/rewards", tags=["rewards"])

Signal = Literal["retention", "acceptance", "selection_win", "switch", "thumbs"]


def reward_filter(
    since: Annotated[UtcDateTime | None, Query(description="Sessions served at or after this time.")] = None,
    until: Annotated[UtcDateTime | None, Query(description="Sessions served before this time.")] = None,
    model: Annotated[str | None, Query(max_length=128, pattern=NAME_PATTERN, description="Served model name.")] = None,
    policy_version: Annotated[
        list[str] | None, Query(max_length=50, description="Policy versions to include (repeat the parameter).")
    ] = None,
) -> analytics.RewardFilter:
    """The common filters of every rewards endpoint."""
    if since is not None and until is not None and since >= until:
        raise HTTPException(422, "`since` must be before `until`.")
    versions = tuple(policy_version or ())
    if any(not v or len(v) > 128 or any(ord(c) < 32 or ord(c) == 127 for c in v) for v in versions):
        raise HTTPException(422, "each policy_version must be 1-128 printable characters.")
    return analytics.RewardFilter(since=since, until=until, model=model, policy_versions=versions)


FilterDep = Annotated[analytics.RewardFilter, Depends(reward_filter)]


@router.get("/timeseries", response_model=RewardSeries, summary="A signal over time, per policy version")
def timeseries(
    _: ViewerDep,
    session: SessionDep,
    f: FilterDep,
    signal: Signal = "retention",
    horizon_s: Annotated[int | None, Query(gt=0, le=10**9, description="Retention horizon (default: longest).")] = None,
    bucket_s: Annotated[
        int | None, Query(ge=60, le=30 * 86400, description="Bucket width (default: automatic).")
    ] = None,
) -> RewardSeries:
    """Mean of ``signal`` per time bucket of the sessions' serving time, with 95% confidence intervals."""
    rows = analytics.select_signal(analytics.load_outcomes(session, f), signal, horizon_s)
    width, points = analytics.timeseries(rows, bucket_s)
    horizon = int(rows["horizon_s"].iloc[0]) if signal == "retention" and not rows.empty else horizon_s
    return RewardSeries(signal=signal, horizon_s=horizon, bucket_s=width, points=[RewardPoint(**p) for p in points])


@router.get("/summary", response_model=list[SignalSummary], summary="Every signal per policy version")
def summary(_: ViewerDep, session: SessionDep, f: FilterDep) -> list[SignalSummary]:
    """Mean, count and 95% CI of each signal (retention per horizon) per policy version over the window."""
    return [SignalSummary(**r) for r in analytics.summary(analytics.load_outcomes(session, f))]


@router.get("/retention", response_model=list[SignalSummary], summary="Retention curves by horizon")
def retention(_: ViewerDep, session: SessionDep, f: FilterDep) -> list[SignalSummary]:
    """Retention at each horizon per policy version, with 95% CI."""
    return [SignalSummary(**r) for r in analytics.retention_curves(analytics.load_outcomes(session, f))]


@router.get("/divergence", response_model=GuardReport, summary="Proxy reward vs real outcome")
def divergence(_: ViewerDep, session: SessionDep, settings: SettingsDep) -> GuardReport:
    """Per policy version (in rollout order): the promoted reward model's mean score (proxy) and the
    mean final retention (real), and the reward-hacking guard's verdict: flagged when the proxy
    rose while retention fell beyond the configured thresholds. Uses all stored data."""
    return GuardReport(**sources.divergence(session, settings))
