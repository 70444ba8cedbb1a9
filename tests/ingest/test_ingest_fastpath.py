"""The msgspec fast path never accepts what the pydantic contract refuses, and stores the same rows.

Valid events (every type, with and without the optional parts) and events mutated at a random
place (a hostile value, a deleted field, an unknown field, a list grown or shrunk) go through both
validators. Wherever the fast path accepts, pydantic must accept too and both must give the same
database rows; wherever the fast path refuses, pydantic alone decides (that only costs speed).
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ingest_helpers import raw, session_event, signal_event
from test_ingest_schemas import BAD_SESSIONS, VALID_SIGNALS

from ingest import fastpath, schemas
from ingest.arrays import npy_to_b64
from ingest.schemas import InvalidEvent, parse_event
from ingest.writer import session_rows, signal_row

NOW = datetime(2025, 1, 7, tzinfo=UTC)


def _sessions() -> list[dict[str, Any]]:
    plain = session_event(1)
    full = copy.deepcopy(session_event(2))
    full["payload"].update(
        group_id="g-1",
        candidate_index=0,
        routed_experts=npy_to_b64(np.arange(24, dtype=np.int32).reshape(2, 3, 4)),
        sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "seed": 3, "logprobs_mode": "processed"},
        finish_reason="stop",
        latency_ms=12.5,
        files=[{"path": "a.py", "lines_added": 3, "lines_removed": 1}],
    )
    text_only = copy.deepcopy(session_event(3, occurred_at="2025-01-06 12:00:00.5-08:00"))
    text_only["payload"]["prompt"] = {"text": "hi"}
    return [plain, full, text_only]


BASES: list[dict[str, Any]] = _sessions() + [
    signal_event(f"ev-{i}", kind, sid, payload) for i, (kind, sid, payload) in enumerate(VALID_SIGNALS)
]


def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A row with JSON text columns parsed (field order and spacing may differ between the paths)."""
    return {k: json.loads(str(v)) if k in ("payload", "extra") else v for k, v in row.items()}


def _rows(event: Any) -> Any:
    if event.type == schemas.SESSION_COMPLETED:
        row, segments = session_rows(event, NOW)
        return _comparable(row), segments
    return _comparable(signal_row(event, NOW))


def _check(message: bytes) -> bool:
    """Both validators on one message; returns whether the fast path accepted it."""
    fast = fastpath.fast_parse(message)
    try:
        slow: Any = parse_event(message)
    except InvalidEvent as exc:
        assert fast is None, f"the fast path accepted what the contract refuses ({exc.reason}: {exc.detail})"
        return False
    if fast is not None:
        assert fast.event_id == slow.event_id and fast.type == slow.type
        assert _rows(fast) == _rows(slow)
    return fast is not None


@pytest.mark.parametrize("event", BASES, ids=[f"{b['type']}-{i}" for i, b in enumerate(BASES)])
def test_fast_path_accepts_valid_events_with_the_same_rows(event: dict[str, Any]) -> None:
    assert _check(raw(event))


@pytest.mark.parametrize("case", BAD_SESSIONS, ids=[b[0] for b in BAD_SESSIONS])
def test_fast_path_refuses_every_known_bad_session(case: Any) -> None:
    _, mutate, _ = case
    ev = copy.deepcopy(session_event(1))
    mutate(ev)
    assert fastpath.fast_parse(raw(ev)) is None


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in an event: object keys and list positions, containers included."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:3]):
            out += _paths(value, (*prefix, i))
    return out


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2, 2**31 - 1, 2**31, 2**63, 2**64, -(2**63) - 1, 0.0, 1.0, -0.5, 1e400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "",
            "x" * 32,
            "x" * 33,
            "x" * 128,
            "x" * 129,
            "é" * 128,
            "2025-01-06T12:00:00Z",
            "2025-01-06t12:00:00z",
            "2025-01-06T12:00Z",
            "2025-01-06T12:00:00+0100",
            "2025-01-06T12:00:00.123456789Z",
            "2025-02-29T12:00:00Z",
            "1736164800",
            "raw",
            "processed",
            "assistant",
            "user",
            "%%%",
        ]
    ),
    st.lists(st.integers(min_value=-2, max_value=2**31), max_size=8),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=8),
    st.lists(st.sampled_from(["s1", "s2", "s1", ""]), max_size=4),
    st.dictionaries(st.sampled_from(["text", "token_ids", "role", "x"]), st.sampled_from(["a", 1, None]), max_size=3),
)
_DELETE = object()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(BASES), data=st.data())
def test_fast_path_never_accepts_what_the_contract_refuses(base: dict[str, Any], data: st.DataObject) -> None:
    ev = copy.deepcopy(base)
    for _ in range(data.draw(st.integers(min_value=1, max_value=2))):
        path = data.draw(st.sampled_from(_paths(ev)))
        *parents, last = path
        node: Any = ev
        for part in parents:
            node = node[part]
        action = data.draw(st.sampled_from(["set", "set", "delete", "extra", "grow", "shrink"]))
        target = node[last]
        if action == "set":
            node[last] = data.draw(HOSTILE)
        elif action == "delete":
            del node[last]
        elif action == "extra" and isinstance(target, dict):
            target[data.draw(st.sampled_from(["extra", "type", "logprobs", "group_id"]))] = data.draw(HOSTILE)
        elif action == "grow" and isinstance(target, list):
            target.append(copy.deepcopy(target[0]) if target else data.draw(HOSTILE))
        elif action == "shrink" and isinstance(target, list) and target:
            target.pop()
    _check(json.dumps(ev).encode())
