"""Policy tables: one row per trained policy version (lineage, data window, staleness, metrics)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from ingest.db import Base, UTCDateTime

ID_LEN = 128


class PolicyVersionRow(Base):
    """A policy version written by the trainer (or the warm-up for v0)."""

    __tablename__ = "policy_versions"

    version_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(String(ID_LEN), index=True)
    """The version this one was trained from (None for a warm-up)."""
    step: Mapped[int] = mapped_column(Integer, default=0)
    """Cumulative optimizer steps since v0."""
    data_start: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Oldest rollout (occurred_at) in the training data; None for offline task-family data."""
    data_end: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Newest rollout in the training data."""
    num_samples: Mapped[int] = mapped_column(Integer, default=0)
    """Rollouts used in the update."""
    num_dropped_stale: Mapped[int] = mapped_column(Integer, default=0)
    """Rollouts dropped for exceeding the maximum staleness."""
    staleness_mean: Mapped[float | None] = mapped_column(Float)
    """Mean staleness (in policy versions) of the used rollouts."""
    staleness_max: Mapped[int | None] = mapped_column(Integer)
    """Largest staleness among the used rollouts."""
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Namespaced training and evaluation metrics (``loss/*``, ``eval/*``, ...)."""
    checkpoint_path: Mapped[str] = mapped_column(Text)
    trained_on_forgotten: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Forgotten users (``undertow users forget``) whose rollouts were in this version's training data or in an
    ancestor's (the weights carry them on); nonzero: retrain before relying on it."""
    """Hugging Face checkpoint directory of this version."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
