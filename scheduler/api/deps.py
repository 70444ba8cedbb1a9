"""``Annotated`` dependencies: the database session, the settings, and the caller's role.

The API reads a bearer token from the ``Authorization`` header only. Dashboards (GET pages)
also accept the HttpOnly login cookie set by ``/login``; the cookie is never accepted for a
mutating API call, so a forged cross-site form cannot trigger anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import session_factory
from scheduler.api.auth import Principal, resolve_token, touch
from scheduler.api.middleware import AUDIT_KEY, SESSION_COOKIE
from scheduler.settings import Settings
from scheduler.settings.sections import ApiConfig

BEARER_HELP = "Send `Authorization: Bearer <token>`; create one with `undertow tokens create --role viewer`."


def get_settings(request: Request) -> Settings:
    """The settings the app was built with."""
    settings: Settings = request.app.state.settings
    return settings


def get_api_config(request: Request) -> ApiConfig:
    """The ``api`` settings section."""
    return get_settings(request).api


def get_engine(request: Request) -> Engine:
    """The app's database engine."""
    engine: Engine = request.app.state.engine
    return engine


def get_db(request: Request) -> Iterator[Session]:
    """A session for one request; committed by the handler when it writes."""
    with session_factory(get_engine(request))() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
ApiConfigDep = Annotated[ApiConfig, Depends(get_api_config)]
EngineDep = Annotated[Engine, Depends(get_engine)]
SessionDep = Annotated[Session, Depends(get_db)]


bearer_scheme = HTTPBearer(auto_error=False, description="A token from `undertow tokens create`.")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def _principal(
    request: Request, session: Session, credentials: HTTPAuthorizationCredentials | None, *, allow_cookie: bool
) -> Principal:
    token = credentials.credentials.strip() if credentials and credentials.credentials.strip() else None
    if token is None and allow_cookie:
        token = request.cookies.get(SESSION_COOKIE)
    if token is None:
        raise HTTPException(401, f"missing bearer token. {BEARER_HELP}", headers={"WWW-Authenticate": "Bearer"})
    principal = resolve_token(session, token)
    if principal is None:
        raise HTTPException(
            401,
            "unknown, revoked or expired token; ask an operator for a new one (`undertow tokens create`).",
            headers={"WWW-Authenticate": "Bearer"},
        )
    touch(session, principal, get_api_config(request).token_touch_interval_s)
    audit = request.scope.get(AUDIT_KEY)
    if audit is not None:
        audit["actor"], audit["role"] = principal.name, principal.role
    return principal


def require_viewer(request: Request, session: SessionDep, credentials: BearerDep) -> Principal:
    """Any valid token (viewer or operator), from the Authorization header."""
    return _principal(request, session, credentials, allow_cookie=False)


def require_operator(request: Request, session: SessionDep, credentials: BearerDep) -> Principal:
    """An operator token, from the Authorization header."""
    principal = _principal(request, session, credentials, allow_cookie=False)
    if not principal.can("operator"):
        raise HTTPException(403, "this call needs an operator token; yours is a viewer token.")
    return principal


def require_dashboard_viewer(request: Request, session: SessionDep, credentials: BearerDep) -> Principal:
    """Any valid token from the header or the dashboard login cookie."""
    return _principal(request, session, credentials, allow_cookie=True)


ViewerDep = Annotated[Principal, Depends(require_viewer)]
OperatorDep = Annotated[Principal, Depends(require_operator)]
DashboardDep = Annotated[Principal, Depends(require_dashboard_viewer)]


def audit(request: Request, action: str, **detail: object) -> None:
    """Name the action of a mutating call and add details to its audit entry."""
    entry = request.scope.get(AUDIT_KEY)
    if entry is not None:
        entry["action"] = action
        entry["detail"].update({k: v for k, v in detail.items() if v is not None})
