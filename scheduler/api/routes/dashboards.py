"""Server-rendered dashboards, the login form, and the favicon.

How a browser authenticates: ``/login`` takes an API token (viewer or operator) in a form and
sets it in an HttpOnly, ``SameSite=Strict`` cookie; every page then reads it. Pages only read,
so a viewer token is enough; ``/logout`` clears the cookie. Both forms carry a CSRF token
(double-submit: every page sets a random ``undertow_csrf`` cookie and puts the same value in its
forms; a POST whose field does not match the cookie is refused with 403, which another site cannot
forge since it can neither read nor set that cookie). Login rotates it. The JSON API never accepts the
cookie for a mutating call (it wants the ``Authorization`` header), so the cookie cannot be
used to trigger anything from another site.
"""

from __future__ import annotations

import re
import secrets
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from ingest.db import session_factory
from scheduler.api import analytics, views
from scheduler.api.app import HERE
from scheduler.api.auth import Principal, resolve_token
from scheduler.api.deps import ApiConfigDep, SessionDep, audit
from scheduler.api.middleware import SESSION_COOKIE

router = APIRouter(include_in_schema=False)

CSP = (
    "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; script-src 'none'; "
    "frame-ancestors 'none'"
)


CSRF_COOKIE = "undertow_csrf"
CSRF_FIELD = "csrf_token"
_CSRF_SHAPE = re.compile(r"[A-Za-z0-9_-]{43}")


def _set_csrf(request: Request, response: Response, token: str) -> None:
    response.set_cookie(
        CSRF_COOKIE,
        token,
        max_age=request.app.state.settings.api.session_max_age_s,
        httponly=True,
        samesite="strict",
        secure=request.app.state.settings.api.cookie_secure,
        path="/",
    )


def csrf_ok(request: Request, form: dict[str, list[str]]) -> bool:
    """True when the form's CSRF field matches the CSRF cookie (both present and well formed)."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    sent = (form.get(CSRF_FIELD) or [""])[0]
    return bool(_CSRF_SHAPE.fullmatch(cookie)) and secrets.compare_digest(cookie.encode(), sent.encode())


def _page(request: Request, template: str, context: dict[str, Any], started: float, status: int = 200) -> HTMLResponse:
    csrf = request.cookies.get(CSRF_COOKIE, "")
    fresh = not _CSRF_SHAPE.fullmatch(csrf)
    if fresh:
        csrf = secrets.token_urlsafe(32)
    context = {
        **context,
        "now": datetime.now(UTC),
        "render_ms": (time.perf_counter() - started) * 1000,
        "csrf_token": csrf,
    }
    response: HTMLResponse = request.app.state.templates.TemplateResponse(
        request, template, context, status_code=status
    )
    if fresh:
        _set_csrf(request, response, csrf)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


def _who(request: Request, session: Session) -> Principal | None:
    token = request.headers.get("authorization", "").partition(" ")[2].strip() or request.cookies.get(SESSION_COOKIE)
    return resolve_token(session, token) if token else None


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)


def _safe_next(value: str | None) -> str:
    """Only local paths: never redirect a logged-in browser to another site."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\\\" in value:
        return "/"
    return value


def _filters(request: Request, signal: str | None = None) -> dict[str, Any]:
    window = request.query_params.get("window", "all")
    return {
        "window": window if window in views.WINDOWS else "all",
        "model": (request.query_params.get("model") or "")[:128],
        "signal": signal,
    }


CSRF_ERROR = "The form expired or did not come from this site: reload the page and try again."


async def _form(request: Request) -> dict[str, list[str]]:
    """The posted form (empty when it has more fields than a login form could)."""
    try:
        return parse_qs((await request.body()).decode("utf-8", errors="replace"), max_num_fields=10)
    except ValueError:
        return {}


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    return FileResponse(HERE / "static" / "favicon.ico", media_type="image/x-icon")


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/") -> HTMLResponse:
    return _page(
        request,
        "login.html",
        {"title": "Log in", "principal": None, "next": _safe_next(next), "error": None},
        time.perf_counter(),
    )


@router.post("/login", response_model=None)
async def login(request: Request, api: ApiConfigDep) -> Response:
    started = time.perf_counter()
    audit(request, "login")
    form = await _form(request)
    token = (form.get("token") or [""])[0].strip()
    target = _safe_next((form.get("next") or ["/"])[0])
    if not csrf_ok(request, form):
        context = {"title": "Log in", "principal": None, "next": target, "error": CSRF_ERROR}
        return _page(request, "login.html", context, started, status=403)

    def check() -> Principal | None:
        with session_factory(request.app.state.engine)() as session:
            return resolve_token(session, token) if token else None

    principal = await run_in_threadpool(check)
    if principal is None:
        context = {"title": "Log in", "principal": None, "next": target, "error": "Unknown or revoked token."}
        return _page(request, "login.html", context, started, status=401)
    audit(request, "login")
    entry = request.scope.get("undertow.audit")
    if entry is not None:
        entry["actor"], entry["role"] = principal.name, principal.role
    response = RedirectResponse(target, status_code=303)
    _set_csrf(request, response, secrets.token_urlsafe(32))
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=api.session_max_age_s,
        httponly=True,
        samesite="strict",
        secure=api.cookie_secure,
        path="/",
    )
    return response


@router.post("/logout", response_model=None)
async def logout(request: Request) -> Response:
    audit(request, "logout")

    def who() -> Principal | None:
        with session_factory(request.app.state.engine)() as session:
            return _who(request, session)

    principal = await run_in_threadpool(who)
    entry = request.scope.get("undertow.audit")
    if principal is not None and entry is not None:
        entry["actor"], entry["role"] = principal.name, principal.role
    if not csrf_ok(request, await _form(request)):
        return HTMLResponse(CSRF_ERROR, status_code=403)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.get("/", response_class=HTMLResponse, response_model=None)
def overview(request: Request, session: SessionDep) -> Response:
    started = time.perf_counter()
    principal = _who(request, session)
    if principal is None:
        return _to_login(request)
    context = views.overview(session, request.app.state.settings, datetime.now(UTC))
    return _page(
        request, "overview.html", {"title": "Overview", "active": "/", "principal": principal, **context}, started
    )


@router.get("/rewards", response_class=HTMLResponse, response_model=None)
def rewards(request: Request, session: SessionDep) -> Response:
    started = time.perf_counter()
    principal = _who(request, session)
    if principal is None:
        return _to_login(request)
    signal = request.query_params.get("signal", "retention")
    filters = _filters(request, signal if signal in analytics.SIGNALS else "retention")
    f = views.reward_filter(filters["window"], filters["model"], datetime.now(UTC))
    context = {
        "title": "Rewards",
        "active": "/rewards",
        "principal": principal,
        "filters": filters,
        "windows": list(views.WINDOWS),
        "models": views.models_seen(session),
        "signals": analytics.SIGNALS,
        **views.rewards(session, f, filters["signal"]),
    }
    return _page(request, "rewards.html", context, started)


@router.get("/models", response_class=HTMLResponse, response_model=None)
def models(request: Request, session: SessionDep) -> Response:
    started = time.perf_counter()
    principal = _who(request, session)
    if principal is None:
        return _to_login(request)
    context = {
        "title": "Models",
        "active": "/models",
        "principal": principal,
        **views.models(session, request.app.state.settings),
    }
    return _page(request, "models.html", context, started)


@router.get("/fleet", response_class=HTMLResponse, response_model=None)
def fleet(request: Request, session: SessionDep) -> Response:
    started = time.perf_counter()
    principal = _who(request, session)
    if principal is None:
        return _to_login(request)
    filters = _filters(request)
    now = datetime.now(UTC)
    context = {
        "title": "Fleet",
        "active": "/fleet",
        "principal": principal,
        "filters": filters,
        "windows": list(views.WINDOWS),
        "models": views.models_seen(session),
        "signals": None,
        **views.fleet(session, views.reward_filter(filters["window"], filters["model"], now), now),
    }
    return _page(request, "fleet.html", context, started)


@router.get("/jobs", response_class=HTMLResponse, response_model=None)
def jobs(request: Request, session: SessionDep) -> Response:
    started = time.perf_counter()
    principal = _who(request, session)
    if principal is None:
        return _to_login(request)
    context = {"title": "Jobs", "active": "/jobs", "principal": principal, **views.jobs(session, datetime.now(UTC))}
    return _page(request, "jobs.html", context, started)
