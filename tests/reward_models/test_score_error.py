"""The pairwise head's user-fold members (``RewardsConfig.error_folds``): each fitted without one fold of the
choosing users' pairs, their spread is the selection score's error over users; off, capped or pickled before
members existed, the head adds no error."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd

from reward_models.config import RewardsConfig
from reward_models.models import RewardBundle, SklearnPairwise

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


def _pairs(n_users: int, per_user: int, seed: int) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Two candidates per pick; each user prefers answers holding their own favourite word (users disagree)."""
    rng = np.random.default_rng(seed)
    rows, chosen, rejected = [], [], []
    for u in range(n_users):
        favourite = WORDS[u % len(WORDS)]
        for _ in range(per_user):
            other = WORDS[rng.integers(len(WORDS))]
            for text in (f"x = {favourite}", f"x = {other}"):
                rows.append({"user_id": f"u{u}", "prompt_text": "p", "completion_text": text})
            chosen.append(len(rows) - 2)
            rejected.append(len(rows) - 1)
    frame = pd.DataFrame(rows).assign(lines_added=0, lines_removed=0, num_completion_tokens=3, mean_logprob=-0.5)
    return frame, np.array(chosen), np.array(rejected)


def test_members_leave_out_users_and_their_spread_is_the_heads_error() -> None:
    frame, chosen, rejected = _pairs(n_users=8, per_user=6, seed=0)
    head = SklearnPairwise(RewardsConfig()).fit(frame, chosen, rejected, np.ones(len(chosen)))
    assert len(head.members_) == 4
    members = head.member_scores(frame)
    assert members.shape == (4, len(frame))
    spread = members.std(axis=0)
    assert np.all(np.isfinite(spread)) and spread.mean() > 0.05  # users disagree: so do models without some of them
    bundle = RewardBundle(heads={"selection": head}, weights={"selection": 1.0})
    score, error = bundle.score_with_error(frame)
    assert np.array_equal(score, head.score(frame))
    np.testing.assert_allclose(error, np.sqrt(3) * spread, rtol=1e-9)
    # users who agree (all prefer the same word) leave the members close together
    same = frame.copy()
    same.loc[chosen, "completion_text"] = "x = alpha"
    same.loc[rejected, "completion_text"] = "x = beta"
    steady = SklearnPairwise(RewardsConfig()).fit(same, chosen, rejected, np.ones(len(chosen)))
    assert steady.member_scores(same).std(axis=0).mean() < 0.5 * spread.mean()


def test_no_members_when_off_over_the_cap_with_one_user_or_pickled_before() -> None:
    frame, chosen, rejected = _pairs(n_users=8, per_user=6, seed=1)
    w = np.ones(len(chosen))
    for config in (RewardsConfig(error_folds=0), RewardsConfig(error_max_pairs=len(chosen) - 1)):
        head = SklearnPairwise(config).fit(frame, chosen, rejected, w)
        assert head.members_ == [] and np.array_equal(head.member_scores(frame), head.score(frame)[None, :])
    one_user = frame.assign(user_id="u0")
    by_pair = SklearnPairwise(RewardsConfig()).fit(one_user, chosen, rejected, w)
    assert len(by_pair.members_) == 4  # one user: the folds fall back to single pairs (the text model's rule)
    head = SklearnPairwise(RewardsConfig()).fit(frame, chosen, rejected, w)
    old = pickle.loads(pickle.dumps(head))
    del old.members_
    assert np.array_equal(old.member_scores(frame), head.score(frame)[None, :])
    bundle = RewardBundle(heads={"selection": old}, weights={"selection": 1.0})
    assert np.array_equal(bundle.score_with_error(frame)[1], np.zeros(len(frame)))
