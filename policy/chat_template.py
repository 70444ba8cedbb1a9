"""The chat template the policy's checkpoints ship: ChatML turns with Hermes-style tool calls.

It lives in each checkpoint's ``tokenizer_config.json``, so ``transformers``'
``apply_chat_template`` (the CPU engine) and ``vllm serve`` render a conversation to the same
tokens. The format:

- every message is a turn ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
- with ``tools``, the system turn lists them, one JSON object per line, inside ``<tools>``;
- an assistant's tool calls follow its content, each as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (what vLLM's ``hermes``
  tool-call parser reads);
- a tool's result is a ``tool`` turn wrapping the content in ``<tool_response>``;
- ``add_generation_prompt`` opens an assistant turn.

``arguments`` may arrive as a JSON string (OpenAI's wire form) or as an object (what vLLM passes
after parsing); both render as the same JSON text. :func:`read_tool_calls` reads generated text
back the way vLLM's ``hermes`` parser does (the CPU engine and the in-process agent evaluator use
it).
"""

from __future__ import annotations

import json
import re

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

TOOLS_PREAMBLE = "# Tools\n<tools>\n"
TOOLS_INSTRUCTION = '</tools>\nCall one as <tool_call>\n{"name": <name>, "arguments": <JSON object>}\n</tool_call>'


def _literal(text: str) -> str:
    """``text`` as a Jinja string expression (whitespace control never trims inside it)."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return "{{ '" + escaped + "' }}"


NL = _literal("\n")

CHAT_TEMPLATE = "".join(
    [
        "{%- macro text(content) -%}",
        "{%- if content is none -%}{%- elif content is string -%}{{ content }}",
        "{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}",
        "{%- endfor -%}{%- endif -%}",
        "{%- endmacro -%}",
        "{%- set system = messages[0] if messages and messages[0].role in ['system', 'developer'] else none -%}",
        "{%- if tools -%}",
        _literal(IM_START + "system\n"),
        "{%- if system is not none -%}{{ text(system.content) }}",
        _literal("\n\n"),
        "{%- endif -%}",
        _literal(TOOLS_PREAMBLE),
        "{%- for tool in tools -%}{{ (tool.function if tool.function is defined else tool) | tojson }}",
        NL,
        "{%- endfor -%}",
        _literal(TOOLS_INSTRUCTION + IM_END + "\n"),
        "{%- elif system is not none -%}",
        _literal(IM_START + "system\n"),
        "{{ text(system.content) }}",
        _literal(IM_END + "\n"),
        "{%- endif -%}",
        "{%- for message in messages -%}",
        "{%- if loop.first and system is not none -%}",
        "{%- elif message.role == 'assistant' -%}",
        _literal(IM_START + "assistant\n"),
        "{{ text(message.content) }}",
        "{%- for call in message.tool_calls or [] -%}",
        "{%- set fn = call.function if call.function is defined else call -%}",
        "{%- if message.content or not loop.first -%}",
        NL,
        "{%- endif -%}",
        _literal(TOOL_CALL_START + '\n{"name": "'),
        "{{ fn.name }}",
        _literal('", "arguments": '),
        "{%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}",
        _literal("}\n" + TOOL_CALL_END),
        "{%- endfor -%}",
        _literal(IM_END + "\n"),
        "{%- elif message.role == 'tool' -%}",
        _literal(IM_START + "tool\n<tool_response>\n"),
        "{{ text(message.content) }}",
        _literal("\n</tool_response>" + IM_END + "\n"),
        "{%- else -%}",
        _literal(IM_START),
        "{{ message.role }}",
        NL,
        "{{ text(message.content) }}",
        _literal(IM_END + "\n"),
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        _literal(IM_START + "assistant\n"),
        "{%- endif -%}",
    ]
)
"""Jinja source, rendered by ``transformers`` and by vLLM alike."""


_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)


def _call(raw: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(raw.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def read_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``(content, [(name, arguments as JSON text), ...])`` of generated text.

    Text before the first ``<tool_call>`` is the content (None when empty). A block that is not a
    JSON object with a ``name`` leaves the whole text as content and no calls (as vLLM does)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = [_call(match.group(1)) for match in _BLOCK.finditer(text, start)]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:start].rstrip() or None, [c for c in calls if c is not None]
