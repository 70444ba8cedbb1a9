"""The CPU reference engine: vLLM 0.33's OpenAI-server subset over HTTP, running the torch policy.

Endpoints (vLLM names and shapes): ``POST /v1/completions`` and ``POST /v1/chat/completions``
(whole or streamed as server-sent events; :mod:`serving.generation`, :mod:`serving.chat`),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (vLLM's request and token counters),
``POST /sleep?level=``, ``POST /wake_up``, ``GET /is_sleeping``, ``POST /pause``,
``POST /resume``, ``GET /is_paused`` and ``POST /collective_rpc`` carrying the Undertow weight
methods of :data:`serving.protocol.WEIGHT_RPC_METHODS` (the same methods the vLLM worker
extension exposes). The weights version is also returned as ``system_fingerprint``.

Every route but inference, the model list, ``/health`` and ``/metrics`` needs the fleet's control
token as a bearer header (:mod:`serving.engine_auth`): without it, or with a wrong one, the answer is
401 and nothing is paused, put to sleep or applied.

Pause holds new requests (they wait, they do not fail) until ``/resume``; with
``wait_for_inflight_requests=true`` (what the deployer sends) it returns once running requests
have finished, so weights never change under a running request. Sleeping requests get 503.
On CPU there is nowhere to offload weights to: both sleep levels keep them in memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import structlog
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import SecretStr

from serving import generation
from serving.chat import ARGUMENTS_OPENING, ChatError, forced_prefix, render_prompt, tool_names
from serving.config import EngineConfig
from serving.engine_auth import ControlAuth
from serving.generation import Job
from serving.memory import reserve, retain_freed_memory
from serving.protocol import (
    ApplyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    PrefetchRequest,
    RpcRequest,
    SampledRequest,
)
from serving.runner import ModelRunner
from serving.weights import WeightUpdater

log = structlog.get_logger(__name__)
T = TypeVar("T")


def openai_error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    """An error in the OpenAI/vLLM shape ``{"error": {"message", "type", "code"}}``."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def validation_message(exc: RequestValidationError) -> str:
    """One readable line from a request validation error."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


class EngineState:
    """Pause, sleep and in-flight bookkeeping (event-loop side only)."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()
        self.sleeping_level = 0
        self.inflight = 0
        self.idle = asyncio.Condition()
        self.paused_at: float | None = None
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    async def enter(self) -> None:
        await self.running.wait()
        self.inflight += 1

    async def leave(self) -> None:
        async with self.idle:
            self.inflight -= 1
            self.idle.notify_all()

    async def drain(self, timeout_s: float) -> None:
        async with self.idle:
            await asyncio.wait_for(self.idle.wait_for(lambda: self.inflight == 0), timeout_s)


def create_engine_app(
    runner: ModelRunner, updater: WeightUpdater, config: EngineConfig, control_token: SecretStr | None
) -> FastAPI:
    """The engine's FastAPI app around a loaded runner and its weight updater; its control routes need
    ``control_token`` (None: they are closed)."""
    app = FastAPI(title="Undertow CPU engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ControlAuth, token=control_token or "")
    max_model_len = min(config.max_model_len, runner.context_limit or config.max_model_len)
    state = EngineState()
    app.state.engine = state
    # Weight calls run one at a time on a thread of their own: a prefetch, an apply and a discard
    # never interleave, and the staging buffers stay in one allocator arena that later updates
    # reuse (generation threads would otherwise scatter them over arenas of their own, and every
    # update would fault fresh pages in).
    weights_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="undertow-weights")
    app.state.weights_thread = weights_thread

    async def on_weights_thread(fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(weights_thread, fn)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return openai_error(400, validation_message(exc))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "undertow",
            "root": str(runner.checkpoint),
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check(model: str | None, n: int, max_tokens: int | None, prompt_len: int) -> JSONResponse | int:
        """The completion budget for a request, or the error that refuses it."""
        if model not in (None, config.served_model_name):
            return openai_error(
                404,
                f"model {model!r} does not exist; this engine serves {config.served_model_name!r}",
                "NotFoundError",
            )
        if n > config.max_n:
            return openai_error(400, f"n {n} exceeds this engine's limit of {config.max_n}")
        if max_tokens is not None and max_tokens > config.max_tokens_limit:
            return openai_error(
                400, f"max_tokens {max_tokens} exceeds this engine's limit of {config.max_tokens_limit}"
            )
        room = max_model_len - prompt_len
        budget = max_tokens if max_tokens is not None else min(config.max_tokens_limit, room)
        if budget < 1 or prompt_len + budget > max_model_len:
            return openai_error(
                400,
                f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{prompt_len} and max_tokens asks for {budget}: shorten the prompt or lower max_tokens",
            )
        if state.sleeping_level:
            return openai_error(503, "the engine is sleeping; POST /wake_up first", "ServiceUnavailableError")
        return budget

    async def finished(reasons: list[str], tokens: int) -> None:
        for reason in reasons:
            state.finished[reason] += 1
        state.generation_tokens += tokens
        await state.leave()

    def make_job(request: SampledRequest, prompt_ids: list[int], budget: int, **how: Any) -> Job:
        return Job(
            prompt_ids=prompt_ids,
            params=request.sampling(budget),
            model=config.served_model_name,
            version=updater.version,
            return_token_ids=request.return_token_ids,
            routed=config.enable_return_routed_experts,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            stream=request.stream,
            **how,
        )

    async def answer(job: Job) -> Response:
        await state.enter()
        job.version = updater.version
        state.prompt_tokens += len(job.prompt_ids)
        if job.stream:
            return StreamingResponse(
                generation.stream(job, runner, finished),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        body: dict[str, Any] = {}
        try:
            body = await asyncio.to_thread(generation.run, job, runner)
        finally:
            choices = body.get("choices", [])
            tokens = int(body.get("usage", {}).get("completion_tokens", 0))
            await finished([str(c.get("finish_reason")) for c in choices] or ["error"], tokens)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        label = f'model_name="{config.served_model_name}"'
        lines = [
            "# TYPE vllm:request_success_total counter",
            *(
                f'vllm:request_success_total{{finished_reason="{reason}",{label}}} {count}'
                for reason, count in sorted(state.finished.items())
            ),
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{model_name="{config.served_model_name}"}} {state.prompt_tokens}',
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{model_name="{config.served_model_name}"}} {state.generation_tokens}',
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{config.served_model_name}"}} {state.inflight}',
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest) -> Response:
        try:
            prompt_ids = runner.encode_prompt(request.prompt)
        except ValueError as exc:
            return openai_error(400, str(exc))
        budget = check(request.model, request.n, request.max_tokens, len(prompt_ids))
        if isinstance(budget, JSONResponse):
            return budget
        return await answer(make_job(request, prompt_ids, budget, chat=False, top_logprobs=request.logprobs))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        try:
            prompt_ids = await asyncio.to_thread(render_prompt, runner.tokenizer, request)
        except (ChatError, ValueError) as exc:
            return openai_error(400, str(exc))
        mode = request.tool_mode()
        name = request.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        if mode == "required":
            names = tool_names(request)
            name = names[0]
            if len(names) > 1:
                opening = runner.encode_prompt(forced_prefix(request))
                options = [runner.encode_prompt(n + ARGUMENTS_OPENING) for n in names]
                pick = await asyncio.to_thread(
                    runner.choose, prompt_ids + opening, options, temperature=request.temperature, seed=request.seed
                )
                name = names[pick]
        prefix = forced_prefix(request, name)
        if prefix:
            prompt_ids = prompt_ids + runner.encode_prompt(prefix)
        budget = check(request.model, request.n, request.limit(), len(prompt_ids))
        if isinstance(budget, JSONResponse):
            return budget
        job = make_job(
            request,
            prompt_ids,
            budget,
            chat=True,
            top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            tool_mode=mode,
            prefix=prefix,
            tool_name=name,
        )
        return await answer(job)

    @app.post("/pause")
    async def pause(
        wait_for_inflight_requests: bool = Query(True), timeout_s: float = Query(60.0, gt=0)
    ) -> dict[str, Any]:
        state.running.clear()
        state.paused_at = state.paused_at or time.monotonic()
        if wait_for_inflight_requests:
            try:
                await state.drain(timeout_s)
            except TimeoutError:
                return {"status": "paused", "drained": False, "inflight": state.inflight}
        return {"status": "paused", "drained": state.inflight == 0, "inflight": state.inflight}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        paused_ms = (time.monotonic() - state.paused_at) * 1000 if state.paused_at else 0.0
        state.paused_at = None
        state.running.set()
        return {"status": "resumed", "paused_ms": paused_ms}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": not state.running.is_set()}

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=0, le=2)) -> Response:
        state.sleeping_level = max(level, 1)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up() -> Response:
        state.sleeping_level = 0
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": state.sleeping_level > 0}

    @app.post("/collective_rpc", response_model=None)
    async def collective_rpc(rpc: RpcRequest) -> dict[str, Any] | JSONResponse:
        try:
            if rpc.method == "undertow_weight_info":
                result: Any = updater.info().model_dump()
            elif rpc.method == "undertow_prefetch":
                request = PrefetchRequest(**rpc.kwargs)
                result = await on_weights_thread(lambda: updater.prefetch(request))
            elif rpc.method == "undertow_apply":
                if state.running.is_set() or state.inflight:
                    return openai_error(
                        409, "pause the engine (POST /pause?wait_for_inflight_requests=true) before applying weights"
                    )
                applying = ApplyRequest(**rpc.kwargs)
                result = (await on_weights_thread(lambda: updater.apply(applying))).model_dump()
                weights_thread.submit(updater.settle)  # after the answer: the pause ends without it
            elif rpc.method == "undertow_discard":
                await on_weights_thread(updater.discard)
                result = updater.info().model_dump()
            else:
                return openai_error(
                    400, f"unknown method {rpc.method!r}; this engine answers {list(updater.methods())}"
                )
        except (ValueError, KeyError, FileNotFoundError) as exc:
            log.warning("engine.rpc_failed", method=rpc.method, error=str(exc))
            return openai_error(422, f"{rpc.method} failed: {exc}", "WeightUpdateError")
        return {"results": [result]}

    return app


def serve(
    checkpoint: str,
    version: str,
    store_url: str | None,
    config: EngineConfig,
    *,
    public_key: Path | None,
    control_token: SecretStr | None,
) -> None:
    """Load ``checkpoint`` as ``version`` and serve the engine contract until interrupted; versions pulled
    from ``store_url`` must be signed by a key in ``public_key``, control calls carry ``control_token``."""
    import uvicorn

    runner = ModelRunner(checkpoint, threads=config.threads)
    updater = WeightUpdater.for_runner(runner, version=version, store_url=store_url, public_key=public_key)
    app = create_engine_app(runner, updater, config, control_token)
    if control_token is None:
        log.warning("engine.control_closed", reason="no serving.fleet.control_token: every control call is refused")
    if config.reserve_update_memory and retain_freed_memory():
        touched = app.state.weights_thread.submit(reserve, updater.state.nbytes).result()
        log.info("engine.update_memory_reserved", mb=touched >> 20)
    app.state.weights_thread.submit(updater.warm_up).result()
    log.info("engine.ready", host=config.host, port=config.port, version=version, hash=updater.hash)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
