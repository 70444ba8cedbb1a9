"""A request-body limit as plain ASGI middleware, in front of the gateway's routes.

A body declared larger than the limit (``content-length``) is refused before the app runs; the
server delivers no more than the declared length. A body without a declared length (chunked) is
read only up to the limit: one byte more and the request is refused, so a client cannot make the
gateway hold more than the limit in memory. The refusal is the app's own error answer (OpenAI's
shape, counted). Unlike ``@app.middleware("http")``, nothing wraps the response: a streamed
answer goes to the client chunk by chunk with no extra hop.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """Refuse POST bodies over ``limit`` bytes with ``refuse(limit)``'s response."""

    def __init__(self, app: ASGIApp, limit: int, refuse: Callable[[int], Response]) -> None:
        self.app = app
        self.limit = limit
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await self.refuse(self.limit)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body ended
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self.refuse(self.limit)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1").strip()
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: http.disconnect when the client leaves

    return replay
