"""Held-out evaluation on a time-ordered split: train on older sessions, test on newer ones.

Metrics: ROC AUC (acceptance, retention, composite), pairwise accuracy (selections), expected
calibration error (ECE; Naeini et al., AAAI 2015, equal-width bins). Each is reported next to a
trivial baseline (a constant score: AUC 0.5, pairwise accuracy 0.5, ECE of the training base
rate) and next to the policy's own confidence (its mean logprob over the generated tokens).
A metric that is undefined on the hold-out (one class only, no pairs) is ``None``, never a
made-up number.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score


def time_split(occurred_at: pd.Series, holdout_fraction: float) -> datetime:
    """Cutoff time: sessions at or after it (the newest ``holdout_fraction``) form the hold-out."""
    times = pd.to_datetime(occurred_at, utc=True).sort_values(kind="stable").reset_index(drop=True)
    if times.empty:
        raise ValueError("cannot split an empty window")
    position = int(np.floor(len(times) * (1.0 - holdout_fraction)))
    position = min(max(position, 1), len(times) - 1) if len(times) > 1 else 0
    return times.iloc[position].to_pydatetime()


def auc(y: np.ndarray, score: np.ndarray) -> float | None:
    """ROC AUC, or None when ``y`` has one class or a score is not finite."""
    y = np.asarray(y)
    score = np.asarray(score, dtype=np.float64)
    if len(np.unique(y)) < 2 or not np.all(np.isfinite(score)):
        return None
    return float(roc_auc_score(y, score))


def pairwise_accuracy(score_chosen: np.ndarray, score_rejected: np.ndarray) -> float | None:
    """Fraction of pairs ranked right (``r_c > r_r``); ties count one half. None without pairs."""
    if len(score_chosen) == 0:
        return None
    diff = np.asarray(score_chosen, dtype=np.float64) - np.asarray(score_rejected, dtype=np.float64)
    if not np.all(np.isfinite(diff)):
        return None
    return float(np.mean((diff > 0) + 0.5 * (diff == 0)))


def expected_calibration_error(y: np.ndarray, prob: np.ndarray, bins: int = 10) -> float | None:
    """``ECE = sum_b (n_b / n) |mean(y_b) - mean(p_b)|`` over equal-width probability bins."""
    y = np.asarray(y, dtype=np.float64)
    prob = np.asarray(prob, dtype=np.float64)
    if len(y) == 0 or not np.all(np.isfinite(prob)):
        return None
    which = np.clip((prob * bins).astype(int), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += mask.mean() * abs(y[mask].mean() - prob[mask].mean())
    return float(total)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function, computed stably."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, dtype=np.float64)))


def _filled_logprob(logprob: np.ndarray) -> np.ndarray:
    lp = np.asarray(logprob, dtype=np.float64)
    fill = float(np.nanmedian(lp)) if np.isfinite(lp).any() else 0.0
    return np.where(np.isfinite(lp), lp, fill)


def pointwise_report(
    y: np.ndarray, logit: np.ndarray, logprob: np.ndarray, train_rate: float
) -> dict[str, float | None]:
    """AUC and ECE of a head on the hold-out, with the trivial and the policy-confidence baselines."""
    return {
        "auc": auc(y, logit),
        "auc_baseline": 0.5 if len(np.unique(y)) == 2 else None,
        "auc_logprob": auc(y, _filled_logprob(logprob)),
        "ece": expected_calibration_error(y, sigmoid(logit)),
        "ece_baseline": expected_calibration_error(y, np.full(len(y), train_rate)),
        "n": len(y),
        "positive_rate": float(np.mean(y)) if len(y) else None,
    }


def pairwise_report(
    score_c: np.ndarray,
    score_r: np.ndarray,
    logprob_c: np.ndarray,
    logprob_r: np.ndarray,
    pos_c: np.ndarray,
    pos_r: np.ndarray,
) -> dict[str, float | None]:
    """Pairwise accuracy on hold-out pairs vs a constant, the policy's mean logprob, and "first shown wins"."""
    both = _filled_logprob(np.concatenate([logprob_c, logprob_r]))
    lp_c, lp_r = both[: len(logprob_c)], both[len(logprob_c) :]
    return {
        "pairwise_acc": pairwise_accuracy(score_c, score_r),
        "pairwise_acc_baseline": 0.5 if len(score_c) else None,
        "pairwise_acc_logprob": pairwise_accuracy(lp_c, lp_r),
        "pairwise_acc_position": pairwise_accuracy(-np.asarray(pos_c, float), -np.asarray(pos_r, float)),
        "pairs": len(score_c),
    }
