"""The wire contract: every type accepted, every rule enforced with its machine-readable reason."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ingest_helpers import raw, session_event, signal_event

from ingest import schemas
from ingest.arrays import npy_to_b64
from ingest.schemas import InvalidEvent, parse_event

VALID_SIGNALS: list[tuple[str, str | None, dict[str, Any]]] = [
    ("candidates.shown", "s1", {"group_id": "g", "session_ids": ["s1", "s2"]}),
    ("candidate.selected", "s1", {"group_id": "g", "chosen_session_id": "s2"}),
    ("edit.accepted", "s1", {"edit_id": "e", "lines": 3}),
    ("edit.rejected", "s1", {}),
    ("code.retained", "s1", {"horizon_s": 3600, "lines_written": 5, "lines_retained": 5, "final_text": "x = 1\n"}),
    ("code.retained", "s1", {"horizon_s": 1, "lines_written": 0, "lines_retained": 0}),
    ("model.switched", "s1", {"from_model": "a", "to_model": "b"}),
    ("feedback.thumbs", "s1", {"value": 1}),
    ("feedback.thumbs", "s1", {"value": -1}),
    ("user.churned", None, {"inactive_days": 30}),
    ("user.churned", "s1", {"inactive_days": 0}),
]


@pytest.mark.parametrize(("kind", "session_id", "payload"), VALID_SIGNALS)
def test_every_signal_type_is_accepted(kind: str, session_id: str | None, payload: dict[str, Any]) -> None:
    event = parse_event(raw(signal_event("ev-1", kind, session_id, payload)))
    assert event.type == kind
    assert event.session_id == session_id
    assert event.payload.model_dump(exclude_none=True) == payload


def test_session_completed_round_trip_keeps_unknown_fields() -> None:
    ev = session_event(1)
    ev["payload"]["future_field"] = {"nested": [1, 2]}
    ev["payload"]["segments"][0]["annotation"] = "kept"
    ev["payload"]["routed_experts"] = npy_to_b64(np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    ev["payload"]["sampling"] = {"temperature": 0.7, "logprobs_mode": "processed", "new_knob": True}
    ev["unknown_envelope_field"] = 1
    event = parse_event(raw(ev))
    assert isinstance(event, schemas.SessionCompleted)
    assert event.payload.model_extra == {"future_field": {"nested": [1, 2]}}
    assert event.payload.segments[0].model_extra == {"annotation": "kept"}
    assert event.payload.sampling is not None and event.payload.sampling.model_extra == {"new_knob": True}
    again = parse_event(schemas.encode_event(event))
    assert again == event
    logprobs = ev["payload"]["segments"][0]["logprobs"]
    assert again.payload.segments[0].logprobs == logprobs  # bit-exact floats


def test_timestamps_keep_their_offset() -> None:
    for stamp in ("2025-01-06T12:00:00Z", "2025-01-06T12:00:00.123456+05:30", "2025-01-06t12:00:00-08:00"):
        event = parse_event(raw(session_event(1, occurred_at=stamp)))
        assert event.occurred_at.utcoffset() is not None


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(ev: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = ev
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return apply


_DELETE = object()
SEG = "payload.segments.0"

BAD_SESSIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("schema v2", _set("schema_version", 2), "unsupported_schema_version"),
    ("schema v99", _set("schema_version", 99), "unsupported_schema_version"),
    ("schema v0", _set("schema_version", 0), "validation_error"),
    ("schema as string", _set("schema_version", "1"), "validation_error"),
    ("unknown type", _set("type", "session.started"), "unknown_type"),
    ("type not a string", _set("type", 5), "validation_error"),
    ("no type", _set("type", _DELETE), "validation_error"),
    ("no event_id", _set("event_id", _DELETE), "validation_error"),
    ("empty event_id", _set("event_id", ""), "validation_error"),
    ("event_id 129 chars", _set("event_id", "e" * 129), "validation_error"),
    ("event_id a number", _set("event_id", 12), "validation_error"),
    ("no session_id", _set("session_id", _DELETE), "validation_error"),
    ("session_id 129 chars", _set("session_id", "s" * 129), "validation_error"),
    ("user_id empty", _set("user_id", ""), "validation_error"),
    ("naive timestamp", _set("occurred_at", "2025-01-06T12:00:00"), "validation_error"),
    ("date only", _set("occurred_at", "2025-01-06"), "validation_error"),
    ("epoch seconds", _set("occurred_at", 1736164800), "validation_error"),
    ("impossible date", _set("occurred_at", "2025-02-30T12:00:00Z"), "validation_error"),
    ("payload not an object", _set("payload", []), "validation_error"),
    ("no model", _set("payload.model", _DELETE), "validation_error"),
    ("no policy_version", _set("payload.policy_version", _DELETE), "validation_error"),
    ("empty prompt", _set("payload.prompt", {}), "validation_error"),
    ("no segments", _set("payload.segments", []), "validation_error"),
    ("bad role", _set(f"{SEG}.role", "robot"), "validation_error"),
    ("logprobs too short", _set(f"{SEG}.logprobs", [-0.5]), "logprobs_length_mismatch"),
    ("logprobs without ids", _set(f"{SEG}.token_ids", _DELETE), "logprobs_length_mismatch"),
    ("logprob as string", _set(f"{SEG}.logprobs", ["-1"] * 6), "validation_error"),
    ("token id negative", _set(f"{SEG}.token_ids", [-1] * 6), "validation_error"),
    ("token id past int32", _set(f"{SEG}.token_ids", [2**31] * 6), "validation_error"),
    ("token id float", _set(f"{SEG}.token_ids", [1.5] * 6), "validation_error"),
    ("token id bool", _set(f"{SEG}.token_ids", [True] * 6), "validation_error"),
    ("experts not base64", _set("payload.routed_experts", "%%%"), "validation_error"),
    ("experts not npy", _set("payload.routed_experts", "aGVsbG8gd29ybGQ="), "validation_error"),
    ("experts float", _set("payload.routed_experts", npy_to_b64(np.zeros((2, 2, 2)))), "validation_error"),
    ("experts rank 2", _set("payload.routed_experts", npy_to_b64(np.zeros((2, 2), np.int32))), "validation_error"),
    ("candidate without group", _set("payload.candidate_index", 1), "validation_error"),
    ("bad logprobs_mode", _set("payload.sampling", {"logprobs_mode": "maybe"}), "validation_error"),
    ("negative latency", _set("payload.latency_ms", -1), "validation_error"),
    (
        "file lines negative",
        _set("payload.files", [{"path": "a", "lines_added": -1, "lines_removed": 0}]),
        "validation_error",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "reason"), BAD_SESSIONS, ids=[b[0] for b in BAD_SESSIONS])
def test_bad_session_events_get_their_reason(name: str, mutate: Callable[[dict[str, Any]], None], reason: str) -> None:
    ev = copy.deepcopy(session_event(1))
    mutate(ev)
    with pytest.raises(InvalidEvent) as info:
        parse_event(raw(ev))
    assert info.value.reason == reason, info.value.detail
    assert info.value.detail


def test_logprobs_only_on_assistant_segments() -> None:
    ev = session_event(1)
    ev["payload"]["segments"].insert(0, {"role": "user", "text": "hi", "token_ids": [1], "logprobs": [-0.1]})
    with pytest.raises(InvalidEvent, match="assistant") as info:
        parse_event(raw(ev))
    assert info.value.reason == "validation_error"


BAD_SIGNALS: list[tuple[str, str | None, dict[str, Any]]] = [
    ("candidates.shown", "s", {"group_id": "g", "session_ids": ["only-one"]}),
    ("candidates.shown", "s", {"group_id": "g", "session_ids": ["a", "a"]}),
    ("candidates.shown", "s", {"session_ids": ["a", "b"]}),
    ("candidate.selected", "s", {"group_id": "g"}),
    ("edit.accepted", "s", {"lines": -2}),
    ("code.retained", "s", {"horizon_s": 0, "lines_written": 1, "lines_retained": 1}),
    ("code.retained", "s", {"horizon_s": 300, "lines_written": 2, "lines_retained": 3}),
    ("code.retained", "s", {"horizon_s": 300, "lines_written": -1, "lines_retained": 0}),
    ("code.retained", "s", {"horizon_s": 300.5, "lines_written": 2, "lines_retained": 1}),
    ("code.retained", "s", {"horizon_s": 2**40, "lines_written": 2, "lines_retained": 1}),
    ("model.switched", "s", {"from_model": "a"}),
    ("feedback.thumbs", "s", {"value": 0}),
    ("feedback.thumbs", "s", {"value": True}),
    ("feedback.thumbs", "s", {"value": "1"}),
    ("feedback.thumbs", None, {"value": 1}),
    ("user.churned", None, {"inactive_days": -1}),
]


@pytest.mark.parametrize(("kind", "session_id", "payload"), BAD_SIGNALS)
def test_bad_signals_are_validation_errors(kind: str, session_id: str | None, payload: dict[str, Any]) -> None:
    with pytest.raises(InvalidEvent) as info:
        parse_event(raw(signal_event("ev", kind, session_id, payload)))
    assert info.value.reason == "validation_error"
    assert info.value.event_id == "ev"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "invalid_json"),
        (b"{", "invalid_json"),
        (b"\xff\xfe{}", "invalid_json"),
        (b'{"a": 1} trailing', "invalid_json"),
        (b"[" * 50_000 + b"]" * 50_000, "invalid_json"),
        (b"null", "validation_error"),
        (b"42", "validation_error"),
        (b'"text"', "validation_error"),
        (b"{}", "validation_error"),
    ],
)
def test_not_an_event_at_all(value: bytes, reason: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        parse_event(value)
    assert info.value.reason == reason


def test_oversized_is_checked_before_parsing() -> None:
    body = raw(session_event(1))
    assert parse_event(body, max_bytes=len(body)).event_id
    with pytest.raises(InvalidEvent) as info:
        parse_event(body, max_bytes=len(body) - 1)
    assert info.value.reason == "oversized"
    with pytest.raises(InvalidEvent) as info:
        parse_event(b"{" + b" " * (1 << 20) + b"}")
    assert info.value.reason == "oversized"


def test_producer_side_validation_and_encoding() -> None:
    model = schemas.validate_event(session_event(3))
    assert schemas.validate_event(model) is model
    encoded = json.loads(schemas.encode_event(session_event(3)))
    assert encoded["occurred_at"].endswith("Z")
    with pytest.raises(InvalidEvent):
        schemas.validate_event({**session_event(3), "type": "nope"})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        parse_event(data)
    except InvalidEvent as exc:
        assert exc.reason in schemas.REASONS


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(schemas.EVENT_TYPES), _json)
def test_arbitrary_payloads_are_accepted_or_dead_lettered(kind: str, payload: Any) -> None:
    try:
        event = parse_event(raw(signal_event("ev", kind, "s", payload)))
    except InvalidEvent as exc:
        assert exc.reason in schemas.REASONS
    else:
        assert event.type == kind
