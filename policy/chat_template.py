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
after parsing); both render as the same JSON text.
"""

from __future__ import annotations

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
