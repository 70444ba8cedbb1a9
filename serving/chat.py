"""Chat on the CPU engine: conversations rendered by the checkpoint's own chat template, tool calls
read back the way vLLM's ``hermes`` tool-call parser reads them, and ``tool_choice`` honoured.

- :func:`render_prompt` turns the request's messages (and tools) into prompt token ids with
  ``apply_chat_template``, the template saved in the checkpoint (``policy.chat_template``), so
  ``vllm serve`` renders the same ids.
- :func:`parse_tool_calls` finds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks in generated text; text before the first block is the message content. A block that is
  not a JSON object with a ``name`` leaves the whole text as content (as vLLM does).
- ``tool_choice`` ``required`` or a named function: the engine opens the tool call for the model
  (a forced prefix up to ``"arguments":``, the CPU engine's stand-in for vLLM's structured outputs). The prefix belongs
  to the prompt the model continues from, so telemetry's token ids and logprobs stay exactly the
  sampled ones. With several tools under ``required``, the name is drawn from the model's own
  probabilities of each tool's name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from policy.chat_template import TOOL_CALL_END, TOOL_CALL_START, read_tool_calls
from serving.protocol import ChatCompletionRequest, FunctionCall, ToolCall


class ChatError(ValueError):
    """A conversation this engine cannot render (no chat template, too long, ...)."""


def message_dicts(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (content as one string)."""
    out: list[dict[str, Any]] = []
    for message in request.messages:
        item: dict[str, Any] = {"role": message.role, "content": None if message.content is None else message.text()}
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        if message.name:
            item["name"] = message.name
        out.append(item)
    return out


def render_prompt(tokenizer: Any, request: ChatCompletionRequest) -> list[int]:
    """Prompt token ids of the conversation, ending with an open assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(
            "this checkpoint's tokenizer has no chat template; serve a checkpoint saved by this version "
            "of Undertow, or use /v1/completions"
        )
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []] or None
    rendered = tokenizer.apply_chat_template(
        message_dicts(request), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(t) for t in rendered["input_ids"]]


ARGUMENTS_OPENING = '", "arguments":'
"""Where a forced prefix stops: before the space the template puts ahead of the arguments, so the
model writes `` {...`` and the tokens match the template's rendering of the call next turn (a
byte-level tokenizer starts a word at that space)."""


def forced_prefix(request: ChatCompletionRequest, name: str | None = None) -> str:
    """The text that opens a tool call when ``tool_choice`` demands one ('' otherwise)."""
    mode = request.tool_mode()
    if mode not in ("named", "required"):
        return ""
    if mode == "named":
        name = request.tool_choice.function.name  # type: ignore[union-attr]
    if name is None:
        return TOOL_CALL_START + '\n{"name": "'
    return TOOL_CALL_START + '\n{"name": "' + name + ARGUMENTS_OPENING


def tool_names(request: ChatCompletionRequest) -> list[str]:
    """The names of the request's tools."""
    return [tool.function.name for tool in request.tools or []]


@dataclass
class Reply:
    """An assistant message read from generated text."""

    content: str | None
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str) -> Reply:
    """Content and tool calls of generated text (hermes format, :func:`policy.chat_template.read_tool_calls`)."""
    content, calls = read_tool_calls(text)
    return Reply(
        content,
        [
            ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in calls
        ],
    )


def malformed_tool_call(content: str | None) -> bool:
    """Whether an answer tried to call a tool and wrote what no parser could read: the tool-call markup
    left in its content (:func:`parse_tool_calls` leaves a block that is not a JSON object with a
    ``name`` there, as vLLM's tool parsers do). A policy gone wrong (the gate drill's destructive
    update) opens calls it cannot finish on every other turn; a healthy one almost never."""
    return bool(content) and TOOL_CALL_START in str(content)


def forced_reply(prefix: str, generated: str, name: str) -> Reply:
    """The reply when the engine opened the call: parsed if the model closed it properly, else the
    generated text, up to the closing tag, as the arguments of a call to ``name``."""
    reply = parse_tool_calls(prefix + generated)
    if reply.tool_calls:
        return Reply(None, reply.tool_calls)
    rest = generated.split(TOOL_CALL_END, 1)[0].strip()
    if prefix.endswith('"name": "'):
        rest = rest.split('", "arguments": ', 1)[-1] if '", "arguments": ' in rest else "{}"
    if rest.endswith("}") and rest.count("{") < rest.count("}"):
        rest = rest[:-1].rstrip()
    return Reply(
        None,
        [ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=FunctionCall(name=name, arguments=rest or "{}"))],
    )


def held_suffix(text: str, markers: list[str]) -> int:
    """How many trailing characters of ``text`` to hold back while streaming: the longest tail that
    could still grow into one of ``markers`` (a stop string, the tool-call tag), and a trailing
    replacement character (a multi-byte character split across tokens)."""
    hold = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                hold = max(hold, size)
                break
    while hold < len(text) and text[len(text) - hold - 1 : len(text) - hold] == "\ufffd":
        hold += 1
    return hold
