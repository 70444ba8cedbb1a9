"""The consumer's fast path: the wire contract as ``msgspec`` structs, decoded and checked in C.

:mod:`ingest.schemas` (pydantic) stays the contract's public model: the producer SDK, the API and
the dead-letter reasons come from it. This module mirrors it for the hot path only, where
pydantic-core's validation cost about twice a plain ``json.loads``. :func:`fast_parse` returns a
checked event or ``None``; ``None`` means "let pydantic decide", so the fast path may refuse more
than the contract does (unknown payload fields, which pydantic keeps; explicit ``null`` where a
field may be absent; integers beyond 64 bits; ...) but never accepts what the contract refuses.
``tests/ingest/test_ingest_fastpath.py`` generates valid and mutated events and checks exactly
that, so the two definitions cannot drift.

The structs have the attribute names of the pydantic models, so :mod:`ingest.writer` builds rows
from either. Timestamps are matched against the same RFC 3339 pattern and parsed by the same
pydantic-core parser as :mod:`ingest.schemas`, so both paths store the same instant.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from ingest import schemas

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Stamp = Annotated[str, msgspec.Meta(pattern=schemas.RFC3339_PATTERN)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class _Part(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A payload part: unknown fields send the message to pydantic, which keeps them."""

    @property
    def model_extra(self) -> None:
        return None


class Prompt(_Part):
    text: str | None = None
    token_ids: list[TokenId] | None = None


class Segment(_Part):
    role: Literal["system", "user", "assistant", "tool"]
    text: str | None = None
    token_ids: list[TokenId] | None = None
    logprobs: list[float] | None = None


class Sampling(_Part):
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, lt=2**31)] | None = None
    seed: int | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None


class FileChange(_Part):
    path: str
    lines_added: Count
    lines_removed: Count


class Turn(_Part):
    session_id: Id
    index: Count
    group: Id | None = None


class SessionCompletedPayload(_Part):
    model: Id
    policy_version: Id
    prompt: Prompt
    segments: Annotated[list[Segment], msgspec.Meta(min_length=1)]
    group_id: Id | None = None
    candidate_index: Count | None = None
    turn: Turn | None = None
    routed_experts: bytes | None = None
    """Decoded from base64 by msgspec (stricter than ``base64.b64decode(validate=True)``: never looser)."""
    sampling: Sampling | None = None
    finish_reason: Annotated[str, msgspec.Meta(max_length=32)] | None = None
    latency_ms: Annotated[float, msgspec.Meta(ge=0)] | None = None
    files: list[FileChange] | None = None

    def experts_npy(self) -> bytes | None:
        """The raw ``.npy`` bytes of ``routed_experts`` (checked by :func:`fast_parse`)."""
        return self.routed_experts


class CandidatesShownPayload(_Part):
    group_id: Id
    session_ids: Annotated[list[Id], msgspec.Meta(min_length=2)]


class CandidateSelectedPayload(_Part):
    group_id: Id
    chosen_session_id: Id


class EditPayload(_Part):
    edit_id: Id | None = None
    lines: Count | None = None


class CodeRetainedPayload(_Part):
    horizon_s: Annotated[int, msgspec.Meta(gt=0, lt=2**31)]
    lines_written: Count
    lines_retained: Count
    final_text: str | None = None


class ModelSwitchedPayload(_Part):
    from_model: Id
    to_model: Id


class ThumbsPayload(_Part):
    value: Literal[1, -1]


class ChurnedPayload(_Part):
    inactive_days: Count


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    """Envelope fields (unknown envelope fields are ignored, as in the contract)."""

    event_id: Id
    occurred_at: Stamp
    schema_version: Literal[1] = 1
    user_id: Id | None = None


class SessionCompleted(_Event, tag=schemas.SESSION_COMPLETED):
    type: ClassVar[str] = schemas.SESSION_COMPLETED
    session_id: Id
    payload: SessionCompletedPayload


class CandidatesShown(_Event, tag=schemas.CANDIDATES_SHOWN):
    type: ClassVar[str] = schemas.CANDIDATES_SHOWN
    session_id: Id
    payload: CandidatesShownPayload


class CandidateSelected(_Event, tag=schemas.CANDIDATE_SELECTED):
    type: ClassVar[str] = schemas.CANDIDATE_SELECTED
    session_id: Id
    payload: CandidateSelectedPayload


class EditAccepted(_Event, tag=schemas.EDIT_ACCEPTED):
    type: ClassVar[str] = schemas.EDIT_ACCEPTED
    session_id: Id
    payload: EditPayload


class EditRejected(_Event, tag=schemas.EDIT_REJECTED):
    type: ClassVar[str] = schemas.EDIT_REJECTED
    session_id: Id
    payload: EditPayload


class CodeRetained(_Event, tag=schemas.CODE_RETAINED):
    type: ClassVar[str] = schemas.CODE_RETAINED
    session_id: Id
    payload: CodeRetainedPayload


class ModelSwitched(_Event, tag=schemas.MODEL_SWITCHED):
    type: ClassVar[str] = schemas.MODEL_SWITCHED
    session_id: Id
    payload: ModelSwitchedPayload


class FeedbackThumbs(_Event, tag=schemas.FEEDBACK_THUMBS):
    type: ClassVar[str] = schemas.FEEDBACK_THUMBS
    session_id: Id
    payload: ThumbsPayload


class UserChurned(_Event, tag=schemas.USER_CHURNED, kw_only=True):
    type: ClassVar[str] = schemas.USER_CHURNED
    session_id: Id | None = None
    payload: ChurnedPayload


FastEvent = (
    SessionCompleted
    | CandidatesShown
    | CandidateSelected
    | EditAccepted
    | EditRejected
    | CodeRetained
    | ModelSwitched
    | FeedbackThumbs
    | UserChurned
)
_DECODE = msgspec.json.Decoder(FastEvent).decode
_TIMESTAMP: Any = TypeAdapter(schemas.Timestamp).validator.validate_python


def fast_parse(raw: bytes) -> FastEvent | None:
    """A checked event, or ``None`` when pydantic must decide (:func:`ingest.schemas.parse_event`).

    The rules pydantic checks in Python (after-validators) are checked here after the decode. A NUL
    character anywhere (in JSON only as the escape ``\\u0000``) is left to pydantic, which refuses it in
    identifiers and keeps it in free text: one search of the raw bytes instead of a pattern per field.
    """
    if b"\\u0000" in raw:
        return None
    try:
        event = _DECODE(raw)
        event.occurred_at = _TIMESTAMP(event.occurred_at)  # same parser as the contract's model
    except (msgspec.ValidationError, msgspec.DecodeError, ValidationError):
        return None
    payload = event.payload
    if isinstance(payload, SessionCompletedPayload):
        return event if _session_ok(payload) else None
    if isinstance(payload, CodeRetainedPayload):
        return event if payload.lines_retained <= payload.lines_written else None
    if isinstance(payload, CandidatesShownPayload):
        return event if len(set(payload.session_ids)) == len(payload.session_ids) else None
    return event


def _session_ok(p: SessionCompletedPayload) -> bool:
    """The cross-field rules of ``session.completed`` (see :class:`ingest.schemas.SessionCompletedPayload`)."""
    if p.prompt.text is None and p.prompt.token_ids is None:
        return False
    if p.candidate_index is not None and p.group_id is None:
        return False
    for seg in p.segments:
        if seg.logprobs is not None:
            if seg.role != "assistant" or len(seg.logprobs) != len(seg.token_ids or ()):
                return False
            if not math.isfinite(sum(seg.logprobs)):  # an inf or nan anywhere makes the sum one (so may
                return False  # an overflowing sum of finite values: then pydantic decides)
    if p.sampling is not None and p.sampling.seed is not None and not -(2**63) <= p.sampling.seed < 2**64:
        return False
    if p.routed_experts is not None:
        try:
            schemas.checked_npy(p.routed_experts)
        except PydanticCustomError:
            return False
    return True
