"""The engine HTTP contract: the subset of vLLM 0.33's OpenAI server that Undertow needs.

Producer: an engine (the CPU reference engine in :mod:`serving.engine`, or ``vllm serve`` with
the flags in ``docs/serving.md``). Consumer: :class:`serving.client.EngineClient` (gateway,
deployer, health checks). Field names are vLLM's, so the same client talks to both.

Undertow's weight methods travel over vLLM's dev-mode ``POST /collective_rpc`` and are methods
of the worker extension (:mod:`serving.vllm_ext`); the CPU engine answers the same RPCs.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

WEIGHT_RPC_METHODS = ("undertow_weight_info", "undertow_prefetch", "undertow_apply", "undertow_discard")
"""RPC methods of the worker extension (and of the CPU engine), called through ``/collective_rpc``."""


@dataclass
class SamplingParams:
    """How to sample, whatever the endpoint: what :class:`serving.runner.ModelRunner` takes."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = dc_field(default_factory=list)
    stop_token_ids: list[int] = dc_field(default_factory=list)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SampledRequest(BaseModel):
    """What every generation request shares: sampling, stops, streaming, vLLM's ``return_token_ids``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False

    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_tokens: int) -> SamplingParams:
        """What the runner samples with."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            n=self.n,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
        )


class CompletionRequest(SampledRequest):
    """``POST /v1/completions`` body (OpenAI fields plus vLLM's ``return_token_ids``)."""

    prompt: str | list[int] = Field(..., description="Prompt text, or prompt token ids.")
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt is empty: send prompt text or at least one token id")
        return value


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
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
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


ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(BaseModel):
    """A tool call's function: its name and its arguments as a JSON string (OpenAI's wire form)."""

    name: str = Field(min_length=1, max_length=64)
    arguments: str = "{}"


class ToolCall(BaseModel):
    """One tool call an assistant message made."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    """A content part; only text parts are served (the policy reads no images)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation, with the role rules OpenAI and vLLM apply."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=128)

    @model_validator(mode="after")
    def _rules(self) -> ChatMessage:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; use one of {', '.join(ROLES)}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    """A tool's function: name, description and JSON-schema parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    class Name(BaseModel):
        name: str

    type: Literal["function"] = "function"
    function: Name


class ChatCompletionRequest(SampledRequest):
    """``POST /v1/chat/completions`` body: OpenAI's fields plus vLLM's ``return_token_ids``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the unknown tool {choice.function.name!r}; tools are: {', '.join(names) or 'none'}"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def limit(self) -> int | None:
        """The completion budget asked for (``max_completion_tokens`` wins, as in OpenAI's API)."""
        return self.max_completion_tokens or self.max_tokens

    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or the named function (tools given), else ``none``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


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
