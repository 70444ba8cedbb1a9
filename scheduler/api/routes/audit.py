"""The audit log of mutating calls (operators only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import func, select

from scheduler.api.deps import OperatorDep, SessionDep
from scheduler.api.schemas import NAME_PATTERN, AuditEntry, Page
from scheduler.api.tables import AuditRow

router = APIRouter(prefix="/audit", tags=["audit"])


@router.get("", response_model=Page[AuditEntry], summary="Audit log, newest first")
def list_audit(
    _: OperatorDep,
    session: SessionDep,
    actor: Annotated[str | None, Query(max_length=128, pattern=NAME_PATTERN)] = None,
    action: Annotated[str | None, Query(max_length=64, pattern=NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Page[AuditEntry]:
    """Every mutating call with who made it, what it did, when, and its status code."""
    stmt = select(AuditRow)
    if actor:
        stmt = stmt.where(AuditRow.actor == actor)
    if action:
        stmt = stmt.where(AuditRow.action == action)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(AuditRow.id.desc()).limit(limit).offset(offset))
    return Page[AuditEntry](
        items=[AuditEntry.model_validate(r, from_attributes=True) for r in rows],
        total=total,
        limit=limit,
        offset=offset,
    )
