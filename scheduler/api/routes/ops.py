"""``/health`` (no token) and Prometheus ``/metrics`` (no token unless configured)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from scheduler.api.deps import ApiConfigDep, BearerDep, EngineDep, SessionDep, require_viewer
from scheduler.api.schemas import Health

router = APIRouter(tags=["ops"])


@router.get("/health", response_model=Health, summary="Liveness and database reachability")
def health(engine: EngineDep, response: Response) -> Health:
    """``ok`` when the database answers; ``degraded`` (503) when it does not."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg_version = version("undertow")
    except PackageNotFoundError:
        pkg_version = "unknown"
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        database = "ok"
    except Exception as exc:  # reported, not raised: health must answer while the database is down
        database = f"unreachable: {exc.__class__.__name__}"
        response.status_code = 503
    return Health(status="ok" if database == "ok" else "degraded", database=database, version=pkg_version)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text exposition format."}},
)
def metrics(request: Request, api: ApiConfigDep, session: SessionDep, credentials: BearerDep) -> Response:
    """Ingest lag and rate, events, dead letters, job states, borrowed replicas, rollout state."""
    if api.metrics_require_token:
        require_viewer(request, session, credentials)
    if not hasattr(request.app.state, "metrics_registry"):
        from scheduler.api.metrics import make_registry

        request.app.state.metrics_registry = make_registry(request.app.state.engine)
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
