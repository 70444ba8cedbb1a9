"""Telemetry tables: sessions (rollouts) with their segments, signals, duplicates, dead letters
and consumer offsets.

Token ids are stored as little-endian int32 bytes, logprobs as float64 bytes (bit-exact for
what the engine returned) and routed experts as the raw ``.npy`` bytes vLLM sent (decoded from
base64): compact, and loaded straight into NumPy with :mod:`ingest.arrays`.
Signals keep no foreign key to sessions: they may arrive before their session, and are joined
by ``session_id`` whenever it arrives. Segments keep none either (migration ``ingest_0005``): the
writer stores a session and its segments in one transaction, and nothing else writes them; the
check cost a query per segment row at every insert. Only columns that queries filter, join or group by are
indexed (each index costs every insert). On PostgreSQL the indexed identifiers compare by bytes
(``COLLATE "C"``) and the binary columns compress with lz4 (migration ``ingest_0003``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, Integer, LargeBinary, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from ingest.db import Base, UTCDateTime

ID_LEN = 128


class SessionRow(Base):
    """One ``session.completed`` event: a model response as served in production."""

    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    event_id: Mapped[str] = mapped_column(String(ID_LEN), unique=True)
    user_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    occurred_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    model: Mapped[str] = mapped_column(String(ID_LEN))
    policy_version: Mapped[str] = mapped_column(String(ID_LEN), index=True)
    group_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    candidate_index: Mapped[int | None] = mapped_column(Integer)
    prompt_text: Mapped[str | None] = mapped_column(Text)
    prompt_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_text: Mapped[str] = mapped_column(Text, default="")
    """Concatenated text of the assistant segments (what the model wrote)."""
    num_completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    routed_experts: Mapped[bytes | None] = mapped_column(LargeBinary)
    """Raw ``.npy`` bytes, shape ``[tokens, layers, top_k]`` as vLLM returns them."""
    logprobs_mode: Mapped[str] = mapped_column(String(16), default="raw")
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    latency_ms: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Sampling parameters, files, and unknown payload fields, kept as sent."""

    segments: Mapped[list[SegmentRow]] = relationship(
        back_populates="session",
        order_by="SegmentRow.idx",
        cascade="all, delete-orphan",
        primaryjoin="SessionRow.session_id == foreign(SegmentRow.session_id)",
    )


class SegmentRow(Base):
    """One segment of a session, in order (system, user, assistant or tool)."""

    __tablename__ = "session_segments"

    session_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    """Its session's id (no foreign key: see the module docstring)."""
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    text: Mapped[str | None] = mapped_column(Text)
    token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)

    session: Mapped[SessionRow] = relationship(
        back_populates="segments", primaryjoin="SessionRow.session_id == foreign(SegmentRow.session_id)"
    )


class SignalRow(Base):
    """Any event other than ``session.completed``: retention, selection, edits, switches, thumbs."""

    __tablename__ = "signals"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    event_id: Mapped[str] = mapped_column(String(ID_LEN), unique=True)
    type: Mapped[str] = mapped_column(String(32), index=True)
    session_id: Mapped[str | None] = mapped_column(String(ID_LEN), index=True)
    user_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    group_id: Mapped[str | None] = mapped_column(String(ID_LEN), index=True)
    occurred_at: Mapped[datetime] = mapped_column(UTCDateTime)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    horizon_s: Mapped[int | None] = mapped_column(Integer)
    """Retention horizon in seconds (``code.retained`` only)."""
    value: Mapped[float | None] = mapped_column(Float)
    """The signal's number: retained fraction, thumbs value, edit lines; type-specific."""
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class DuplicateRow(Base):
    """A delivery of an ``event_id`` that was already stored; counted, never stored twice."""

    __tablename__ = "duplicates"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    event_id: Mapped[str] = mapped_column(String(ID_LEN), index=True)
    topic: Mapped[str] = mapped_column(String(255))
    partition: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)


class DeadLetterRow(Base):
    """A message that could not be accepted, with its raw bytes and a machine-readable reason."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    topic: Mapped[str] = mapped_column(String(255))
    partition: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[bytes | None] = mapped_column(LargeBinary)
    value: Mapped[bytes | None] = mapped_column(LargeBinary)
    reason: Mapped[str] = mapped_column(String(64), index=True)
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    replayed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    replay_count: Mapped[int] = mapped_column(Integer, default=0)


class ConsumerOffsetRow(Base):
    """Next offset to read per group and partition, written in the same transaction as the rows."""

    __tablename__ = "consumer_offsets"

    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    topic: Mapped[str] = mapped_column(String(255), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_offset: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    cluster_id: Mapped[str | None] = mapped_column(String(255))
    """Kafka cluster id the offset refers to; a different id means the log was recreated."""


class UnreadableBatchRow(Base):
    """A partition's batch the consumer could not read (a codec without its library, a corrupt batch).

    One row per group and partition, updated at every failed read; the partition is still held there
    while the group's stored offset (:class:`ConsumerOffsetRow`) has not passed ``offset``.
    """

    __tablename__ = "unreadable_batches"

    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    topic: Mapped[str] = mapped_column(String(255), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    """Offset of the batch that could not be read (where the partition waits)."""
    reason: Mapped[str] = mapped_column(String(64))
    """``codec_unavailable`` or ``corrupt_batch``."""
    detail: Mapped[str] = mapped_column(Text, default="")
    """What failed and what to do."""
    failures: Mapped[int] = mapped_column(Integer, default=0)
    """Failed reads recorded for this partition, all offsets together."""
    first_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ForgottenUserRow(Base):
    """A user whose data was deleted on request (``undertow users forget``): the tombstone ingest checks.

    Only the SHA-256 of the user id is kept, enough to recognize the user's late-arriving events
    (they are dropped and counted in ``dropped_events``, never stored) without keeping the id itself.
    """

    __tablename__ = "forgotten_users"

    user_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    """Hex SHA-256 of the user id (:func:`ingest.forget.user_hash`)."""
    forgotten_at: Mapped[datetime] = mapped_column(UTCDateTime)
    requested_by: Mapped[str] = mapped_column(String(128))
    """Who asked (the operator token's name, or ``cli``)."""
    deleted: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Rows deleted per table, summed over every request for this user."""
    flagged: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Versions flagged as trained on the user's rows: ``{"reward_models": [...], "policy_versions": [...]}``."""
    dropped_events: Mapped[int] = mapped_column(BigInteger, default=0)
    """Events for this user that arrived after it was forgotten and were dropped by ingest."""
    last_dropped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
