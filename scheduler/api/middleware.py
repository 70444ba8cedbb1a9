"""ASGI middleware: request-size limit, per-client rate limit, and the audit log of mutating calls.

Pure ASGI (no response buffering), outermost first: size limit, rate limit, audit. Route
dependencies fill ``scope["undertow.audit"]`` (who called, what it did); the audit middleware
writes one row per mutating request once the response status is known, including refused ones.
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
    """Token-bucket rate limit per client: its bearer token or login cookie, else its address.

    Static assets are exempt so one page view costs one request. Over the limit: 429 with
    ``Retry-After``. Buckets live in this process; run one API process per limit you want.
    """

    def __init__(self, app: ASGIApp, per_minute: int, burst: int, max_clients: int = 10_000) -> None:
        self.app = app
        self.rate = per_minute / 60.0
        self.burst = float(max(burst, 1))
        self.max_clients = max_clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _key(self, scope: Scope) -> str:
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"")
        if auth.lower().startswith(b"bearer "):
            return "t:" + hash_token(auth[7:].decode("latin-1").strip())[:24]
        cookie = headers.get(b"cookie", b"").decode("latin-1")
        for part in cookie.split(";"):
            name, _, value = part.strip().partition("=")
            if name == SESSION_COOKIE and value:
                return "t:" + hash_token(value)[:24]
        client = scope.get("client") or ("unknown", 0)
        return f"a:{client[0]}"

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith("/static/") or path == "/favicon.ico":
            await self.app(scope, receive, send)
            return
        wait = self.take(self._key(scope), time.monotonic())
        if wait > 0:
            retry = str(max(1, int(wait + 0.999))).encode()
            await _send_json(
                send, 429, {"detail": "rate limit exceeded: slow down and retry later"}, [(b"retry-after", retry)]
            )
            return
        await self.app(scope, receive, send)


class AuditLog:
    """Write one audit row per mutating request (API calls, login, logout), whatever its outcome."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in MUTATING:
            await self.app(scope, receive, send)
            return
        entry: dict[str, Any] = {"actor": "anonymous", "role": "none", "action": None, "detail": {}}
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
            route = scope.get("route")
            action = entry["action"] or getattr(route, "name", None) or "unrouted"
            client = scope.get("client")
            await anyio.to_thread.run_sync(
                lambda: record_audit(
                    self.engine,
                    actor=entry["actor"],
                    role=entry["role"],
                    method=scope["method"],
                    path=scope.get("path", ""),
                    action=action,
                    status_code=status,
                    client=client[0] if client else None,
                    detail=entry["detail"],
                )
            )
