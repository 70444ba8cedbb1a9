"""The acceptance the deployment gate compares, and a test of its drop that respects users.

:func:`robust_mean`: each user's signals are averaged first, a user weighs ``min(signals, cap)``
(one account sending many signals weighs no more than ``cap`` honest ones), then the ``trim`` share
of users with the highest means and the same share with the lowest (at least one each from five
users on; among users tied at an extreme, the heaviest first) are left out. ``cap`` 0: the plain
mean of all signals.

On a canary judged by a handful of users that mean is biased: most users' means are 0 or 1, and
trimming one user at each end of five removes a lone acceptor (or a lone rejecter), so a canary
where one user of five accepted shows 0. A normal approximation over sessions then calls an
ordinary sample a collapse. :func:`drop_p_value` asks the question of the statistic actually used:
users are the exchangeable unit, so under "both versions are accepted alike" any split of the pooled
users into a canary-sized group and the rest is as likely as the observed one. The p-value is the
share of random splits whose drop of the robust mean is at least the observed drop (a one-sided
permutation test; Good, "Permutation, Parametric and Bootstrap Tests of Hypotheses", 2005); within
kinds of traffic (:func:`stratified_drop_p_value`) users are split within each kind and the drops
weighed as the gate weighs them. The permutations are seeded, so a decision can be replayed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

User = Sequence[float]
"""One user's ``(sum of signal values, number of signals)``."""

RESAMPLES = 1000
"""Random splits per test: the p-value's own error is about 0.007 at the gate's level (p = 0.05)."""


def robust_mean(users: Sequence[User], cap: int, trim: float) -> float | None:
    """The robust acceptance of ``users`` (see the module docstring); None without any signal."""
    judged = sum(count for _, count in users)
    if not judged:
        return None
    if cap <= 0:
        return sum(total for total, _ in users) / judged
    rows = [(total / count, min(count, cap)) for total, count in users if count]
    k = max(1, math.floor(trim * len(rows))) if len(rows) >= 5 else 0
    if k:  # among users tied at an extreme, the heaviest go first
        rows = sorted(rows, key=lambda u: (u[0], -u[1]))[k:]
        rows = sorted(rows, key=lambda u: (u[0], u[1]))[:-k]
    return sum(mean * w for mean, w in rows) / sum(w for _, w in rows)


def _drop(old: Sequence[User], new: Sequence[User], cap: int, trim: float) -> float:
    a, b = robust_mean(old, cap, trim), robust_mean(new, cap, trim)
    return 0.0 if a is None or b is None else a - b


def drop_p_value(
    new: Sequence[User], old: Sequence[User], cap: int, trim: float, *, seed: int = 0, resamples: int = RESAMPLES
) -> float:
    """One-sided p-value of the observed drop ``robust(old) - robust(new)`` under exchangeable users."""
    return stratified_drop_p_value({"all": new}, {"all": old}, {"all": 1.0}, cap, trim, seed=seed, resamples=resamples)


def stratified_drop_p_value(
    new: Mapping[str, Sequence[User]],
    old: Mapping[str, Sequence[User]],
    weights: Mapping[str, float],
    cap: int,
    trim: float,
    *,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> float:
    """One-sided p-value of the weighted drop ``sum_k w_k (robust(old_k) - robust(new_k))`` over the
    kinds in ``weights``, users split at random within each kind."""
    kinds = [k for k in sorted(weights) if new.get(k) and old.get(k)]
    if not kinds:
        raise ValueError("drop_p_value needs users on both sides of at least one kind")

    def statistic(split: Mapping[str, tuple[Sequence[User], Sequence[User]]]) -> float:
        return sum(weights[k] * _drop(split[k][1], split[k][0], cap, trim) for k in kinds)

    observed = statistic({k: (new[k], old[k]) for k in kinds})
    rng = random.Random(seed)
    pooled = {k: [*new[k], *old[k]] for k in kinds}
    at_least = 0
    for _ in range(resamples):
        split = {}
        for k in kinds:
            users = pooled[k][:]
            rng.shuffle(users)
            split[k] = (users[: len(new[k])], users[len(new[k]) :])
        at_least += statistic(split) >= observed - 1e-12
    return (1 + at_least) / (1 + resamples)
