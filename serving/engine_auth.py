"""The engines' control token: every route but inference needs ``Authorization: Bearer <token>``.

An engine's control routes (``/pause``, ``/resume``, ``/sleep``, ``/wake_up``, ``/collective_rpc``
with the weight methods, and whatever else it serves) change what it serves or whether it serves;
without a check anyone who reaches its port could pause a replica or swap its weights. Only the
inference routes of :data:`OPEN_PATHS` (and the liveness and metrics probes) stay open; any other
path, exactly matched, needs the token, compared in constant time.

:class:`ControlAuth` is a plain ASGI middleware, so both backends use the same one: the CPU engine
adds it with the token from its settings; ``vllm serve --middleware serving.engine_auth.ControlAuth``
adds it to vLLM's server, where it reads the token from the environment variable
:data:`TOKEN_ENV` (the name of the setting ``serving.fleet.control_token``). vLLM's own ``--api-key``
covers only ``/v1`` paths, not its dev-mode routes; its dev mode also has routes this project never
calls, which this middleware closes too.

An engine with no token configured refuses every control call (there is no open mode). The
clients (:class:`serving.client.EngineClient`: health checks, the deployer, borrowing) send the token
only on control calls; inference requests never carry it.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

from pydantic import SecretStr

TOKEN_ENV = "UNDERTOW_SERVING__FLEET__CONTROL_TOKEN"
"""Where a process that has no settings tree (vLLM's server) finds the token."""
OPEN_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/ping"})
"""Paths served without the token: inference, the model list, liveness and the Prometheus counters."""

Scope = dict[str, Any]


def secret(token: SecretStr | str | None) -> bytes | None:
    """The token's bytes (None or empty: no token)."""
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    return value.encode() if value else None


class ControlAuth:
    """ASGI middleware refusing control routes without the bearer token (401, OpenAI's error shape)."""

    def __init__(self, app: Any, token: SecretStr | str | None = None) -> None:
        self.app = app
        self.token = secret(token) if token is not None else secret(os.environ.get(TOKEN_ENV))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path", "") in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closed before it is accepted: the server answers 403
            await send({"type": "websocket.close", "code": 1008})
            return
        if self.token is None:
            message = (
                f"this engine has no control token, so its control routes are closed: set {TOKEN_ENV} "
                "(serving.fleet.control_token) where the engine runs and where its deployer runs"
            )
        else:
            message = "a control route needs the engine's control token as 'Authorization: Bearer <token>'"
        body = json.dumps({"error": {"message": message, "type": "AuthenticationError", "code": 401}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="undertow-engine-control"'),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Scope) -> bool:
        if self.token is None:
            return False
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)
        return False
