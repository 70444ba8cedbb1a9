"""Reward-model versions from the registry: list, detail, held-out metrics, lineage."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query

from scheduler.api import sources
from scheduler.api.deps import SessionDep, ViewerDep
from scheduler.api.schemas import NAME_PATTERN, Lineage, Metrics, Page, RewardModelVersion

router = APIRouter(prefix="/reward-models", tags=["reward-models"])

VersionPath = Annotated[str, Path(max_length=64, pattern=NAME_PATTERN, description="Reward-model version id.")]


def _get(session: SessionDep, version: str) -> RewardModelVersion:
    row = sources.reward_model(session, version)
    if row is None:
        raise HTTPException(404, f"no reward-model version {version!r}; list them with GET /api/v1/reward-models")
    return RewardModelVersion.model_validate(row, from_attributes=True)


@router.get("", response_model=Page[RewardModelVersion], summary="List reward-model versions")
def list_versions(
    _: ViewerDep,
    session: SessionDep,
    status: Literal["promoted", "candidate", "retired"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Page[RewardModelVersion]:
    """Newest first, optionally only those with ``status``."""
    rows, total = sources.reward_model_versions(session, status=status, limit=limit, offset=offset)
    items = [RewardModelVersion.model_validate(r, from_attributes=True) for r in rows]
    return Page[RewardModelVersion](items=items, total=total, limit=limit, offset=offset)


@router.get("/{version}", response_model=RewardModelVersion, summary="One reward-model version")
def get_version(_: ViewerDep, session: SessionDep, version: VersionPath) -> RewardModelVersion:
    """Its data window, status and why it was (not) promoted."""
    return _get(session, version)


@router.get("/{version}/metrics", response_model=Metrics, summary="Held-out metrics of a reward-model version")
def get_metrics(_: ViewerDep, session: SessionDep, version: VersionPath) -> Metrics:
    """Metrics measured on the time-ordered hold-out, next to their baselines."""
    row = sources.reward_model(session, version)
    if row is None:
        raise HTTPException(404, f"no reward-model version {version!r}")
    return Metrics(version=version, metrics=dict(row.metrics or {}))


@router.get("/{version}/lineage", response_model=Lineage, summary="Which promoted versions it succeeded")
def get_lineage(_: ViewerDep, session: SessionDep, version: VersionPath) -> Lineage:
    """The promoted versions before it, oldest first, ending with the version itself."""
    _get(session, version)
    return Lineage(version=version, chain=sources.reward_model_lineage(session, version))
