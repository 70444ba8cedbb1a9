"""The user-facing gateway: an OpenAI-compatible completions endpoint over the serving replicas.

- Balances over the replicas in rotation (least requests in flight); a replica that fails
  to answer (unreachable, 5xx) is retried on another one, so a replica dying or pausing for an
  update does not fail the user's request.
- ``candidates: K`` (or ``n: K``) asks for a candidate group: K samples from one replica, one
  policy version, each choice with its own ``session_id`` and ``candidate_index``, and a
  ``group_id`` on the response.
- Every response carries ``policy_version`` (the version the engine reports in
  ``system_fingerprint``, else the one the registry records for the replica) and the header
  ``x-undertow-policy-version``.
- Every choice is emitted as ``session.completed`` (token ids, logprobs, routed experts) through
  :class:`serving.telemetry.TelemetryEmitter`, off the request path.
- ``POST /v1/signals``: an editor's signal (accept/reject, retention, selection, switch,
  thumbs, ...) is validated against the wire schema and forwarded to Kafka.
- ``GET /gateway/metrics``: per-version request counts, error rates, latency and the
  acceptance proxy, which the deployer's gate reads.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, ValidationError
from sqlalchemy.engine import Engine

from serving.client import EngineClient, EngineError
from serving.config import FleetConfig, GatewayConfig
from serving.engine import openai_error, validation_message
from serving.fleet import Replica
from serving.protocol import CompletionRequest
from serving.telemetry import TelemetryEmitter

log = structlog.get_logger(__name__)

ReplicaSource = Callable[[], Awaitable[list[Replica]]]
"""Returns the replicas in rotation (static list, or the registry)."""

ACCEPT_TYPES = {"edit.accepted": 1.0, "edit.rejected": 0.0}


class GatewayRequest(CompletionRequest):
    """A user's completion request: the engine's fields plus Undertow's."""

    model_config = ConfigDict(extra="ignore")

    user: str | None = Field(default=None, max_length=128)
    session_id: str | None = Field(default=None, min_length=1, max_length=100)
    candidates: int | None = Field(default=None, ge=1)


def static_replicas(urls: list[str], version: str | None = None) -> ReplicaSource:
    """A fixed replica list (no registry)."""
    reps = [Replica(f"r{i}", u, "default", "local", "cpu", "serving", version, None, "ok") for i, u in enumerate(urls)]

    async def source() -> list[Replica]:
        return reps

    return source


@dataclass
class VersionStats:
    """Online metrics of one policy version (what the deployment gate compares)."""

    requests: int = 0
    errors: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    accepts: float = 0.0
    judged: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.errors / self.requests if self.requests else 0.0,
            "latency_ms_p50": lat[len(lat) // 2] if lat else None,
            "acceptance": self.accepts / self.judged if self.judged else None,
            "judged": self.judged,
        }


class Gateway:
    """Balancing, candidate groups, version tagging, telemetry and metrics (the app wraps this)."""

    def __init__(
        self, source: ReplicaSource, emitter: TelemetryEmitter | None, config: GatewayConfig, model_name: str
    ) -> None:
        self.source = source
        self.emitter = emitter
        self.config = config
        self.model_name = model_name
        self.http = httpx.AsyncClient(timeout=config.request_timeout_s, limits=httpx.Limits(max_connections=256))
        self.inflight: dict[str, int] = defaultdict(int)
        self.stats: dict[str, VersionStats] = defaultdict(VersionStats)
        self.session_versions: OrderedDict[str, str] = OrderedDict()
        self._rr = itertools.count()

    async def pick(self, exclude: set[str]) -> Replica | None:
        reps = [r for r in await self.source() if r.id not in exclude]
        if not reps:
            return None
        offset = next(self._rr)
        order = sorted(range(len(reps)), key=lambda i: (self.inflight[reps[i].id], (i + offset) % len(reps)))
        return reps[order[0]]

    async def complete(self, req: GatewayRequest) -> tuple[int, dict[str, Any]]:
        """Serve one user request; returns (status, body)."""
        k = req.candidates or req.n
        if k > self.config.max_candidates:
            return 400, _err(f"candidates/n {k} exceeds the gateway's limit of {self.config.max_candidates}")
        if isinstance(req.prompt, str) and len(req.prompt) > self.config.max_prompt_chars:
            return 400, _err(f"prompt is {len(req.prompt)} characters; the limit is {self.config.max_prompt_chars}")
        body = req.model_dump(exclude={"user", "session_id", "candidates"}, exclude_none=True)
        body.update(n=k, return_token_ids=True, logprobs=req.logprobs or 0, model=None)
        body.pop("model")
        tried: set[str] = set()
        last: EngineError | None = None
        for _ in range(self.config.retries + 1):
            rep = await self.pick(tried)
            if rep is None:
                break
            tried.add(rep.id)
            start = time.perf_counter()
            self.inflight[rep.id] += 1
            try:
                data = await EngineClient(rep.url, client=self.http).completions_raw(body)
            except EngineError as exc:
                last = exc
                if 400 <= exc.status < 500 and exc.status != 409:
                    return exc.status, _err(exc.message)
                self.stats[rep.version or "unknown"].errors += 1
                continue
            finally:
                self.inflight[rep.id] -= 1
            latency_ms = (time.perf_counter() - start) * 1000
            version = data.get("system_fingerprint") or rep.version or "unknown"
            stats = self.stats[version]
            stats.requests += 1
            stats.latencies_ms.append(latency_ms)
            return 200, self._shape(req, data, version, latency_ms)
        if last is None:
            return 503, _err("no serving replica is in rotation; retry shortly", "ServiceUnavailableError")
        return 502, _err(f"no replica could serve the request (last: {last})", "BadGatewayError")

    def _shape(self, req: GatewayRequest, data: dict[str, Any], version: str, latency_ms: float) -> dict[str, Any]:
        k = len(data["choices"])
        group_id = f"grp-{uuid.uuid4().hex}" if k > 1 else None
        base = req.session_id or f"ses-{uuid.uuid4().hex}"
        for choice in data["choices"]:
            idx = int(choice["index"])
            session_id = base if k == 1 else f"{base}-{idx}"
            choice["session_id"] = session_id
            if group_id:
                choice["candidate_index"] = idx
            self._remember(session_id, version)
            if self.emitter is not None:
                self.emitter.emit(self._event(req, data, choice, session_id, group_id, version, latency_ms))
            if not req.return_token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            if req.logprobs is None:
                choice["logprobs"] = None
        data["policy_version"] = version
        data["model"] = self.model_name
        if group_id:
            data["group_id"] = group_id
        return data

    def _remember(self, session_id: str, version: str) -> None:
        self.session_versions[session_id] = version
        while len(self.session_versions) > 100_000:
            self.session_versions.popitem(last=False)

    def _event(
        self,
        req: GatewayRequest,
        data: dict[str, Any],
        choice: dict[str, Any],
        session_id: str,
        group_id: str | None,
        version: str,
        latency_ms: float,
    ) -> dict[str, Any]:
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        prompt: dict[str, Any] = {"token_ids": choice.get("prompt_token_ids")}
        if isinstance(req.prompt, str):
            prompt["text"] = req.prompt
        payload: dict[str, Any] = {
            "model": self.model_name,
            "policy_version": version,
            "prompt": prompt,
            "segments": [
                {
                    "role": "assistant",
                    "text": choice.get("text", ""),
                    "token_ids": choice.get("token_ids"),
                    "logprobs": logprobs,
                }
            ],
            "sampling": {
                "temperature": req.temperature,
                "top_p": req.top_p,
                "max_tokens": req.max_tokens,
                "seed": req.seed,
                "logprobs_mode": "raw",
            },
            "finish_reason": choice.get("finish_reason"),
            "latency_ms": latency_ms,
        }
        if choice.get("routed_experts"):
            payload["routed_experts"] = choice["routed_experts"]
        if group_id:
            payload["group_id"], payload["candidate_index"] = group_id, int(choice["index"])
        event: dict[str, Any] = {
            "schema_version": 1,
            "event_id": str(uuid.uuid4()),
            "type": "session.completed",
            "occurred_at": datetime.now(UTC).isoformat(),
            "session_id": session_id,
            "payload": _drop_none(payload),
        }
        if req.user:
            event["user_id"] = req.user
        return event

    def signal(self, raw: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Validate one signal envelope (event_id/occurred_at filled when absent) and forward it."""
        from ingest.schemas import InvalidEvent, validate_event

        if raw.get("type") == "session.completed":
            return 400, _err("session.completed is emitted by the gateway itself; send signals only")
        raw.setdefault("schema_version", 1)
        raw.setdefault("event_id", str(uuid.uuid4()))
        raw.setdefault("occurred_at", datetime.now(UTC).isoformat())
        try:
            event = validate_event(raw)
        except InvalidEvent as exc:
            return 422, _err(f"invalid signal ({exc.reason}): {exc.detail}")
        self._score(event.type, event.session_id, event.payload.model_dump())
        if self.emitter is not None:
            self.emitter.emit(event.model_dump(mode="json", exclude_none=True))
        return 202, {"accepted": True, "event_id": event.event_id}

    def _score(self, kind: str, session_id: str | None, payload: dict[str, Any]) -> None:
        version = self.session_versions.get(session_id or "")
        if version is None:
            return
        value: float | None = ACCEPT_TYPES.get(kind)
        if kind == "feedback.thumbs":
            value = 1.0 if payload.get("value") == 1 else 0.0
        elif kind == "code.retained" and payload.get("lines_written"):
            value = payload["lines_retained"] / payload["lines_written"]
        if value is not None:
            self.stats[version].accepts += value
            self.stats[version].judged += 1

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"versions": {v: s.summary() for v, s in self.stats.items()}}
        if self.emitter is not None:
            out["telemetry"] = dict(self.emitter.stats)
        return out


def _err(message: str, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


def _drop_none(obj: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, dict):
            value = _drop_none(value)
        elif isinstance(value, list):
            value = [_drop_none(v) if isinstance(v, dict) else v for v in value]
        if value is not None:
            out[key] = value
    return out


def create_gateway_app(gateway: Gateway, background: list[Callable[[], Awaitable[None]]] | None = None) -> FastAPI:
    """The gateway's FastAPI app; ``background`` coroutines (health checks) run while it serves."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        tasks = [asyncio.ensure_future(job()) for job in background or []]
        yield
        for task in tasks:
            task.cancel()
        await gateway.http.aclose()
        if gateway.emitter is not None:
            await asyncio.to_thread(gateway.emitter.close)

    app = FastAPI(title="Undertow gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    limit = gateway.config.max_body_bytes

    @app.middleware("http")
    async def body_limit(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.method == "POST":
            declared = request.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                return openai_error(
                    413,
                    f"request body is larger than the limit of {limit} bytes; send a shorter prompt",
                    "RequestTooLarge",
                )
            body = await request.body()
            if len(body) > limit:
                return openai_error(
                    413,
                    f"request body is larger than the limit of {limit} bytes; send a shorter prompt",
                    "RequestTooLarge",
                )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return openai_error(400, validation_message(exc))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        reps = await gateway.source()
        return {"status": "ok", "replicas_in_rotation": len(reps)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "owned_by": "undertow"}]}

    @app.post("/v1/completions")
    async def completions(req: GatewayRequest) -> JSONResponse:
        status, body = await gateway.complete(req)
        if "error" in body:
            body["error"]["code"] = status
        headers = {"x-undertow-policy-version": body["policy_version"]} if status == 200 else None
        return JSONResponse(status_code=status, content=body, headers=headers)

    @app.post("/v1/signals")
    async def signals(request: Request) -> JSONResponse:
        try:
            raw = await request.json()
        except ValueError:
            return openai_error(400, "the body is not JSON; send one signal event as a JSON object")
        if not isinstance(raw, dict):
            return openai_error(400, "send one signal event as a JSON object")
        try:
            status, body = gateway.signal(raw)
        except ValidationError as exc:
            return openai_error(422, f"invalid signal: {exc.errors()[:3]}")
        return JSONResponse(status_code=status, content=body)

    @app.get("/gateway/metrics")
    async def metrics() -> dict[str, Any]:
        return gateway.metrics()

    return app


def registry_source(db: Engine, pool: str, refresh_s: float) -> ReplicaSource:
    """Replicas in rotation from the registry, re-read at most every ``refresh_s`` seconds."""
    from serving.fleet import list_replicas

    cache: dict[str, Any] = {"at": 0.0, "reps": []}

    async def source() -> list[Replica]:
        if time.monotonic() - cache["at"] > refresh_s:
            reps = await asyncio.to_thread(list_replicas, db, pool)
            cache["reps"], cache["at"] = [r for r in reps if r.in_rotation], time.monotonic()
        return list(cache["reps"])

    return source


def health_loop(db: Engine, config: FleetConfig, pool: str) -> Callable[[], Awaitable[None]]:
    """A background job checking the pool's replicas every ``config.health_interval_s``."""
    from serving.fleet import check_fleet

    async def job() -> None:
        while True:
            try:
                await check_fleet(db, config, pool)
            except Exception as exc:  # a failed round (database busy) is retried at the next interval
                log.warning("gateway.health_check_failed", error=str(exc))
            await asyncio.sleep(config.health_interval_s)

    return job


def serve_gateway(
    gateway: Gateway, host: str, port: int, background: list[Callable[[], Awaitable[None]]] | None = None
) -> None:
    """Serve the gateway until interrupted."""
    import uvicorn

    uvicorn.run(create_gateway_app(gateway, background), host=host, port=port, log_level="warning", access_log=False)
