"""The app factory: ``create_app(settings)`` wires the routers, the middleware and the database.

Layout: the JSON API under ``/api/v1`` (OpenAPI at ``/api/v1/openapi.json``), ``/health`` and
``/metrics`` at the root, dashboards at ``/`` and every asset under ``/static`` (no CDN: the
interactive Swagger page is off because it loads from one).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from scheduler.api.middleware import AuditLog, BodySizeLimit, RateLimit

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings

API_PREFIX = "/api/v1"
HERE = Path(__file__).resolve().parent

TAGS = [
    {"name": "jobs", "description": "Retrains and other scheduled work: trigger, list, cancel."},
    {"name": "policy", "description": "Policy versions: list, detail, metrics, lineage."},
    {"name": "reward-models", "description": "Reward-model versions: list, detail, metrics, lineage."},
    {"name": "deployments", "description": "What each pool serves; rollouts, promotion, rollback."},
    {"name": "fleet", "description": "Replicas, their states and the borrowing timeline."},
    {"name": "gateway-keys", "description": "API keys of the gateway's client integrations: create, list, revoke."},
    {"name": "rewards", "description": "Online reward signals per policy version, and proxy-vs-real divergence."},
    {"name": "sessions", "description": "Served sessions (prompts and code only for callers allowed to read them)."},
    {"name": "users", "description": "Users' data: forget a user (operators only)."},
    {"name": "audit", "description": "Who did what, when (operators only)."},
    {"name": "ops", "description": "Health and Prometheus metrics."},
]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Warm the chart renderer in the background while the server starts taking requests."""
    from scheduler.api.charts import warm_up

    threading.Thread(target=warm_up, name="chart-warm-up", daemon=True).start()
    yield


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The control-plane app on ``engine`` (default: the configured database, schema checked)."""
    from scheduler.api.routes import (
        audit,
        dashboards,
        deployments,
        fleet,
        gateway_keys,
        jobs,
        ops,
        policies,
        reward_models,
        rewards,
        sessions,
        users,
    )

    if engine is None:
        from scheduler.runtime import open_database

        engine = open_database(settings)
    app = FastAPI(
        title="Undertow control plane",
        version="1.0.0",
        description=(
            "Trigger retrains, inspect policy and reward-model versions, deploy, watch the fleet and the "
            "online rewards. Authenticate with `Authorization: Bearer <token>` (`undertow tokens create`): "
            "viewer tokens read, operator tokens also trigger and deploy."
        ),
        openapi_url=f"{API_PREFIX}/openapi.json",
        docs_url=None,
        redoc_url=None,
        openapi_tags=TAGS,
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.templates = Jinja2Templates(directory=str(HERE / "templates"))

    for router in (jobs, policies, reward_models, deployments, fleet, gateway_keys, rewards, sessions, users, audit):
        app.include_router(router.router, prefix=API_PREFIX)
    app.include_router(ops.router)
    app.include_router(dashboards.router)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    # Added innermost first: requests pass the proxy headers, the audit log, the rate limit, then the size limit.
    app.add_middleware(BodySizeLimit, max_bytes=settings.api.max_body_bytes)
    app.add_middleware(
        RateLimit,
        per_minute=settings.api.rate_limit_per_minute,
        burst=settings.api.rate_limit_burst,
        engine=engine,
    )
    app.add_middleware(AuditLog, engine=engine)
    if settings.api.trusted_proxies:
        from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=list(settings.api.trusted_proxies))
    return app
