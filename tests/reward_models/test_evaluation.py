"""Evaluation metrics and drift statistics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from reward_models import evaluation as ev
from reward_models.config import RewardsConfig
from reward_models.triggers import psi, score_drift


def test_auc_pairwise_ece_known_values() -> None:
    assert ev.auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert ev.auc(np.array([1, 1]), np.array([0.1, 0.2])) is None  # one class: undefined, not made up
    assert ev.auc(np.array([0, 1]), np.array([np.nan, 0.2])) is None
    assert ev.pairwise_accuracy(np.array([1.0, 0.0, 2.0]), np.array([0.0, 1.0, 2.0])) == pytest.approx(0.5)
    assert ev.pairwise_accuracy(np.zeros(0), np.zeros(0)) is None
    y = np.array([1, 0, 1, 1])
    prob = np.array([0.95, 0.95, 0.15, 0.15])  # two bins: |0.5 - 0.95| and |1.0 - 0.15|
    assert ev.expected_calibration_error(y, prob) == pytest.approx(0.5 * 0.45 + 0.5 * 0.85)


def test_time_split_holds_out_the_newest() -> None:
    times = pd.Series(pd.date_range("2026-01-01", periods=10, freq="h", tz="UTC")).sample(frac=1.0, random_state=0)
    cutoff = ev.time_split(times, 0.2)
    assert (times >= cutoff).sum() == 2
    assert times[times >= cutoff].min() > times[times < cutoff].max()
    with pytest.raises(ValueError):
        ev.time_split(pd.Series([], dtype="datetime64[ns, UTC]"), 0.2)


def test_psi_and_ks_detect_a_shift_and_ignore_noise() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(0.0, 1.0, 2000)
    same = rng.normal(0.0, 1.0, 500)
    shifted = rng.normal(0.8, 1.0, 500)
    assert psi(ref, same) < 0.05
    assert psi(ref, shifted) > 0.2
    config = RewardsConfig()
    assert not score_drift(ref, same, config).drifted
    assert score_drift(ref, shifted, config).drifted
    with pytest.raises(ValueError):
        psi(ref, np.zeros(0))
    # A degenerate reference (all equal) still gives a finite PSI.
    assert np.isfinite(psi(np.ones(100), np.ones(50) * 2))
