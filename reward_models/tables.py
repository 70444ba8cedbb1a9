"""Reward-model tables: the registry of trained versions and the LLM-judge cache.

A registry row points at a content-hashed artifact file (``<sha256>.pkl`` under the Undertow
home's ``RewardsConfig.artifacts_dir``) and records what it was trained on (data window), how
(resolved config) and how well (held-out metrics next to their baselines).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from ingest.db import Base, UTCDateTime


class RewardModelRow(Base):
    """One trained reward-model version (a bundle of heads scored together)."""

    __tablename__ = "reward_models"

    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    backend: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    """``promoted`` (serving rewards), ``candidate`` (kept, not promoted) or ``retired``."""
    reason: Mapped[str] = mapped_column(Text, default="")
    """Why it was or was not promoted."""
    artifact_sha256: Mapped[str] = mapped_column(String(64))
    artifact_path: Mapped[str] = mapped_column(Text)
    window_start: Mapped[datetime | None] = mapped_column(UTCDateTime)
    window_end: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Newest session ``occurred_at`` in the training data (new labels are counted after it)."""
    n_labeled: Mapped[int] = mapped_column(Integer, default=0)
    primary_metric: Mapped[float | None] = mapped_column(Float)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    reference_scores: Mapped[list[float]] = mapped_column(JSON, default=list)
    """A sample of hold-out scores: the reference distribution for drift detection."""
    promoted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    trained_on_forgotten: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Forgotten users (``undertow users forget``) whose rows were in this version's training data; nonzero:
    retrain before relying on it (:func:`reward_models.registry.flag_trained_on`)."""


class JudgeScoreRow(Base):
    """A cached judge score, keyed by the hash of (model, dimension, rubric, prompt, completion)."""

    __tablename__ = "reward_judge_cache"

    content_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    dimension: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    score: Mapped[float] = mapped_column(Float)
    """Judge score mapped to 0..1."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
