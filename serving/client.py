"""HTTP client for the engine contract: the same calls reach ``vllm serve`` and the CPU engine.

Used by the gateway (completions), the fleet health checks (health, weights version) and the
deployer (pause, prefetch, apply, resume). Weight methods go through vLLM's dev-mode
``/collective_rpc``; every worker must report the same version and hash, else the replica is
inconsistent and :class:`EngineError` is raised. Control calls (everything but completions, the
model list and ``/health``) carry the fleet's control token as a bearer header
(:mod:`serving.engine_auth`); inference calls never do.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import SecretStr

from serving.engine_auth import secret
from serving.protocol import ApplyRequest, ApplyResult, CompletionResponse, PrefetchRequest, WeightInfo


class EngineError(RuntimeError):
    """An engine answered with an error (``status`` is the HTTP status, 0 when unreachable)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: {status}: {message}")
        self.url = url
        self.status = status
        self.message = message


def error_message(resp: httpx.Response) -> str:
    """The message of an engine's error answer (OpenAI's shape, FastAPI's, or plain text)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:500]


class EngineClient:
    """Async client of one engine replica at ``base_url``; ``token``: the control token (None: control
    calls go without one, and the engine refuses them)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        client: httpx.AsyncClient | None = None,
        token: SecretStr | str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self.timeout_s = timeout_s
        raw = secret(token)
        self._control = {"authorization": "Bearer " + raw.decode()} if raw else {}

    async def aclose(self) -> None:
        if self._own:
            await self._client.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
        self, method: str, path: str, *, timeout_s: float | None = None, control: bool = False, **kwargs: Any
    ) -> httpx.Response:
        headers = self._control if control else None
        try:
            resp = await self._client.request(
                method, self.base_url + path, timeout=timeout_s or self.timeout_s, headers=headers, **kwargs
            )
        except httpx.TransportError as exc:
            raise EngineError(self.base_url, 0, f"unreachable ({exc.__class__.__name__})") from exc
        if resp.status_code >= 400:
            raise EngineError(self.base_url, resp.status_code, error_message(resp))
        return resp

    async def completions_raw(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` with a JSON body; the parsed answer."""
        return await self.post_json("/v1/completions", body)

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST path`` with a JSON body (completions, chat completions); the parsed answer."""
        resp = await self._call("POST", path, json=body)
        data: dict[str, Any] = resp.json()
        return data

    async def completions(self, body: dict[str, Any]) -> CompletionResponse:
        """``POST /v1/completions``, validated against the contract."""
        return CompletionResponse.model_validate(await self.completions_raw(body))

    async def health(self, timeout_s: float | None = None) -> bool:
        """True when ``GET /health`` answers 200."""
        await self._call("GET", "/health", timeout_s=timeout_s)
        return True

    async def models(self) -> list[str]:
        """Served model ids (``GET /v1/models``)."""
        resp = await self._call("GET", "/v1/models")
        return [m["id"] for m in resp.json()["data"]]

    async def sleep(self, level: int = 1) -> None:
        await self._call("POST", "/sleep", params={"level": level}, control=True)

    async def wake_up(self) -> None:
        await self._call("POST", "/wake_up", control=True)

    async def is_sleeping(self) -> bool:
        return bool((await self._call("GET", "/is_sleeping", control=True)).json()["is_sleeping"])

    async def pause(self, *, wait_for_inflight_requests: bool = True, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop admitting requests (they are held) and, by default, wait for running ones to finish."""
        params = {"wait_for_inflight_requests": str(wait_for_inflight_requests).lower(), "timeout_s": timeout_s}
        resp = await self._call("POST", "/pause", params=params, timeout_s=timeout_s + 5, control=True)
        return resp.json() if resp.content else {}

    async def resume(self) -> dict[str, Any]:
        resp = await self._call("POST", "/resume", control=True)
        return resp.json() if resp.content else {}

    async def rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``POST /collective_rpc``; all workers must agree, the common result is returned."""
        resp = await self._call(
            "POST", "/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout_s=timeout_s, control=True
        )
        results = resp.json().get("results") or [None]
        first = results[0]
        if any(r != first for r in results[1:]):
            raise EngineError(self.base_url, 500, f"workers disagree on {method}: {results}")
        return first

    async def weight_info(self, timeout_s: float | None = None) -> WeightInfo:
        """The version and hash the replica serves."""
        return WeightInfo.model_validate(await self.rpc("undertow_weight_info", timeout_s=timeout_s))

    async def prefetch(self, req: PrefetchRequest) -> dict[str, Any]:
        """Pull an update (before pausing)."""
        result: dict[str, Any] = await self.rpc("undertow_prefetch", **req.model_dump())
        return result

    async def apply(self, req: ApplyRequest) -> ApplyResult:
        """Apply the staged update (engine paused); raises when the hash does not match."""
        return ApplyResult.model_validate(await self.rpc("undertow_apply", **req.model_dump()))

    async def discard(self) -> None:
        await self.rpc("undertow_discard")
