"""A request-body limit as plain ASGI middleware, in front of the gateway's routes.

Every request's body is counted as it streams in, whatever it declares: a body declared larger
than the limit (``content-length``) is refused before a byte of it is read, and any other body is
read only up to the limit: one byte more and the request is refused, so a client cannot make the
gateway hold more than the limit in memory. The declared length is never trusted on its own: a
request that carries ``transfer-encoding: chunked`` beside a small ``content-length`` is framed by
the chunks (HTTP/1.1: chunked wins), and such a request used to reach the app unbounded. The body,
at most ``limit`` bytes, is handed to the app as one message. The refusal is the app's own error
answer (OpenAI's shape, counted). What the client still sends after a refusal is read and
discarded by the server, never held.

Unlike ``@app.middleware("http")``, nothing wraps the response: a streamed answer goes to the
client chunk by chunk with no extra hop. Left out: a deadline on slow bodies (a client that sends
a byte a minute holds a connection, not memory); that belongs to the proxy in front.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with ``refuse(limit)``'s response."""

    def __init__(self, app: ASGIApp, limit: int, refuse: Callable[[int], Response]) -> None:
        self.app = app
        self.limit = limit
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not (declared.isascii() and declared.isdigit()) or int(declared) > self.limit):
            await self.refuse(self.limit)(scope, receive, send)
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
