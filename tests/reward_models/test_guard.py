"""The reward-hacking guard flags proxy up while real retention goes down, and only then."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from reward_models.config import RewardsConfig
from reward_models.guard import reward_hacking


def _frame(proxy: list[float], real: list[float], n: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for i, (p, r) in enumerate(zip(proxy, real, strict=True)):
        for j in range(n):
            rows.append(
                {
                    "policy_version": f"v{i + 1}",
                    "proxy": p + rng.normal(0, 0.01),
                    "real": r + rng.normal(0, 0.01),
                    "order": i * n + j,
                }
            )
    return pd.DataFrame(rows)


def test_divergence_is_flagged() -> None:
    report = reward_hacking(_frame([0.1, 0.3, 0.6], [0.7, 0.6, 0.5]), RewardsConfig())
    assert report.flagged, report.reason
    assert report.proxy_rise == pytest.approx(0.5, abs=0.02)
    assert report.real_drop == pytest.approx(0.2, abs=0.02)
    assert [v["policy_version"] for v in report.versions] == ["v1", "v2", "v3"]


def test_no_flag_when_both_rise_or_proxy_flat() -> None:
    config = RewardsConfig()
    assert not reward_hacking(_frame([0.1, 0.3, 0.6], [0.5, 0.6, 0.7]), config).flagged
    assert not reward_hacking(_frame([0.3, 0.3, 0.31], [0.7, 0.6, 0.5]), config).flagged
    assert not reward_hacking(_frame([0.3], [0.7]), config).flagged  # one version: nothing to compare


def test_window_uses_only_recent_versions_and_ignores_nans() -> None:
    frame = _frame([0.0, 0.1, 0.4, 0.8], [0.9, 0.5, 0.6, 0.7])  # old drop, recent recovery
    frame.loc[0, "proxy"] = np.nan
    frame.loc[1, "real"] = np.inf
    assert not reward_hacking(frame, RewardsConfig(hacking_window=3)).flagged
    assert reward_hacking(frame.iloc[: 3 * 50], RewardsConfig(hacking_window=3)).flagged


def test_missing_columns_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs columns"):
        reward_hacking(pd.DataFrame({"policy_version": ["v1"]}), RewardsConfig())
