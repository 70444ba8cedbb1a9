"""The serving fleet: replicas, state counts per pool, and the borrowing timeline."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from scheduler.api import sources
from scheduler.api.deps import SessionDep, ViewerDep
from scheduler.api.schemas import NAME_PATTERN, BorrowWindow, Replica, StateCount, UtcDateTime

router = APIRouter(prefix="/fleet", tags=["fleet"])

PoolQuery = Annotated[str | None, Query(max_length=64, pattern=NAME_PATTERN, description="Only this pool.")]


@router.get("/replicas", response_model=list[Replica], summary="Replicas in the fleet registry")
def list_replicas(
    _: ViewerDep,
    session: SessionDep,
    pool: PoolQuery = None,
    state: Annotated[str | None, Query(max_length=16, pattern=NAME_PATTERN, description="Only this state.")] = None,
) -> list[Replica]:
    """Each replica's pool, state (serving, draining, borrowed, sleeping, updating), version and health."""
    return [Replica.model_validate(r, from_attributes=True) for r in sources.replicas(session, pool=pool, state=state)]


@router.get("/states", response_model=list[StateCount], summary="Replica counts per pool and state")
def states(_: ViewerDep, session: SessionDep, pool: PoolQuery = None) -> list[StateCount]:
    """How many replicas of each pool are serving, borrowed, sleeping..."""
    counts = sources.replica_state_counts(session)
    return [
        StateCount(pool=p, state=s, replicas=n) for (p, s), n in sorted(counts.items()) if pool is None or p == pool
    ]


@router.get("/borrowing", response_model=list[BorrowWindow], summary="Borrowing timeline")
def borrowing(
    _: ViewerDep,
    session: SessionDep,
    pool: PoolQuery = None,
    since: UtcDateTime | None = None,
    until: UtcDateTime | None = None,
) -> list[BorrowWindow]:
    """Windows in which replicas were lent to training or generation, oldest first."""
    try:
        return [BorrowWindow(**w) for w in sources.borrow_windows(session, pool=pool, since=since, until=until)]
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
