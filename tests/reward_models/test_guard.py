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


def _noisy(proxy: list[float], real: list[float], n: int, noise: float, seed: int) -> pd.DataFrame:
    """Per-session retention shares spread ``noise`` around each version's mean, clipped to [0, 1]."""
    rng = np.random.default_rng(seed)
    rows = [
        {"policy_version": f"v{i + 1}", "proxy": p, "real": float(np.clip(r + rng.normal(0, noise), 0, 1)), "order": i}
        for i, (p, r) in enumerate(zip(proxy, real, strict=True))
        for _ in range(n)
    ]
    return pd.DataFrame(rows)


def test_min_z_asks_the_fall_to_stand_out_of_its_noise() -> None:
    """A fall of a few points on a few noisy sessions per version is flagged by the plain guard and
    not with ``min_z``; a large fall on the same number of sessions is flagged either way; the
    report carries the fall's standard error."""
    config = RewardsConfig()
    small = _noisy([0.1, 0.3, 0.6], [0.55, 0.52, 0.50], n=12, noise=0.35, seed=1)
    plain, strict = reward_hacking(small, config), reward_hacking(small, config, min_z=2.0)
    assert plain.real_drop is not None and plain.real_drop > config.hacking_real_drop
    assert plain.flagged and not strict.flagged, strict.reason
    assert strict.real_drop_se is not None and strict.real_drop < 2.0 * strict.real_drop_se
    large = _noisy([0.1, 0.3, 0.6], [0.75, 0.45, 0.15], n=12, noise=0.35, seed=1)
    report = reward_hacking(large, config, min_z=2.0)
    assert report.flagged and "standard errors" in report.reason
    assert report.real_drop_se is not None and 0.05 < report.real_drop_se < 0.25
    # a version of one session has no error estimate: min_z cannot be met on it
    single = _noisy([0.1, 0.3, 0.6], [0.9, 0.5, 0.1], n=1, noise=0.0, seed=1)
    assert reward_hacking(single, config).flagged and not reward_hacking(single, config, min_z=2.0).flagged
