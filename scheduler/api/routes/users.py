"""Users' data: forget a user (their telemetry deleted, their late events dropped, the versions trained
on them flagged) and list the tombstones. Operators only; each forget is audited with the user id's
hash, never the id itself."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from scheduler.api.deps import EngineDep, OperatorDep, SessionDep, audit

router = APIRouter(prefix="/users", tags=["users"])


class ForgetRequest(BaseModel):
    """The user to forget, as the telemetry names them (``user_id``, 1 to 128 characters, no NUL: no
    database stores one, so no stored user has one)."""

    model_config = ConfigDict(extra="forbid")

    user_id: str = Field(min_length=1, max_length=128, pattern=r"^[^\x00]+$")


class ForgetResult(BaseModel):
    """What was deleted per table, and the versions flagged as trained on the user's rows."""

    user_hash: str
    deleted: dict[str, int]
    flagged: dict[str, list[str]]


class Tombstone(BaseModel):
    """A forgotten user: the id's hash, when, by whom, and the late events dropped since."""

    user_hash: str
    forgotten_at: str
    requested_by: str
    deleted: dict[str, Any]
    flagged: dict[str, Any]
    dropped_events: int


@router.post("/forget", response_model=ForgetResult, summary="Forget a user")
async def forget_user(request: Request, principal: OperatorDep, engine: EngineDep, body: ForgetRequest) -> ForgetResult:
    """Delete the user's sessions, signals and dead letters, drop their later events at ingest, and flag the
    reward-model and policy versions trained on their rows. Forgetting a user again is harmless."""
    from ingest.forget import user_hash
    from scheduler.privacy import forget

    audit(request, "user.forget", user_hash=user_hash(body.user_id))
    out = await run_in_threadpool(forget, engine, body.user_id, principal.name)
    audit(request, "user.forget", deleted=out["deleted"], flagged=out["flagged"])
    return ForgetResult.model_validate(out)


@router.get("/forgotten", response_model=list[Tombstone], summary="Forgotten users")
def list_forgotten(_: OperatorDep, session: SessionDep) -> list[Tombstone]:
    """Every tombstone, oldest first (hashes only)."""
    from ingest.forget import list_forgotten as rows

    return [
        Tombstone(
            user_hash=r.user_hash,
            forgotten_at=r.forgotten_at.isoformat(),
            requested_by=r.requested_by,
            deleted=r.deleted or {},
            flagged=r.flagged or {},
            dropped_events=r.dropped_events or 0,
        )
        for r in rows(session)
    ]
