"""What the gateway served, as telemetry: one ``session.completed`` per choice, linked into agent
sessions turn by turn.

An agent session is the run of chat requests a client marks with one id: the ``x-session-id``
header, a ``session_id`` field, or ``metadata.session_id``. Each request is a turn; its index is
the one the client gives (the ``x-turn-index`` header or ``metadata.turn_index``), else the number
of assistant messages already in the conversation, so a client that retries a turn gets the same
turn id (and ingest keeps the first). A client that compacts its context (a self-summary replaces
the history, so the count starts again) sends the index itself. A client running several
sessions on one task (parallel agents, a GRPO group) names the group (``x-session-group`` or
``metadata.session_group``); it is stored as ``payload.turn.group``. Turn ``n`` of session ``S`` is stored under
the session id ``S.t{n}`` (``S.t{n}-{k}`` for candidate ``k`` of a group) and carries
``payload.turn = {"session_id": S, "index": n}``. A signal may target the whole session (``S``)
or one turn (``S.t{n}``).

Each turn records exactly what the engine sampled: the prompt token ids the engine rendered
(tool outputs between turns are in them, and in ``prompt.messages`` as sent), the generated
token ids with their logprobs and routed experts, and the finish reason (``abort`` when the
client left mid-stream, with what had been served by then).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

SESSION_HEADER = "x-session-id"
TURN_HEADER = "x-turn-index"
GROUP_HEADER = "x-session-group"
MAX_TURN_INDEX = 1_000_000
"""A client's turn index is below this (a session of a million turns is a client's bug)."""
MAX_SESSION_ID = 100
"""Client session ids are at most this long, so turn ids fit the wire contract's 128."""


@dataclass
class Served:
    """One choice as it reached the client."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed_experts: str | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Request:
    """The request side of what was served: who, which session and turn, what the model saw."""

    model: str
    user: str | None
    sampling: dict[str, Any]
    client: str | None = None
    """The name of the key the request came with (None for a gateway without keys)."""
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    session: str | None = None
    """The client's agent-session id, if it sent one."""
    turn: int | None = None
    session_group: str | None = None
    """The client's name for the group of sessions this one belongs to (same task, compared)."""
    base_id: str = ""
    group_id: str | None = None
    version: str = "unknown"
    latency_ms: float = 0.0

    def session_id(self, index: int, k: int) -> str:
        """The stored session id of choice ``index`` of ``k``."""
        return self.base_id if k == 1 else f"{self.base_id}-{index}"


def explicit_turn(header: str | None, metadata: dict[str, Any] | None) -> int | None:
    """The turn index the client gave (header first, then ``metadata.turn_index``), or None.

    Raises ValueError with the reason for anything but an integer in ``[0, MAX_TURN_INDEX)``."""
    raw: Any = header if header is not None else (metadata or {}).get("turn_index")
    if raw is None:
        return None
    reason = f"a turn index is a whole number from 0 to {MAX_TURN_INDEX - 1}"
    if isinstance(raw, str):
        text = raw.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 7):
            raise ValueError(reason)
        raw = int(text)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < MAX_TURN_INDEX:
        raise ValueError(reason)
    return int(raw)


def session_group(header: str | None, metadata: dict[str, Any] | None) -> str | None:
    """The session group the client named (header first, then ``metadata.session_group``), or None.

    Raises ValueError for one that is empty, longer than :data:`MAX_SESSION_ID` or not a string."""
    raw: Any = header if header is not None else (metadata or {}).get("session_group")
    if raw is None:
        return None
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_SESSION_ID or "\x00" in raw:
        raise ValueError(f"a session group is a string of 1 to {MAX_SESSION_ID} characters")
    return raw


def link(
    session: str | None, messages: list[dict[str, Any]] | None, k: int, turn: int | None = None
) -> tuple[str, int | None, str | None]:
    """``(base session id, turn index, group id)`` of a request (``turn``: the client's index)."""
    group_id = f"grp-{uuid.uuid4().hex}" if k > 1 else None
    if session is None:
        return f"ses-{uuid.uuid4().hex}", None, group_id
    if messages is None:
        return session, None, group_id
    if turn is None:
        turn = sum(1 for m in messages if m.get("role") == "assistant")
    return f"{session}.t{turn}", turn, group_id


def conversation_text(messages: list[dict[str, Any]]) -> str:
    """The conversation as plain text (for text features; the token ids are authoritative)."""
    lines = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(f"{message.get('role')}: {content or ''}")
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            lines.append(f"{message.get('role')} calls {fn.get('name')}({fn.get('arguments', '')})")
    return "\n".join(lines)


def event(req: Request, choice: Served, k: int) -> dict[str, Any]:
    """The ``session.completed`` event of one served choice."""
    prompt: dict[str, Any] = {}
    if req.prompt_token_ids is not None:
        prompt["token_ids"] = req.prompt_token_ids
    if req.prompt_text is not None:
        prompt["text"] = req.prompt_text
    if req.messages is not None:
        prompt["messages"] = req.messages
    segment: dict[str, Any] = {"role": "assistant", "text": choice.text}
    if choice.token_ids:
        segment["token_ids"] = choice.token_ids
        if len(choice.logprobs) == len(choice.token_ids):
            segment["logprobs"] = choice.logprobs
    if choice.tool_calls:
        segment["tool_calls"] = choice.tool_calls
    payload: dict[str, Any] = {
        "model": req.model,
        "policy_version": req.version,
        "prompt": prompt,
        "segments": [segment],
        "sampling": {key: value for key, value in req.sampling.items() if value is not None},
        "finish_reason": choice.finish_reason or "abort",
        "latency_ms": req.latency_ms,
    }
    if choice.routed_experts:
        payload["routed_experts"] = choice.routed_experts
    if req.group_id:
        payload["group_id"], payload["candidate_index"] = req.group_id, choice.index
    if req.session is not None and req.turn is not None:
        payload["turn"] = {"session_id": req.session, "index": req.turn}
        if req.session_group is not None:
            payload["turn"]["group"] = req.session_group
    out: dict[str, Any] = {
        "schema_version": 1,
        "event_id": str(uuid.uuid4()),
        "type": "session.completed",
        "occurred_at": datetime.now(UTC).isoformat(),
        "session_id": req.session_id(choice.index, k),
        "payload": payload,
    }
    if req.user:
        out["user_id"] = req.user
    return out
