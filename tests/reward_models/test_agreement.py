"""``reward_models.agreement``: a candidate's agreement with its group, and the text model that uses it
to rank candidates of tasks it never saw (where its n-grams cannot help)."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pandas as pd
import pytest

from reward_models.agreement import COLUMN, group_agreement, with_group_agreement
from reward_models.text_model import NUMERIC, TextRewardModel


def test_agreement_is_the_mean_similarity_to_the_other_members() -> None:
    frame = pd.DataFrame(
        {
            "group_id": ["a", "a", "a", "b", "b", None, "c", None],
            "agent_group": [None, None, None, None, None, None, None, "t"],
            "completion_text": ["return x + 1", "return x + 1", "return y * 2", "foo", "bar", "zzz", "solo", "x"],
        }
    )
    out = group_agreement(frame)
    assert out[0] == out[1] and out[1] > out[2] > 0  # the two identical answers agree the most
    assert out[0] == pytest.approx((1.0 + out[2]) / 2)  # (sim(0,1) + sim(0,2)) / 2, and out[2] = sim(0,2)
    assert out[3] == out[4] == 0.0  # nothing in common
    assert np.isnan(out[5:]).all()  # no group, alone in its group, alone in its agent group
    shuffled = frame.sample(frac=1.0, random_state=3)
    assert np.allclose(group_agreement(shuffled), out[shuffled.index.to_numpy()], equal_nan=True)
    assert np.allclose(group_agreement(frame, chunk_rows=1), out, equal_nan=True)
    assert list(with_group_agreement(frame)[COLUMN].fillna(-1)) == list(np.nan_to_num(out, nan=-1))
    parallel = frame.assign(group_id=None, agent_group=["a", "a", "a", "b", "b", None, "c", None])
    assert np.allclose(group_agreement(parallel), out, equal_nan=True)  # parallel agent sessions too


def test_hostile_texts_and_empty_frames() -> None:
    assert group_agreement(pd.DataFrame()).shape == (0,)
    frame = pd.DataFrame({"group_id": ["g"] * 4, "completion_text": [None, float("nan"), "x" * 10**6, b"bytes"]})
    out = group_agreement(frame)
    assert out.shape == (4,) and np.isfinite(out).all()


def _answer(task: int, rng: random.Random) -> str:
    op, k, c = rng.choice("+-*"), rng.randrange(5), rng.randrange(1, 50)
    return f"def f{task}(v):\n    return sorted(v)[{k}] {op} {c}\n"


def _groups(tasks: range, rng: random.Random, user: str) -> pd.DataFrame:
    """Groups of 4 where the right answer (kept) is the one most candidates give and each wrong one is
    another draw of the same template: right and wrong answers share every n-gram distribution."""
    rows = []
    for t in tasks:
        right = _answer(t, rng)
        n_right = rng.choice([2, 3])
        texts = [right] * n_right + [_answer(t, rng) for _ in range(4 - n_right)]
        rng.shuffle(texts)
        for i, text in enumerate(texts):
            rows.append(
                {
                    "session_id": f"{user}-{t}-{i}",
                    "user_id": f"{user}{t % 7}",
                    "group_id": f"g{t}",
                    "prompt_text": f"task {t}",
                    "completion_text": text,
                    "num_completion_tokens": len(text.split()),
                    "label": int(text == right),
                }
            )
    return pd.DataFrame(rows)


def _pairwise(frame: pd.DataFrame, scores: np.ndarray) -> float:
    """Share of (kept, not kept) pairs within a group that ``scores`` order right."""
    pairs = [
        float(a > b)
        for _, g in frame.assign(score=scores).groupby("group_id")
        for a in g.loc[g["label"] == 1, "score"]
        for b in g.loc[g["label"] == 0, "score"]
    ]
    return float(np.mean(pairs))


def test_the_text_model_ranks_unseen_tasks_by_agreement() -> None:
    rng = random.Random(0)
    train, test = _groups(range(0, 120), rng, "u"), _groups(range(1000, 1060), rng, "w")
    model = TextRewardModel(folds=3).fit(train, train["label"].to_numpy())
    scores = model.score(test)
    assert _pairwise(test, scores) > 0.9
    blind = TextRewardModel(folds=3)
    blind.features.agreement = False
    assert _pairwise(test, blind.fit(train, train["label"].to_numpy()).score(test)) < 0.65  # n-grams alone
    given = model.score(with_group_agreement(test))
    assert np.allclose(given, scores)  # the column, when the frame carries it, is the same feature
    # features pickled before the column existed (no attribute) keep their own width
    old = pickle.loads(pickle.dumps(model.features))
    del old.agreement
    old.fill_ = old.fill_[:-1]
    assert old.design(test).numeric.shape == (len(test), len(NUMERIC) - 1)
    assert model.features.design(test).numeric.shape == (len(test), len(NUMERIC))
