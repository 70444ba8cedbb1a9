"""The telemetry wire contract, version 1 (CONTRACTS.md section 1), as pydantic models.

Producers (serving's gateway, users' editors, :mod:`ingest.producer`) write these events; the
consumer (:mod:`ingest.consumer`) reads them with :func:`parse_event`, which either returns a typed
event or raises :class:`InvalidEvent` carrying a machine-readable ``reason`` for the dead-letter
store. Unknown payload fields are kept (``extra="allow"``); unknown envelope fields are ignored.

Validation is strict (JSON types are not coerced: ``"3"`` is not an int, ``true`` is not ``1``).
The consumer tries :mod:`ingest.fastpath` (msgspec, a mirror of these models) first; a message it
refuses is validated here in one pass by pydantic-core, and only one that fails is re-examined to
find the precise reason.

Identifiers (``Id``: event, session, user, group ids, model names) and ``finish_reason`` may not
contain NUL (U+0000): databases key and index them, and PostgreSQL's text cannot hold NUL. Such
an event is a dead letter (``validation_error``, its detail naming the field), never a batch that
fails to commit. Free text may contain NUL (a model can sample it): see :func:`ingest.rows.no_nul`.

Left out on purpose: ``routed_experts`` is checked to be an integer ``.npy`` array of rank 3, but
its row count is not compared with the token count (the prompt may arrive as text only).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 1 << 20

SESSION_COMPLETED = "session.completed"
CANDIDATES_SHOWN = "candidates.shown"
CANDIDATE_SELECTED = "candidate.selected"
EDIT_ACCEPTED = "edit.accepted"
EDIT_REJECTED = "edit.rejected"
CODE_RETAINED = "code.retained"
MODEL_SWITCHED = "model.switched"
FEEDBACK_THUMBS = "feedback.thumbs"
USER_CHURNED = "user.churned"
EVENT_TYPES: tuple[str, ...] = (
    SESSION_COMPLETED,
    CANDIDATES_SHOWN,
    CANDIDATE_SELECTED,
    EDIT_ACCEPTED,
    EDIT_REJECTED,
    CODE_RETAINED,
    MODEL_SWITCHED,
    FEEDBACK_THUMBS,
    USER_CHURNED,
)
SIGNAL_TYPES: tuple[str, ...] = tuple(t for t in EVENT_TYPES if t != SESSION_COMPLETED)

# Machine-readable dead-letter reasons.
INVALID_JSON = "invalid_json"
OVERSIZED = "oversized"
VALIDATION_ERROR = "validation_error"
UNKNOWN_TYPE = "unknown_type"
UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
LOGPROBS_LENGTH_MISMATCH = "logprobs_length_mismatch"
REASONS: tuple[str, ...] = (
    INVALID_JSON,
    OVERSIZED,
    VALIDATION_ERROR,
    UNKNOWN_TYPE,
    UNSUPPORTED_SCHEMA_VERSION,
    LOGPROBS_LENGTH_MISMATCH,
)


class InvalidEvent(ValueError):
    """A message that breaks the contract; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str, event_id: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.event_id = event_id


RFC3339_PATTERN = r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"


class _Rfc3339:
    """Only an RFC 3339 string with an offset is a timestamp (no epoch numbers, no naive times).

    Checked inside pydantic-core (no Python call per event): the string must match
    :data:`RFC3339_PATTERN`, then it is parsed as a timezone-aware datetime (which rejects impossible
    dates and times). From Python, an aware ``datetime`` is accepted as it is.
    """

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        text = core_schema.chain_schema(
            [
                core_schema.str_schema(pattern=RFC3339_PATTERN, strict=True),
                core_schema.datetime_schema(tz_constraint="aware", strict=False),
            ]
        )
        aware = core_schema.datetime_schema(tz_constraint="aware", strict=True)
        return core_schema.json_or_python_schema(
            json_schema=text,
            python_schema=core_schema.union_schema([aware, text]),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> Any:
        return {"type": "string", "format": "date-time"}


NO_NUL_PATTERN = r"^[^\x00]*$"
"""Identifiers may not contain NUL (U+0000)."""
Id = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL_PATTERN)]
Timestamp = Annotated[datetime, _Rfc3339]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Count = Annotated[int, Field(ge=0, lt=2**31)]
"""Counts fit the database's 32-bit integer columns."""


class _Open(BaseModel):
    """Payload parts keep unknown fields, as sent."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class Prompt(_Open):
    text: str | None = None
    token_ids: list[TokenId] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Prompt:
        if self.text is None and self.token_ids is None:
            raise PydanticCustomError("prompt_empty", "prompt needs text or token_ids")
        return self


class Segment(_Open):
    role: Literal["system", "user", "assistant", "tool"]
    text: str | None = None
    token_ids: list[TokenId] | None = None
    logprobs: list[Annotated[float, Field(allow_inf_nan=False)]] | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> Segment:
        if self.logprobs is None:
            return self
        if self.role != "assistant":
            raise PydanticCustomError("logprobs_role", "logprobs are only allowed on assistant segments")
        n_ids = len(self.token_ids) if self.token_ids is not None else 0
        if len(self.logprobs) != n_ids:
            raise PydanticCustomError(
                LOGPROBS_LENGTH_MISMATCH,
                "{n_logprobs} logprobs for {n_ids} token_ids",
                {"n_logprobs": len(self.logprobs), "n_ids": n_ids},
            )
        return self


class Sampling(_Open):
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    logprobs_mode: Literal["raw", "processed"] | None = None


class FileChange(_Open):
    path: str
    lines_added: Count
    lines_removed: Count


_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|])([iu])(\d)', 'fortran_order': False, 'shape': \((\d+), (\d+), (\d+)\), \}\s*\n"
)


@functools.lru_cache(maxsize=4096)
def _npy_payload_bytes(header: bytes) -> int | None:
    """The payload size a ``.npy`` header numpy writes (version 1.0) announces; None for another header.
    Cached: one model's headers differ only in the number of tokens."""
    match = _NPY_HEADER.fullmatch(header)
    if match is None:
        return None
    itemsize, rows, layers, top_k = (int(g) for g in match.groups()[2:])
    return itemsize * rows * layers * top_k


def _npy_fast_ok(raw: bytes) -> bool:
    """Check the header numpy itself writes (version 1.0) without building the array."""
    if raw[:8] != b"\x93NUMPY\x01\x00" or len(raw) < 10:
        return False
    header_len = int.from_bytes(raw[8:10], "little")
    if header_len > 240:  # numpy pads its header to 118 bytes; a longer one is loaded (and the cache stays small)
        return False
    size = _npy_payload_bytes(raw[10 : 10 + header_len])
    return size is not None and len(raw) - 10 - header_len == size


def routed_experts_npy(text: str) -> bytes:
    """The raw ``.npy`` bytes of a ``routed_experts`` field, checked to be a rank-3 int array."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise PydanticCustomError(
            "routed_experts", "routed_experts is not base64 of a .npy file: {e}", {"e": str(exc)}
        ) from None
    return checked_npy(raw)


def checked_npy(raw: bytes) -> bytes:
    """``raw`` (decoded ``routed_experts``) when it is a ``.npy`` rank-3 int array; else the contract's error."""
    try:
        if _npy_fast_ok(raw):
            return raw
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise PydanticCustomError(
            "routed_experts", "routed_experts is not base64 of a .npy file: {e}", {"e": str(exc)}
        ) from None
    if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.integer) or array.ndim != 3:
        raise PydanticCustomError(
            "routed_experts",
            "routed_experts must be an int array [tokens, layers, top_k], got {kind}",
            {"kind": f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}"},
        )
    return raw


class Turn(_Open):
    """Where a served response sits in an agent session: the session's id, the turn's index and,
    optionally, the group of sessions on the same task it belongs to (compared with each other)."""

    session_id: Id
    index: Count
    group: Id | None = None


class SessionCompletedPayload(_Open):
    model: Id
    policy_version: Id
    group_id: Id | None = None
    candidate_index: Count | None = None
    turn: Turn | None = None
    prompt: Prompt
    segments: list[Segment] = Field(min_length=1)
    routed_experts: str | None = None
    sampling: Sampling | None = None
    finish_reason: str | None = Field(default=None, max_length=32, pattern=NO_NUL_PATTERN)
    latency_ms: float | None = Field(default=None, ge=0)
    files: list[FileChange] | None = None

    @model_validator(mode="after")
    def _check(self) -> SessionCompletedPayload:
        if self.candidate_index is not None and self.group_id is None:
            raise PydanticCustomError("candidate_group", "candidate_index needs group_id")
        if self.routed_experts is not None:
            routed_experts_npy(self.routed_experts)  # checked here, decoded again where rows are built
        return self

    def experts_npy(self) -> bytes | None:
        """The raw ``.npy`` bytes of ``routed_experts`` (checked at validation)."""
        return None if self.routed_experts is None else routed_experts_npy(self.routed_experts)


class CandidatesShownPayload(_Open):
    group_id: Id
    session_ids: list[Id] = Field(min_length=2)

    @field_validator("session_ids")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise PydanticCustomError("session_ids_distinct", "session_ids must be distinct")
        return value


class CandidateSelectedPayload(_Open):
    group_id: Id
    chosen_session_id: Id


class EditPayload(_Open):
    edit_id: Id | None = None
    lines: Count | None = None


class CodeRetainedPayload(_Open):
    horizon_s: int = Field(gt=0, lt=2**31)
    lines_written: Count
    lines_retained: Count
    final_text: str | None = None

    @model_validator(mode="after")
    def _retained(self) -> CodeRetainedPayload:
        if self.lines_retained > self.lines_written:
            raise PydanticCustomError("lines_retained", "lines_retained must be <= lines_written")
        return self


class ModelSwitchedPayload(_Open):
    from_model: Id
    to_model: Id


class ThumbsPayload(_Open):
    value: int

    @field_validator("value")
    @classmethod
    def _sign(cls, value: int) -> int:
        if value not in (1, -1):
            raise PydanticCustomError("thumbs", "value must be 1 or -1")
        return value


class ChurnedPayload(_Open):
    inactive_days: Count


class _Envelope(BaseModel):
    """Fields every event carries."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    schema_version: Literal[1] = 1
    event_id: Id
    occurred_at: Timestamp
    user_id: Id | None = None


class _SessionScoped(_Envelope):
    session_id: Id


class SessionCompleted(_SessionScoped):
    type: Literal["session.completed"] = "session.completed"
    payload: SessionCompletedPayload


class CandidatesShown(_SessionScoped):
    type: Literal["candidates.shown"] = "candidates.shown"
    payload: CandidatesShownPayload


class CandidateSelected(_SessionScoped):
    type: Literal["candidate.selected"] = "candidate.selected"
    payload: CandidateSelectedPayload


class EditAccepted(_SessionScoped):
    type: Literal["edit.accepted"] = "edit.accepted"
    payload: EditPayload


class EditRejected(_SessionScoped):
    type: Literal["edit.rejected"] = "edit.rejected"
    payload: EditPayload


class CodeRetained(_SessionScoped):
    type: Literal["code.retained"] = "code.retained"
    payload: CodeRetainedPayload


class ModelSwitched(_SessionScoped):
    type: Literal["model.switched"] = "model.switched"
    payload: ModelSwitchedPayload


class FeedbackThumbs(_SessionScoped):
    type: Literal["feedback.thumbs"] = "feedback.thumbs"
    payload: ThumbsPayload


class UserChurned(_Envelope):
    type: Literal["user.churned"] = "user.churned"
    session_id: Id | None = None
    payload: ChurnedPayload


Event = Annotated[
    SessionCompleted
    | CandidatesShown
    | CandidateSelected
    | EditAccepted
    | EditRejected
    | CodeRetained
    | ModelSwitched
    | FeedbackThumbs
    | UserChurned,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
_VALIDATE_JSON = EVENT_ADAPTER.validator.validate_json  # the compiled validator, without the wrapper's per-call work


def parse_event(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Event:
    """Decode and validate one Kafka message value; raise :class:`InvalidEvent` with its reason."""
    if len(raw) > max_bytes:
        raise InvalidEvent(OVERSIZED, f"message is {len(raw)} bytes, the limit is {max_bytes}")
    try:
        return _VALIDATE_JSON(raw)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise _diagnose(raw, exc) from None


def _diagnose(raw: bytes, exc: ValidationError) -> InvalidEvent:
    """Find the most precise reason for a message that failed validation."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        return InvalidEvent(INVALID_JSON, f"not UTF-8 JSON: {str(err)[:200]}")
    if not isinstance(obj, dict):
        return InvalidEvent(VALIDATION_ERROR, f"the message must be a JSON object, got {type(obj).__name__}")
    event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
    version = obj.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        return InvalidEvent(UNSUPPORTED_SCHEMA_VERSION, f"schema_version {version} > {SCHEMA_VERSION}", event_id)
    kind = obj.get("type")
    if isinstance(kind, str) and kind not in EVENT_TYPES:
        return InvalidEvent(UNKNOWN_TYPE, f"unknown event type {kind[:64]!r}", event_id)
    errors = exc.errors(include_url=False, include_input=False)
    if any(err["type"] == "json_invalid" for err in errors):
        return InvalidEvent(INVALID_JSON, errors[0]["msg"], event_id)
    reason = VALIDATION_ERROR
    if any(err["type"] == LOGPROBS_LENGTH_MISMATCH for err in errors):
        reason = LOGPROBS_LENGTH_MISMATCH
    detail = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {_message(err)}" for err in errors[:5])
    return InvalidEvent(reason, detail, event_id)


def _message(err: Any) -> str:
    """A validation error's message; the NUL rule's names the character instead of its pattern."""
    if err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NO_NUL_PATTERN:
        return "contains a NUL character (U+0000), which identifiers may not"
    return str(err["msg"])


def validate_event(event: BaseModel | dict[str, Any]) -> Event:
    """Validate an event given as a model or a plain dict (what producers call before sending)."""
    if isinstance(event, _Envelope):
        return event  # type: ignore[return-value]  # built through validation already
    if isinstance(event, BaseModel):
        event = event.model_dump(mode="json", exclude_none=True)
    return parse_event(json.dumps(event).encode(), max_bytes=1 << 62)


def encode_event(event: BaseModel | dict[str, Any]) -> bytes:
    """The wire bytes of a valid event (UTF-8 JSON, ``None`` fields left out)."""
    model = event if isinstance(event, BaseModel) else validate_event(event)
    return model.model_dump_json(exclude_none=True).encode()
