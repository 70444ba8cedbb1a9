"""Agent-session turns on the wire: ``payload.turn`` is validated on both decoding paths and kept
in ``sessions.extra`` with the conversation and tool calls, on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from ingest_helpers import raw, session_event
from sqlalchemy import select

from ingest.db import transaction
from ingest.fastpath import fast_parse
from ingest.schemas import InvalidEvent, parse_event
from ingest.tables import SessionRow
from ingest.writer import write_events


def turn_event(i: int, turn: dict[str, Any], **prompt_extra: Any) -> dict[str, Any]:
    event = session_event(i, session_id=f"{turn['session_id']}.t{turn['index']}")
    event["payload"]["turn"] = turn
    event["payload"]["prompt"].update(prompt_extra)
    return event


def test_turns_are_stored_with_their_session_and_conversation(engine: Any) -> None:
    plain = turn_event(1, {"session_id": "agent-9", "index": 0})
    assert fast_parse(raw(plain)) is not None, "a turn without unknown fields takes the fast path"
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "run_tests"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 failed"},
    ]
    chat = turn_event(2, {"session_id": "agent-9", "index": 1}, messages=messages)
    chat["payload"]["segments"][0]["tool_calls"] = [{"id": "c2", "function": {"name": "submit", "arguments": "{}"}}]
    with transaction(engine) as s:
        write_events(s, [parse_event(raw(plain)), parse_event(raw(chat))])
    with transaction(engine) as s:
        rows = {r.session_id: r.extra for r in s.execute(select(SessionRow)).scalars()}
    assert rows["agent-9.t0"]["turn"] == {"session_id": "agent-9", "index": 0}
    second = rows["agent-9.t1"]
    assert second["turn"] == {"session_id": "agent-9", "index": 1}
    assert second["prompt_extra"]["messages"] == messages
    assert second["segment_extra"][0]["tool_calls"][0]["function"]["name"] == "submit"


@pytest.mark.parametrize(
    "turn",
    [
        {"session_id": "", "index": 0},
        {"session_id": "s", "index": -1},
        {"index": 2},
        "s#2",
        {"session_id": "s" * 129, "index": 0},
    ],
)
def test_a_malformed_turn_is_refused_by_both_paths(turn: Any) -> None:
    event = session_event(3)
    event["payload"]["turn"] = copy.deepcopy(turn)
    body = json.dumps(event).encode()
    assert fast_parse(body) is None
    with pytest.raises(InvalidEvent):
        parse_event(body)
