"""Scheduler tables: the job table (every task run: state, inputs, outputs, timings), replica
leases (one row per borrowed-or-once-borrowed replica) and the borrow event log.

A lease has an expiry: its holder renews it while it works; the reaper returns any replica whose
lease expired, so a killed worker never leaves a replica borrowed forever.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from ingest.db import Base, UTCDateTime

BIGINT_PK = BigInteger().with_variant(Integer(), "sqlite")


class JobRow(Base):
    """A job (``id == chain_id``, ``name`` its kind) or one step run of it (keyed by the task id, ``name``
    the task's; retries and redeliveries update the same row). See :mod:`scheduler.loop.jobs`."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    chain_id: Mapped[str | None] = mapped_column(String(64), index=True)
    inputs: Mapped[dict[str, Any]] = mapped_column(JSON)
    outputs: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    duration_s: Mapped[float | None] = mapped_column(Float)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Last sign of life of the worker running it; a step silent for too long is LOST."""


class LeaseRow(Base):
    """The current lease of a replica (released leases stay with ``released_at`` set)."""

    __tablename__ = "replica_leases"

    replica_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    pool: Mapped[str] = mapped_column(String(64), index=True)
    holder: Mapped[str] = mapped_column(String(128))
    purpose: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    recall_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    recall_deadline: Mapped[datetime | None] = mapped_column(UTCDateTime)
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class BorrowEventRow(Base):
    """Append-only log of lending, recalls, returns and expiries."""

    __tablename__ = "borrow_events"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    replica_id: Mapped[str] = mapped_column(String(128), index=True)
    pool: Mapped[str] = mapped_column(String(64))
    event: Mapped[str] = mapped_column(String(32), index=True)
    holder: Mapped[str | None] = mapped_column(String(128))
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
