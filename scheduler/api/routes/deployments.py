"""Deployments: the version each pool serves, rollouts, promotion and rollback.

Starting a rollout, promoting and rolling back are jobs for the scheduler's Celery workers
(they talk to replicas for minutes); the call answers 202 with the job to follow. Promoting or
rolling back a running rollout also asks its deployer at once (:func:`serving.actions.request`), so
it acts at its next gate even while every worker is busy.

A promotion is judged by the reward-hacking guard (:func:`reward_models.api.promotion_check`) before
it is accepted: a version whose sessions score higher on the reward model while users retain less
of their code than on the version it replaces is refused with 409, the reason recorded in the
deployment's message and the audit entry. ``force`` overrides the guard (audited).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request, status

from reward_models.api import promotion_check
from scheduler.api import queue, sources
from scheduler.api.deps import EngineDep, OperatorDep, SessionDep, ViewerDep, audit
from scheduler.api.schemas import (
    NAME_PATTERN,
    ActionRequest,
    Deployment,
    Job,
    Page,
    PoolStatus,
    PromoteRequest,
    RolloutRequest,
)
from scheduler.loop.state import LoopState
from serving import actions

router = APIRouter(prefix="/deployments", tags=["deployments"])

DeploymentPath = Annotated[int, Path(ge=1, le=2**62, description="Deployment id.")]


def _get(session: SessionDep, deployment_id: int) -> Deployment:
    row = sources.deployment(session, deployment_id)
    if row is None:
        raise HTTPException(404, f"no deployment {deployment_id}; list them with GET /api/v1/deployments")
    return Deployment.model_validate(row, from_attributes=True)


@router.get("/current", response_model=list[PoolStatus], summary="Current version per pool")
def current(_: ViewerDep, session: SessionDep) -> list[PoolStatus]:
    """Each pool's target version, the versions its replicas report, and its latest rollout's state."""
    return [PoolStatus(**p) for p in sources.current_deployments(session)]


@router.get("", response_model=Page[Deployment], summary="List deployments")
def list_deployments(
    _: ViewerDep,
    session: SessionDep,
    pool: Annotated[str | None, Query(max_length=64, pattern=NAME_PATTERN)] = None,
    status: Literal["running", "succeeded", "rolled_back", "failed"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Page[Deployment]:
    """Newest first, with their stages and gate outcomes."""
    rows, total = sources.deployments(session, pool=pool, status=status, limit=limit, offset=offset)
    items = [Deployment.model_validate(r, from_attributes=True) for r in rows]
    return Page[Deployment](items=items, total=total, limit=limit, offset=offset)


@router.get("/{deployment_id}", response_model=Deployment, summary="One deployment")
def get_deployment(_: ViewerDep, session: SessionDep, deployment_id: DeploymentPath) -> Deployment:
    """Its stages, the replicas each touched, and each gate's metrics."""
    return _get(session, deployment_id)


def _submit(request: Request, engine: EngineDep, state: LoopState, action: str) -> Job:
    try:
        job = queue.submit_job(engine, state, settings=request.app.state.settings)
    except sources.Unavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    audit(request, f"deployment.{action}", job_id=job.id, version=state.version, pool=state.pool)
    return job


def _act(
    request: Request,
    engine: EngineDep,
    dep: Deployment,
    action: Literal["promote", "rollback"],
    version: str,
    body: ActionRequest | None,
    actor: str,
    *,
    force: bool = False,
) -> Job:
    # The running deployer acts at its next gate even when every worker is busy; the job confirms it.
    actions.request(engine, dep.id, "force_promote" if force and action == "promote" else action)
    state = queue.new_state(
        kind=action,
        deployment_id=dep.id,
        pool=dep.pool,
        version=version,
        reason=body.reason if body else "",
        requested_by=actor,
        force=force,
    )
    return _submit(request, engine, state, action)


@router.post("", response_model=Job, status_code=status.HTTP_202_ACCEPTED, summary="Start a rollout")
def start_rollout(request: Request, principal: OperatorDep, engine: EngineDep, body: RolloutRequest) -> Job:
    """Roll ``version`` out to ``pool``: canary first, gated stages after, automatic rollback on a failed gate."""
    audit(request, "deployment.rollout")
    state = queue.new_state(
        kind="rollout", version=body.version, pool=body.pool, reason=body.reason, requested_by=principal.name
    )
    return _submit(request, engine, state, "rollout")


@router.post(
    "/{deployment_id}/promote",
    response_model=Job,
    status_code=status.HTTP_202_ACCEPTED,
    summary="Promote a canary",
    responses={409: {"description": "Not running, or refused by the reward-hacking guard (the detail says why)."}},
)
def promote(
    request: Request,
    principal: OperatorDep,
    engine: EngineDep,
    session: SessionDep,
    deployment_id: DeploymentPath,
    body: PromoteRequest | None = None,
) -> Job:
    """Skip the remaining gates of a running rollout and move the whole pool to its version.

    Refused (409) when the reward-hacking guard flags the version: its sessions score higher on the
    reward model while their real retention is lower than the replaced version's. ``force`` overrides."""
    force = bool(body and body.force)
    audit(request, "deployment.promote", deployment_id=deployment_id, force=force or None)
    dep = _get(session, deployment_id)
    if dep.status != "running":
        raise HTTPException(409, f"deployment {deployment_id} is {dep.status}; only a running rollout can be promoted")
    report = promotion_check(
        engine, request.app.state.settings.rewards, candidate=dep.to_version, incumbent=dep.from_version
    )
    audit(request, "deployment.promote", guard_flagged=report.flagged, guard=report.reason)
    if report.flagged and not force:
        message = actions.refusal_message(dep.to_version, dep.from_version, report)
        actions.note_refusal(engine, dep.id, message)
        audit(request, "deployment.promote", refused=message)
        raise HTTPException(409, message)
    if report.flagged:
        audit(request, "deployment.promote", guard_overridden=True)
    return _act(request, engine, dep, "promote", dep.to_version, body, principal.name, force=force)


@router.post("/{deployment_id}/rollback", response_model=Job, status_code=status.HTTP_202_ACCEPTED, summary="Roll back")
def rollback(
    request: Request,
    principal: OperatorDep,
    engine: EngineDep,
    session: SessionDep,
    deployment_id: DeploymentPath,
    body: ActionRequest | None = None,
) -> Job:
    """Move the pool back to the version it served before this deployment."""
    audit(request, "deployment.rollback", deployment_id=deployment_id)
    dep = _get(session, deployment_id)
    if dep.status == "rolled_back":
        raise HTTPException(409, f"deployment {deployment_id} is already rolled back")
    return _act(request, engine, dep, "rollback", dep.from_version, body, principal.name)
