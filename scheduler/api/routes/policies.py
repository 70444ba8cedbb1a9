"""Policy versions: list, detail, metrics (training and online), lineage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query

from scheduler.api import analytics, sources
from scheduler.api.deps import SessionDep, SettingsDep, ViewerDep
from scheduler.api.schemas import NAME_PATTERN, Lineage, Metrics, Page, PolicyVersion

router = APIRouter(prefix="/policy-versions", tags=["policy"])

VersionPath = Annotated[str, Path(max_length=128, pattern=NAME_PATTERN, description="Policy version id.")]


def _get(session: SessionDep, settings: SettingsDep, version: str) -> PolicyVersion:
    try:
        found = sources.policy_version(session, settings, version)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    if found is None:
        raise HTTPException(404, f"no policy version {version!r}; list them with GET /api/v1/policy-versions")
    return found


@router.get("", response_model=Page[PolicyVersion], summary="List policy versions")
def list_versions(
    _: ViewerDep,
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Page[PolicyVersion]:
    """Newest first."""
    try:
        items, total = sources.policy_versions(session, settings, limit=limit, offset=offset)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    return Page[PolicyVersion](items=items, total=total, limit=limit, offset=offset)


@router.get("/{version}", response_model=PolicyVersion, summary="One policy version")
def get_version(_: ViewerDep, session: SessionDep, settings: SettingsDep, version: VersionPath) -> PolicyVersion:
    """Its parent, training step, data window and status."""
    return _get(session, settings, version)


@router.get("/{version}/metrics", response_model=Metrics, summary="Metrics of a policy version")
def get_metrics(_: ViewerDep, session: SessionDep, settings: SettingsDep, version: VersionPath) -> Metrics:
    """Training metrics recorded with the version, plus its online reward signals (``online/...``)."""
    found = _get(session, settings, version)
    metrics = dict(found.info.get("metrics") or {})
    outcomes = analytics.load_outcomes(session, analytics.RewardFilter(policy_versions=(version,)))
    for row in analytics.summary(outcomes):
        key = f"online/{row['signal']}" + (f"@{row['horizon_s']}s" if row["horizon_s"] is not None else "")
        metrics[key] = {k: row[k] for k in ("mean", "n", "ci_low", "ci_high")}
    return Metrics(version=version, metrics=metrics)


@router.get("/{version}/lineage", response_model=Lineage, summary="Ancestry of a policy version")
def get_lineage(_: ViewerDep, session: SessionDep, settings: SettingsDep, version: VersionPath) -> Lineage:
    """Parents back to the first version, oldest first, ending with the version itself."""
    _get(session, settings, version)
    return Lineage(version=version, chain=sources.policy_lineage(session, settings, version))
