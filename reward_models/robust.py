"""Per-user caps on training weight, so that no single user (or a few) can move a reward model much.

An account that is served many sessions and then sends adversarial signals about all of them
(accepting bad code, rejecting good code) would otherwise weigh in proportion to its volume. Each
head therefore weighs its rows (sessions, or selection pairs) so that one user's rows together
carry at most ``max_share`` of the head's total training weight:

- shares are measured on the rows' base weights (1 per session; the inverse display-position
  propensity per pair), summed per user;
- water-filling: every user whose total exceeds a level ``T`` is scaled down to ``T``, lighter
  users keep theirs, and ``T`` is the level at which the capped users hold exactly ``max_share``
  each; then all weights are scaled so that their sum is unchanged (the mean weight stays what
  the learner expects);
- the cap is ``max(max_share, 1 / users)``: with fewer than ``1 / max_share`` users the best any
  cap can do is equal shares, and a model trained on few users stays usable;
- rows without a user id form one pool (leaving the user out does not escape the cap);
- ``max_share >= 1`` returns the base weights unchanged: the defense is off.

Nobody under the cap is touched except by the common rescaling, and when nobody exceeds the
cap the base weights come back exactly. The result is a pure, deterministic function of its inputs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

ANONYMOUS = "\x00anonymous"
"""The pool of rows without a user id."""


def user_keys(user_ids: np.ndarray | pd.Series | list[object]) -> np.ndarray:
    """User ids as strings, missing ones (None, NaN, empty) as :data:`ANONYMOUS`."""
    values = pd.Series(np.asarray(user_ids, dtype=object), dtype=object)
    missing = values.isna() | (values.astype(str) == "")
    return np.asarray(values.astype(str).where(~missing, ANONYMOUS), dtype=object)


def capped_totals(totals: np.ndarray, max_share: float) -> np.ndarray:
    """Water-filling: ``min(total_u, T)`` with ``T`` the level at which no user holds more than the cap.

    ``totals`` are the users' (positive) weight sums; the cap is ``max(max_share, 1 / len(totals))``.
    Returns the new totals (their sum is not preserved; shares are what is capped).
    """
    totals = np.asarray(totals, dtype=np.float64)
    n = len(totals)
    if n == 0 or max_share >= 1.0:
        return totals.copy()
    cap = max(float(max_share), 1.0 / n)
    whole = float(totals.sum())
    if whole <= 0.0 or float(totals.max()) <= cap * whole:
        return totals.copy()
    ordered = np.sort(totals)[::-1]
    rest = whole - np.cumsum(ordered)  # weight of the users below the k heaviest
    level = float(ordered[-1])  # all capped at the smallest: equal shares (cap == 1 / n)
    for k in range(1, n):
        if cap * k >= 1.0:
            break
        candidate = cap * float(rest[k - 1]) / (1.0 - cap * k)
        if candidate >= ordered[k]:  # the first such k: then also candidate < ordered[k - 1]
            level = candidate
            break
    return np.minimum(totals, level)


def user_weights(user_ids: np.ndarray, max_share: float, base: np.ndarray | None = None) -> np.ndarray:
    """Row weights under which no user carries more than ``max_share`` of the total (see module docstring).

    ``user_ids``: one per row (None for unknown); ``base``: the rows' weights before the cap
    (ones when None). The returned weights sum to ``base.sum()``; with ``max_share >= 1`` or when
    nobody exceeds the cap they equal ``base``.
    """
    n = len(user_ids)
    weights = np.ones(n) if base is None else np.asarray(base, dtype=np.float64).copy()
    if len(weights) != n:
        raise ValueError(f"{n} user ids but {len(weights)} base weights")
    if n == 0 or max_share >= 1.0:
        return weights
    if max_share <= 0.0:
        raise ValueError("max_share must be positive")
    users, which = np.unique(user_keys(user_ids), return_inverse=True)
    totals = np.bincount(which, weights=weights, minlength=len(users))
    active = totals > 0
    if active.sum() == 0:
        return weights
    capped = totals.copy()
    capped[active] = capped_totals(totals[active], max_share)
    if np.array_equal(capped, totals):
        return weights
    scale = np.divide(capped, totals, out=np.ones_like(totals), where=totals > 0)
    out = weights * scale[which]
    return out * (float(weights.sum()) / float(out.sum()))


def user_shares(user_ids: np.ndarray, weights: np.ndarray) -> pd.Series:
    """Each user's share of the total weight, heaviest first (for reports and tests)."""
    keys = user_keys(user_ids)
    total = float(np.sum(weights))
    sums = pd.Series(np.asarray(weights, dtype=np.float64), index=keys).groupby(level=0).sum()
    return (sums / (total if total > 0 else 1.0)).sort_values(ascending=False, kind="stable")
