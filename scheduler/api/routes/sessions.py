"""Served sessions. Prompts and generated code are shown to operators, and to viewers only when
``api.expose_text_to_viewers`` is on."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from sqlalchemy import func, select

from ingest.tables import SessionRow
from scheduler.api.analytics import db_time
from scheduler.api.auth import Principal
from scheduler.api.deps import ApiConfigDep, SessionDep, ViewerDep
from scheduler.api.schemas import NAME_PATTERN, Page, SessionInfo, UtcDateTime
from scheduler.settings.sections import ApiConfig

router = APIRouter(prefix="/sessions", tags=["sessions"])


def _can_read_text(principal: Principal, api: ApiConfig) -> bool:
    return principal.can("operator") or api.expose_text_to_viewers


def _info(row: SessionRow, show_text: bool) -> SessionInfo:
    return SessionInfo(
        session_id=row.session_id,
        occurred_at=row.occurred_at,
        model=row.model,
        policy_version=row.policy_version,
        group_id=row.group_id,
        num_completion_tokens=row.num_completion_tokens,
        prompt=row.prompt_text if show_text else None,
        completion=row.completion_text if show_text else None,
        text_redacted=not show_text,
    )


@router.get("", response_model=Page[SessionInfo], summary="List served sessions")
def list_sessions(
    principal: ViewerDep,
    api: ApiConfigDep,
    session: SessionDep,
    since: UtcDateTime | None = None,
    until: UtcDateTime | None = None,
    model: Annotated[str | None, Query(max_length=128, pattern=NAME_PATTERN)] = None,
    policy_version: Annotated[str | None, Query(max_length=128, pattern=NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Page[SessionInfo]:
    """Newest first."""
    stmt = select(SessionRow)
    if since is not None:
        stmt = stmt.where(SessionRow.occurred_at >= db_time(session, since))
    if until is not None:
        stmt = stmt.where(SessionRow.occurred_at < db_time(session, until))
    if model:
        stmt = stmt.where(SessionRow.model == model)
    if policy_version:
        stmt = stmt.where(SessionRow.policy_version == policy_version)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(SessionRow.occurred_at.desc()).limit(limit).offset(offset))
    show = _can_read_text(principal, api)
    return Page[SessionInfo](items=[_info(r, show) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/{session_id}", response_model=SessionInfo, summary="One served session")
def get_session(
    principal: ViewerDep,
    api: ApiConfigDep,
    session: SessionDep,
    session_id: Annotated[str, Path(max_length=128, pattern=NAME_PATTERN)],
) -> SessionInfo:
    """Prompt and completion included only for callers allowed to read code."""
    row = session.get(SessionRow, session_id)
    if row is None:
        raise HTTPException(404, f"no session {session_id!r}")
    return _info(row, _can_read_text(principal, api))
