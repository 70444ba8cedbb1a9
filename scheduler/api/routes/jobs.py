"""Retrains and jobs: trigger a reward-model retrain or an RL run, follow it, cancel it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, status

from scheduler.api import queue, sources
from scheduler.api.deps import EngineDep, OperatorDep, SessionDep, ViewerDep, audit
from scheduler.api.schemas import NAME_PATTERN, ActionRequest, Job, Page, RetrainRequest
from scheduler.loop.state import Window

router = APIRouter(tags=["jobs"])

JobPath = Annotated[str, Path(max_length=64, pattern=NAME_PATTERN, description="Job id.")]
RETRAIN_KINDS = {"reward_model": "reward_model_retrain", "rl_run": "rl_update"}


@router.post(
    "/retrains",
    response_model=Job,
    status_code=status.HTTP_202_ACCEPTED,
    summary="Trigger a retrain",
    responses={503: {"description": "No job queue is configured."}},
)
def create_retrain(request: Request, principal: OperatorDep, engine: EngineDep, body: RetrainRequest) -> Job:
    """Queue a reward-model retrain or an RL run on a telemetry window; answers with the job to follow.

    A reward-model retrain trains on the sessions of the window when the triggers call for it, or
    always with ``force``; an RL run trains on the window's sessions and rolls the new version out."""
    audit(request, "retrain.create", kind=body.kind)
    until = body.until or datetime.now(UTC)
    since = body.since
    if body.window_hours is not None:
        if since is not None:
            raise HTTPException(422, "give either `since` or `window_hours`, not both.")
        since = until - timedelta(hours=body.window_hours)
    if since is not None and since >= until:
        raise HTTPException(422, "`since` must be before `until`.")
    kind = RETRAIN_KINDS[body.kind]
    state = queue.new_state(
        kind=kind,
        requested_by=principal.name,
        reason=body.reason,
        window=Window(since=since, until=until),
        force=body.force,
    )
    try:
        job = queue.submit_job(engine, state, settings=request.app.state.settings)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    params = {"since": since.isoformat() if since else None, "until": until.isoformat(), "force": body.force}
    audit(request, "retrain.create", job_id=job.id, since=params["since"], until=params["until"])
    return job


@router.get("/jobs", response_model=Page[Job], summary="List jobs")
def list_jobs(
    request: Request,
    _: ViewerDep,
    engine: EngineDep,
    session: SessionDep,
    kind: Annotated[str | None, Query(max_length=64, pattern=NAME_PATTERN)] = None,
    state: Annotated[str | None, Query(max_length=32, pattern=NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Page[Job]:
    """Newest first, with their state, inputs and outputs."""
    try:
        queue.reap(engine, request.app.state.settings)
        items, total = queue.list_jobs(session, kind=kind, state=state, limit=limit, offset=offset)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    return Page[Job](items=items, total=total, limit=limit, offset=offset)


@router.get("/jobs/{job_id}", response_model=Job, summary="One job")
def get_job(request: Request, _: ViewerDep, engine: EngineDep, session: SessionDep, job_id: JobPath) -> Job:
    """State, inputs, outputs, error and steps of one job."""
    try:
        queue.reap(engine, request.app.state.settings)
        job = queue.get_job(session, job_id)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}; list them with GET /api/v1/jobs")
    return job


@router.post("/jobs/{job_id}/cancel", response_model=Job, summary="Cancel a job")
def cancel_job(
    request: Request, principal: OperatorDep, engine: EngineDep, job_id: JobPath, body: ActionRequest | None = None
) -> Job:
    """Stop a queued or running job: no step of it starts afterwards, and a running training
    checkpoints and stops at its next step. A finished job answers 409."""
    audit(request, "job.cancel", job_id=job_id, reason=body.reason if body else None)
    try:
        job = queue.cancel_job(engine, job_id, actor=principal.name, settings=request.app.state.settings)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    except sources.Conflict as exc:
        raise HTTPException(409, str(exc)) from exc
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job
