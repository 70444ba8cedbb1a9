"""The engine HTTP contract: the subset of vLLM 0.33's OpenAI server that Undertow needs.

Producer: an engine (the CPU reference engine in :mod:`serving.engine`, or ``vllm serve`` with
the flags in ``docs/serving.md``). Consumer: :class:`serving.client.EngineClient` (gateway,
deployer, health checks). Field names are vLLM's, so the same client talks to both.

Undertow's weight methods travel over vLLM's dev-mode ``POST /collective_rpc`` and are methods
of the worker extension (:mod:`serving.vllm_ext`); the CPU engine answers the same RPCs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

WEIGHT_RPC_METHODS = ("undertow_weight_info", "undertow_prefetch", "undertow_apply", "undertow_discard")
"""RPC methods of the worker extension (and of the CPU engine), called through ``/collective_rpc``."""


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body (OpenAI fields plus vLLM's ``return_token_ids``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] = Field(..., description="Prompt text, or prompt token ids.")
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    return_token_ids: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt is empty: send prompt text or at least one token id")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("streaming is not supported by this endpoint; send stream=false")
        return value

    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs block (one entry per generated token)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One sample. ``routed_experts`` is base64 ``.npy`` ``[num_tokens - 1, layers, top_k]``."""

    model_config = ConfigDict(extra="allow")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None


class Usage(BaseModel):
    """Token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` answer. The CPU engine puts the weights version in ``system_fingerprint``."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class RpcRequest(BaseModel):  # type: ignore[no-redef]
    """``POST /collective_rpc`` body, as vLLM's dev-mode server takes it."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


class WeightInfo(BaseModel):
    """What a replica serves: ``undertow_weight_info`` RPC result."""

    version: str
    hash: str
    staged: str | None = None
    """Version whose delta or snapshot is pulled and waiting to be applied, if any."""


class ApplyResult(WeightInfo):
    """``undertow_apply`` RPC result: what the replica serves now, and how the switch went."""

    kind: str = ""
    """``delta``, ``snapshot`` or ``undo``: what was applied."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds per phase of the apply (``check``, ``write``, ``readback``), measured in the engine."""


class PrefetchRequest(BaseModel):
    """``undertow_prefetch`` kwargs: pull what moves ``from_version`` to ``to_version`` before pausing."""

    to_version: str
    from_version: str | None = None
    """The version the replica serves now; None or different from it pulls the full snapshot."""
    kind: Literal["auto", "delta", "snapshot"] = "auto"
    """``delta`` requires a delta path; ``snapshot`` forces the full snapshot (the baseline)."""


class ApplyRequest(BaseModel):
    """``undertow_apply`` kwargs: apply the staged update and switch only if the hash matches."""

    to_version: str
    expected_hash: str
