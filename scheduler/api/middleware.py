"""ASGI middleware: the audit log, the rate limit per valid token or client address, the request-size limit.

Pure ASGI (no response buffering), outermost first: the proxy headers (uvicorn's, only with
``api.trusted_proxies``), audit, rate limit, size limit. Route dependencies fill
``scope["undertow.audit"]`` (who called, what it did); the audit middleware writes one row per
mutating or refused request once the response status is known.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio
from sqlalchemy.engine import Engine
from starlette.exceptions import HTTPException

from scheduler.api.auth import hash_token, record_audit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REFUSED = frozenset({400, 401, 403, 405, 413, 422, 429})
"""Statuses audited whatever the method: the request was refused."""
AUDIT_KEY = "undertow.audit"
SESSION_COOKIE = "undertow_session"


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data})


class _BodyTooLarge(HTTPException):
    """Raised while the app reads a streamed body past the limit (an HTTPException, so the
    framework answers 413 instead of reporting a body it could not parse)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body too large: the limit is {limit} bytes")


class BodySizeLimit:
    """Refuse request bodies over ``max_bytes`` with 413, by header or by counting a streamed body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        detail = {"detail": f"request body too large: the limit is {self.max_bytes} bytes"}
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "malformed Content-Length header"})
                    return
                if declared > self.max_bytes:
                    await _send_json(send, 413, detail)
                    return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_json(send, 413, detail)


class RateLimit:
    """Token-bucket rate limit per valid token, else per client address.

    A request carrying a token (bearer header or login cookie) that is valid (known, not revoked, not
    expired; checked in the database, the answer kept ``valid_cache_s``) takes from that token's bucket.
    Every other request, a random bogus token's included, takes from its client address's bucket (the
    address :class:`uvicorn.middleware.proxy_headers.ProxyHeadersMiddleware` resolved behind a trusted
    proxy), so forging tokens buys no extra requests. A token not known valid costs one indexed lookup
    (as its 401 would), so an operator behind an address that others exhausted still gets in.
    Static assets are exempt so one page view costs one request. Over the limit: 429 with
    ``Retry-After``; only the first refusal per bucket and minute is audited. Buckets live in this
    process; run one API process per limit you want.
    """

    def __init__(
        self,
        app: ASGIApp,
        per_minute: int,
        burst: int,
        engine: Engine | None = None,
        max_clients: int = 10_000,
        valid_cache_s: float = 10.0,
    ) -> None:
        self.app = app
        self.rate = per_minute / 60.0
        self.burst = float(max(burst, 1))
        self.engine = engine
        self.max_clients = max_clients
        self.valid_cache_s = valid_cache_s
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.valid: OrderedDict[str, float] = OrderedDict()
        """Hashes of tokens found valid, with when they were checked."""
        self.refused_at: OrderedDict[str, float] = OrderedDict()

    def take(self, key: str, now: float) -> float:
        """Take one request from ``key``'s bucket; 0 when allowed, else seconds until allowed."""
        tokens, last = self.buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate if self.rate > 0 else 60.0
        self.buckets[key] = (tokens, now)
        while len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)
        return wait

    def _is_valid(self, token: str) -> bool:
        if self.engine is None:
            return False
        from ingest.db import session_factory
        from scheduler.api.auth import resolve_token

        with session_factory(self.engine)() as session:
            return resolve_token(session, token) is not None

    async def _token_key(self, token: str | None, now: float) -> str | None:
        """The bucket of a valid token (cached), None for no token or an invalid one."""
        if not token:
            return None
        digest = hash_token(token)
        checked = self.valid.get(digest)
        if checked is not None and now - checked < self.valid_cache_s:
            return "t:" + digest[:24]
        self.valid.pop(digest, None)
        if not await anyio.to_thread.run_sync(self._is_valid, token):
            return None
        self.valid[digest] = now
        while len(self.valid) > self.max_clients:
            self.valid.popitem(last=False)
        return "t:" + digest[:24]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith("/static/") or path == "/favicon.ico":
            await self.app(scope, receive, send)
            return
        now = time.monotonic()
        key = await self._token_key(presented_token(scope), now) or f"a:{client_address(scope)}"
        wait = self.take(key, now)
        if wait > 0:
            last = self.refused_at.pop(key, None)
            self.refused_at[key] = last if last is not None and now - last < 60.0 else now
            while len(self.refused_at) > self.max_clients:
                self.refused_at.popitem(last=False)
            entry = scope.get(AUDIT_KEY)
            if entry is not None:
                entry["action"] = "rate_limited"
                entry["quiet"] = last is not None and now - last < 60.0
            retry = str(max(1, int(wait + 0.999))).encode()
            await _send_json(
                send, 429, {"detail": "rate limit exceeded: slow down and retry later"}, [(b"retry-after", retry)]
            )
            return
        await self.app(scope, receive, send)


def client_address(scope: Scope) -> str:
    """The client's address (as the proxy-headers middleware left it)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def presented_token(scope: Scope) -> str | None:
    """The token a request carries: its bearer header, else its login cookie."""
    auth = b""
    cookie = b""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            auth = value
        elif name == b"cookie":
            cookie = value
    if auth.lower().startswith(b"bearer "):
        token = auth[7:].decode("latin-1").strip()
        if token:
            return token
    for part in cookie.decode("latin-1").split(";"):
        name, _, value = part.strip().partition("=")
        if name == SESSION_COOKIE and value:
            return value
    return None


class AuditLog:
    """Write one audit row per mutating request (API calls, login, logout) and per refused request of any
    method (400, 401, 403, 405, 413, 422, 429), whatever its outcome.

    Outermost but for the proxy headers, so the size limit's 413 and the rate limit's 429 are seen. A
    refused request whose route never named its caller (a malformed body is refused before the
    dependencies run) is attributed here to the token it carries, when that token is valid.
    """

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    def _attribute(self, entry: dict[str, Any], token: str | None) -> None:
        from ingest.db import session_factory
        from scheduler.api.auth import resolve_token

        if not token:
            return
        with session_factory(self.engine)() as session:
            principal = resolve_token(session, token)
        if principal is None:
            entry["detail"]["token"] = "invalid"
        else:
            entry["actor"], entry["role"] = principal.name, principal.role

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry: dict[str, Any] = {"actor": "anonymous", "role": "none", "action": None, "detail": {}, "quiet": False}
        scope[AUDIT_KEY] = entry
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            if (scope.get("method") in MUTATING or status in REFUSED) and not entry["quiet"]:
                route = scope.get("route")
                action = entry["action"] or getattr(route, "name", None) or "unrouted"
                token = presented_token(scope) if entry["actor"] == "anonymous" and status >= 400 else None

                def write() -> None:
                    self._attribute(entry, token)
                    record_audit(
                        self.engine,
                        actor=entry["actor"],
                        role=entry["role"],
                        method=scope["method"],
                        path=scope.get("path", ""),
                        action=action,
                        status_code=status,
                        client=client_address(scope),
                        detail=entry["detail"],
                    )

                await anyio.to_thread.run_sync(write)
