"""Reward-hacking guard: stop when the proxy reward rises while the real outcome falls.

Optimizing a learned reward past a point makes the true objective worse (Gao et al., "Scaling
Laws for Reward Model Overoptimization", ICML 2023). Given, per policy version in rollout order,
the mean proxy reward (the reward model's score) and the mean real outcome (final retention),
the guard compares the first and the last of the most recent ``hacking_window`` versions:

    proxy_rise = proxy[last] - proxy[first];  real_drop = real[first] - real[last]
    flagged    = proxy_rise > hacking_proxy_rise and real_drop > hacking_real_drop

A flag tells the loop to stop promoting policies and retrain the reward model, and the RL update to
stop training on that model's scores (:func:`policy.production.reward_sources`). Versions without
any real outcome yet (retention still pending) are left out rather than read as zero.

With ``min_z`` > 0 the fall must also be that many standard errors of the difference of the two
versions' mean retentions (``sqrt(se_first^2 + se_last^2)``, each ``std / sqrt(n)`` over its
sessions): a few dozen retention labels per version move the mean by several points by chance, and a
caller that acts on every update (the RL side) should not act on noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from reward_models.config import RewardsConfig


@dataclass
class HackingReport:
    """The guard's verdict and the per-version means it read."""

    flagged: bool
    reason: str
    proxy_rise: float | None = None
    real_drop: float | None = None
    real_drop_se: float | None = None
    """Standard error of ``real_drop`` (the two versions' retention means, independent sessions)."""
    versions: list[dict[str, Any]] = field(default_factory=list)


def reward_hacking(per_session: pd.DataFrame, config: RewardsConfig, *, min_z: float = 0.0) -> HackingReport:
    """Check divergence from rows ``policy_version, proxy, real`` (and optional ``order``, else first appearance).

    Rows with a non-finite proxy or real value are ignored (counted in ``versions``). With ``min_z`` the
    fall of retention must also exceed ``min_z`` standard errors (see the module docstring).
    """
    needed = {"policy_version", "proxy", "real"}
    if not needed <= set(per_session.columns):
        raise ValueError(f"reward_hacking needs columns {sorted(needed)}, got {sorted(per_session.columns)}")
    frame = per_session.copy()
    if "order" not in frame:
        frame["order"] = np.arange(len(frame))
    frame["proxy"] = pd.to_numeric(frame["proxy"], errors="coerce")
    frame["real"] = pd.to_numeric(frame["real"], errors="coerce")
    frame = frame[np.isfinite(frame["proxy"]) & np.isfinite(frame["real"])]
    grouped = (
        frame.groupby("policy_version")
        .agg(
            order=("order", "min"),
            proxy=("proxy", "mean"),
            real=("real", "mean"),
            real_std=("real", "std"),
            n=("proxy", "size"),
        )
        .sort_values("order")
    )
    versions = [
        {"policy_version": str(v), "proxy": float(r.proxy), "real": float(r.real), "sessions": int(r.n)}
        for v, r in grouped.iterrows()
    ]
    if len(grouped) < 2:
        return HackingReport(False, f"need 2 policy versions with outcomes, have {len(grouped)}", versions=versions)
    window = grouped.tail(config.hacking_window)
    proxy_rise = float(window["proxy"].iloc[-1] - window["proxy"].iloc[0])
    real_drop = float(window["real"].iloc[0] - window["real"].iloc[-1])
    ends = window.iloc[[0, -1]]
    variance = (ends["real_std"].fillna(np.inf) ** 2 / ends["n"]).sum()  # one session: no error estimate
    real_drop_se = float(np.sqrt(variance))
    flagged = proxy_rise > config.hacking_proxy_rise and real_drop > config.hacking_real_drop
    if min_z > 0:
        flagged = flagged and real_drop > min_z * real_drop_se
    first, last = window.index[0], window.index[-1]
    z = f"{real_drop / real_drop_se:.1f}" if real_drop_se > 0 and np.isfinite(real_drop_se) else "n/a"
    if flagged:
        reason = (
            f"proxy reward rose {proxy_rise:+.3f} while retention fell {real_drop:.3f} ({z} standard errors) "
            f"from {first} to {last}"
        )
    else:
        reason = (
            f"no divergence from {first} to {last} (proxy {proxy_rise:+.3f}, retention {-real_drop:+.3f}, "
            f"{z} standard errors)"
        )
    return HackingReport(flagged, reason, proxy_rise, real_drop, real_drop_se, versions)


def promotion_guard(
    per_session: pd.DataFrame, config: RewardsConfig, *, incumbent: str, candidate: str
) -> HackingReport:
    """The guard applied to one promotion: ``candidate`` against the ``incumbent`` it would replace.

    ``per_session`` holds rows ``policy_version, proxy, real`` of the two versions. The incumbent
    is read as the first version and the candidate as the last, so ``flagged`` means the candidate
    raises the proxy reward by more than ``hacking_proxy_rise`` while lowering real retention by
    more than ``hacking_real_drop``. With fewer than ``guard_min_sessions`` finite rows for either
    version the guard cannot decide: the report is not flagged and its reason says so.
    """
    frame = per_session[per_session["policy_version"].isin([incumbent, candidate])].copy()
    frame["proxy"] = pd.to_numeric(frame["proxy"], errors="coerce")
    frame["real"] = pd.to_numeric(frame["real"], errors="coerce")
    frame = frame[np.isfinite(frame["proxy"]) & np.isfinite(frame["real"])]
    counts = frame["policy_version"].value_counts()
    short = {v: int(counts.get(v, 0)) for v in (incumbent, candidate) if counts.get(v, 0) < config.guard_min_sessions}
    if short:
        have = ", ".join(f"{v}: {n}" for v, n in short.items())
        return HackingReport(
            False,
            f"too little data to judge reward hacking, not blocking ({have} sessions with final retention, "
            f"need {config.guard_min_sessions} per version)",
        )
    frame["order"] = (frame["policy_version"] == candidate).astype(int)
    return reward_hacking(frame, config)
