"""When to retrain: enough new labels, a schedule, or drift of the score distribution.

Reward models saturate after a few hundred policy steps (the policy moves to where the reward
model has seen little data), so retraining is routine: the scheduler asks
:func:`retrain_decision` and trains whenever any reason holds.

Drift compares the promoted version's reference scores (a sample of its hold-out scores, kept
in the registry) with its scores on recent sessions:

- population stability index ``PSI = sum_b (q_b - p_b) ln(q_b / p_b)`` over reference-quantile
  bins (p: reference share, q: recent share; Siddiqi, "Credit Risk Scorecards", 2006);
  0.1-0.2 is commonly read as moderate and > 0.2 as major shift;
- the two-sample Kolmogorov-Smirnov test (``scipy.stats.ks_2samp``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from scipy import stats
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ingest.tables import SessionRow, SignalRow
from reward_models import registry
from reward_models.config import RewardsConfig


def psi(reference: np.ndarray, recent: np.ndarray, bins: int = 10, eps: float = 1e-4) -> float:
    """Population stability index of ``recent`` against ``reference`` (bins: reference deciles)."""
    reference = np.asarray(reference, dtype=np.float64)
    recent = np.asarray(recent, dtype=np.float64)
    if reference.size == 0 or recent.size == 0:
        raise ValueError("PSI needs scores on both sides")
    edges = np.unique(np.quantile(reference, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
    p = np.bincount(np.searchsorted(edges, reference, side="right"), minlength=len(edges) + 1) / reference.size
    q = np.bincount(np.searchsorted(edges, recent, side="right"), minlength=len(edges) + 1) / recent.size
    p = np.clip(p, eps, None)
    q = np.clip(q, eps, None)
    return float(np.sum((q - p) * np.log(q / p)))


@dataclass
class DriftReport:
    """Drift of recent scores against a reference."""

    psi: float
    ks_statistic: float
    ks_pvalue: float
    n_reference: int
    n_recent: int
    drifted: bool


def score_drift(reference: np.ndarray, recent: np.ndarray, config: RewardsConfig) -> DriftReport:
    """PSI and KS of ``recent`` vs ``reference``; drifted when either crosses its threshold."""
    value = psi(reference, recent)
    ks = stats.ks_2samp(reference, recent)
    drifted = value > config.drift_psi_threshold or float(ks.pvalue) < config.drift_ks_pvalue
    return DriftReport(value, float(ks.statistic), float(ks.pvalue), len(reference), len(recent), drifted)


@dataclass
class RetrainDecision:
    """Whether to retrain now, and every reason that holds."""

    retrain: bool
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def drifted(self) -> bool:
        """True when the recent scores drifted from the reference (one of the reasons)."""
        return bool(self.details.get("drift", {}).get("drifted"))


def new_labels_since(engine: Engine, since: datetime | None) -> int:
    """Distinct sessions with a label-bearing signal whose session occurred after ``since``."""
    label_types = ["code.retained", "edit.accepted", "edit.rejected", "candidate.selected", "model.switched"]
    query = (
        select(func.count(func.distinct(SignalRow.session_id)))
        .join(SessionRow, SessionRow.session_id == SignalRow.session_id)
        .where(SignalRow.type.in_(label_types))
    )
    if since is not None:
        query = query.where(SessionRow.occurred_at > since)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def retrain_decision(
    engine: Engine, config: RewardsConfig, *, now: datetime | None = None, recent_scores: np.ndarray | None = None
) -> RetrainDecision:
    """Retrain when no version is promoted, enough new labels arrived, the version is old, or scores drifted.

    ``recent_scores``: the promoted version's scores on recent sessions (the caller scores them
    with :mod:`reward_models.api`); drift is checked when there are at least ``drift_min_samples``.
    """
    now = now or datetime.now(UTC)
    current = registry.current_promoted(engine)
    if current is None:
        return RetrainDecision(True, ["no promoted reward model"])
    decision = RetrainDecision(False)
    fresh = new_labels_since(engine, current.window_end)
    decision.details["new_labels"] = fresh
    if fresh >= config.retrain_min_new_labels:
        decision.reasons.append(f"{fresh} new labeled sessions >= {config.retrain_min_new_labels}")
    age = now - current.created_at
    decision.details["age_s"] = age.total_seconds()
    if age >= timedelta(seconds=config.retrain_interval_s):
        decision.reasons.append(
            f"version {current.version} is {age.total_seconds():.0f}s old >= {config.retrain_interval_s}s"
        )
    if recent_scores is not None and len(recent_scores) >= config.drift_min_samples and current.reference_scores:
        drift = score_drift(np.asarray(current.reference_scores), np.asarray(recent_scores), config)
        decision.details["drift"] = drift.__dict__
        if drift.drifted:
            decision.reasons.append(f"score drift: PSI {drift.psi:.3f}, KS p={drift.ks_pvalue:.2g}")
    decision.retrain = bool(decision.reasons)
    return decision
