"""The text reward model: it learns a text signal that holds for unseen users, its probabilities are
calibrated, and hostile or missing input (empty, huge, undecodable text, no logprobs) never breaks it."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer

from reward_models import evaluation as ev
from reward_models.config import RewardsConfig
from reward_models.data import session_records, signal_records
from reward_models.models import RewardBundle, SklearnPointwise, setup_pointwise
from reward_models.synthetic import generate_events
from reward_models.text_model import TextRewardModel, TfidfBlock
from reward_models.train import fit_reward_models

GOOD = ["sorted", "enumerate", "return", "isinstance", "yield", "dict", "zip", "with"]
BAD = ["TODO", "pass", "eval", "global", "except:", "print", "sleep", "exit"]
FILLER = [f"name{i}" for i in range(300)] + ["x", "y", "=", "(", ")", ":", "+", "for", "in", "if"]


def sessions(n: int, seed: int, users: int = 60) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """``n`` distinct answers: a label drawn from how many good and bad markers the answer holds.

    Returns the frame, the labels and the true probabilities. Every answer's filler is random, so no
    two texts repeat: a model can only score a held-out user's answer by the markers.
    """
    rng = np.random.default_rng(seed)
    texts, logits = [], []
    for _ in range(n):
        good, bad = rng.integers(0, 4), rng.integers(0, 4)
        words = list(rng.choice(FILLER, 25)) + list(rng.choice(GOOD, good)) + list(rng.choice(BAD, bad))
        rng.shuffle(words)
        texts.append("def f(x):\n    " + " ".join(words) + "\n")
        logits.append(1.5 * (good - bad))
    prob = 1.0 / (1.0 + np.exp(-np.asarray(logits)))
    y = (rng.random(n) < prob).astype(int)
    frame = pd.DataFrame(
        {
            "session_id": [f"s{seed}-{i}" for i in range(n)],
            "user_id": [f"u{seed}-{i % users}" for i in range(n)],
            "prompt_text": rng.choice(["Write f.", "Please implement f(x).", "f, quickly"], n),
            "completion_text": texts,
            "num_completion_tokens": [len(t.split()) for t in texts],
            "mean_logprob": rng.normal(-0.5, 0.2, n),
            "logprob_min": rng.normal(-4.0, 1.0, n),
            "logprob_std": rng.uniform(0.3, 1.0, n),
        }
    )
    return frame, y, prob


def test_learns_a_text_signal_that_holds_for_unseen_users() -> None:
    train, y_train, _ = sessions(1500, seed=1)
    test, y_test, prob = sessions(600, seed=2)  # other users, other answers
    assert not set(train["user_id"]) & set(test["user_id"])
    model = TextRewardModel().fit(train, y_train)
    auc = ev.auc(y_test, model.score(test)) or 0.0
    best = ev.auc(y_test, prob) or 0.0  # what the true probabilities reach on these labels
    assert auc > 0.8 and auc > best - 0.06, (auc, best)
    assert (ev.auc(y_test, test["mean_logprob"].to_numpy()) or 0.0) < 0.6  # the logprobs carry nothing here
    # The same data with the labels shuffled teaches nothing that holds for the held-out users.
    shuffled = TextRewardModel().fit(train, np.random.default_rng(0).permutation(y_train))
    assert abs((ev.auc(y_test, shuffled.score(test)) or 0.5) - 0.5) < 0.08


def test_probabilities_are_calibrated() -> None:
    train, y_train, _ = sessions(3000, seed=3)
    test, y_test, prob = sessions(3000, seed=4)
    p = TextRewardModel().fit(train, y_train).predict_proba(test)
    ece = ev.expected_calibration_error(y_test, p) or 1.0
    floor = ev.expected_calibration_error(y_test, prob) or 0.0  # the true probabilities' ECE at this size
    assert ece < 0.05 and ece < floor + 0.03, (ece, floor)
    assert abs(p.mean() - y_test.mean()) < 0.03


def test_served_logprobs_are_used_where_they_exist_and_missing_ones_are_imputed() -> None:
    frame, _, _ = sessions(1600, seed=5)
    rng = np.random.default_rng(5)
    frame["mean_logprob"] = rng.normal(-0.5, 0.3, len(frame))
    y = (rng.random(len(frame)) < 1 / (1 + np.exp(-6 * (frame["mean_logprob"] + 0.5)))).astype(int)
    missing = rng.random(len(frame)) < 0.3
    frame.loc[missing, ["mean_logprob", "logprob_min", "logprob_std"]] = np.nan
    train, test = frame.index < 1200, frame.index >= 1200
    model = TextRewardModel().fit(frame[train], y[train])
    scores = model.score(frame[test])
    assert np.all(np.isfinite(scores))
    known = ~missing[test]
    assert (ev.auc(y[test][known], scores[known]) or 0.0) > 0.75
    # Without any logprob column at all (a client that sends none), scoring still works.
    bare = frame[test].drop(columns=["mean_logprob", "logprob_min", "logprob_std"])
    assert np.all(np.isfinite(model.score(bare)))


def test_empty_huge_and_undecodable_text() -> None:
    frame, y, _ = sessions(400, seed=6)
    model = TextRewardModel(max_chars=5000).fit(frame, y)
    hostile = pd.DataFrame(
        {
            "completion_text": [
                "",
                None,
                float("nan"),
                "def f(x):\n    return sorted(x)\n" + "x" * 5_000_000,
                b"def f(x):\xff\xfe return x",
                "bad \udcff surrogate \x00 nul",
                "\n\n\n",
                12345,
            ],
            "prompt_text": [None, "", "p", "q" * 1_000_000, b"\x80", "\udcff", "ok", None],
        }
    )
    scores = model.score(hostile)
    assert scores.shape == (len(hostile),) and np.all(np.isfinite(scores))
    assert model.score(hostile.iloc[:0]).shape == (0,)
    # Training on rows with empty or missing text works too: they are rows without terms.
    mixed = pd.concat([frame, hostile.assign(user_id="h")], ignore_index=True)
    labels = np.concatenate([y, np.zeros(len(hostile), dtype=int)])
    assert np.all(np.isfinite(TextRewardModel().fit(mixed, labels).score(mixed)))


def test_bad_labels_and_weights_are_clear_errors() -> None:
    frame, y, _ = sessions(100, seed=7)
    with pytest.raises(ValueError, match="both classes"):
        TextRewardModel().fit(frame, np.ones(len(frame), dtype=int))
    with pytest.raises(ValueError, match="both classes"):
        TextRewardModel().fit(frame, y, np.where(y == 1, 0.0, 1.0))  # positives all weigh nothing
    with pytest.raises(ValueError, match="must match"):
        TextRewardModel().fit(frame, y[:-1])
    with pytest.raises(ValueError, match="non-negative"):
        TextRewardModel().fit(frame, y, -np.ones(len(frame)))
    with pytest.raises(ValueError, match="c_grid"):
        TextRewardModel(c_grid=[])


def test_tfidf_over_distinct_texts_equals_scikit_learn_over_every_row() -> None:
    texts = pd.Series(["a b c", "a b", "a b c", "", "c d e f", "a b c", "d e"], dtype=object)
    codes, distinct = pd.factorize(texts)
    copies = np.bincount(codes).astype(float)
    for analyzer, ngrams in (("word", (1, 2)), ("char_wb", (2, 4))):
        block = TfidfBlock(analyzer, ngrams, min_df=2)
        ours = block.fit_transform(np.asarray(distinct, dtype=object), copies)[codes]
        reference = TfidfVectorizer(
            analyzer=analyzer,
            ngram_range=ngrams,
            min_df=2,
            sublinear_tf=True,
            token_pattern=r"(?u)\b\w+\b|[^\w\s]" if analyzer == "word" else None,
        )
        expected = reference.fit_transform(texts)
        order = [block.vocabulary_[t] for t in reference.get_feature_names_out()]
        assert np.allclose(ours[:, order].toarray(), expected.toarray())


def test_the_default_heads_are_the_text_model_and_survive_the_registry_pickle() -> None:
    start = datetime(2026, 1, 5, tzinfo=UTC)
    now = start + timedelta(days=9)
    events, _ = generate_events(500, seed=8, start=start, span_s=6 * 86400.0, now=now)
    sessions_frame = session_records([e for e in events if e["type"] == "session.completed"])
    fit = fit_reward_models(sessions_frame, signal_records(events), RewardsConfig(), now)
    assert isinstance(fit.bundle.heads["retention"], TextRewardModel)
    assert isinstance(setup_pointwise(RewardsConfig(pointwise_model="hashed")), SklearnPointwise)
    restored = pickle.loads(pickle.dumps(fit.bundle))
    held = fit.test.reset_index()
    assert np.array_equal(restored.score(held), fit.bundle.score(held))
    assert fit.metrics["retention"]["auc"] > fit.metrics["retention"]["auc_logprob"]


def test_the_fold_members_center_on_the_score_and_disagree_where_one_user_taught_it() -> None:
    """Each user fold's text model through its own combiner: their mean is close to the score, and their
    spread is large only where the score rests on a few users: a marker one user alone labeled."""
    train, y, _ = sessions(1500, seed=1)
    one = (train["user_id"] == train["user_id"].iloc[0]).to_numpy()
    train.loc[one, "completion_text"] = train.loc[one, "completion_text"] + " zebra zebra\n"
    y = np.where(one, 1, y)
    model = TextRewardModel().fit(train, y)
    test, _, _ = sessions(300, seed=2)
    members = model.member_scores(test)
    assert members.shape == (4, 300) and len(model.fold_combiners_) == 4
    assert np.mean(np.abs(members.mean(axis=0) - model.score(test))) < 0.05 * np.std(model.score(test))
    marked = test.assign(completion_text=test["completion_text"] + " zebra zebra\n")
    plain_spread, marked_spread = members.std(axis=0), model.member_scores(marked).std(axis=0)
    assert np.median(marked_spread) > 3 * np.median(plain_spread), (np.median(marked_spread), np.median(plain_spread))
    bundle = RewardBundle(heads={"retention": model}, weights={"retention": 1.0})
    score, error = bundle.score_with_error(marked)
    assert np.array_equal(score, bundle.score(marked))
    np.testing.assert_allclose(error, np.sqrt(3) * marked_spread, rtol=1e-9)  # jackknife: sqrt(M - 1) x spread
    assert bundle.score_with_error(marked.iloc[:0])[1].shape == (0,)


def test_the_error_grows_where_a_numeric_column_leaves_the_range_users_labeled() -> None:
    """Labels that follow the served confidence alone: the combiners' slopes differ a little from fold to
    fold, so an answer served far more confidently than any labeled one has a wider error than a typical one
    (what a policy that sharpens itself to please the model would produce)."""
    frame, _, _ = sessions(1200, seed=6)
    rng = np.random.default_rng(6)
    y = (rng.random(len(frame)) < 1 / (1 + np.exp(-6 * (frame["mean_logprob"] + 0.5)))).astype(int)
    model = TextRewardModel().fit(frame, y)
    test, _, _ = sessions(200, seed=7)
    bundle = RewardBundle(heads={"retention": model}, weights={"retention": 1.0})
    typical = bundle.score_with_error(test.assign(mean_logprob=-0.5))[1]
    sharp = bundle.score_with_error(test.assign(mean_logprob=-0.01))[1]  # 2.5 standard deviations out
    assert np.median(sharp) > 1.5 * np.median(typical), (np.median(sharp), np.median(typical))


def test_a_model_refitted_on_every_row_keeps_its_folds_for_the_error_and_a_foldless_head_has_none() -> None:
    train, y, _ = sessions(400, seed=3)
    train = train.assign(lines_added=0, lines_removed=0)  # what the hashed head reads besides the text
    refit = TextRewardModel(cv_max_rows=100).fit(train, y)  # the search on a sample, one model on all rows
    test = sessions(50, seed=4)[0].assign(lines_added=0, lines_removed=0)
    assert len(refit.text_models_) == 1 and refit.member_scores(test).shape == (4, 50)
    alone = RewardBundle(heads={"retention": refit}, weights={"retention": 1.0})
    score, error = alone.score_with_error(test)
    assert np.array_equal(score, refit.score(test)) and np.all(error > 0)
    old = pickle.loads(pickle.dumps(refit))
    del old.fold_models_, old.fold_combiners_  # as pickled before the folds were kept: the one score, no error
    assert np.array_equal(old.member_scores(test), refit.score(test)[None, :])
    hashed = SklearnPointwise(RewardsConfig()).fit(train, y)
    assert np.array_equal(RewardBundle(heads={"a": hashed}, weights={"a": 1.0}).score_with_error(test)[1], np.zeros(50))
    both = RewardBundle(heads={"retention": refit, "acceptance": hashed}, weights={"retention": 0.5, "acceptance": 0.5})
    np.testing.assert_allclose(both.score_with_error(test)[1], 0.5 * error, rtol=1e-9)  # weight 1/2, errors add


def test_term_cap_keeps_the_most_frequent_terms() -> None:
    texts = np.array(["a b c", "a b", "a", "d", "a d"], dtype=object)
    block = TfidfBlock("word", (1, 1), min_df=1, max_terms=2)
    matrix = block.fit_transform(texts, np.ones(len(texts)))
    assert set(block.vocabulary_) == {"a", "b"} or set(block.vocabulary_) == {"a", "d"}  # df: a 4, b 2, d 2, c 1
    assert matrix.shape == (len(texts), 2) and block.transform(np.array(["c c c"], dtype=object)).nnz == 0


def _agent_turns(n: int, seed: int) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Agent turns whose outcome follows the newest verdict in their conversation, not any verdict.

    Every conversation holds two or three tool verdicts drawn at random, so its words say nothing
    about which came last; the answer's text is random filler. Returns the frame, the labels and
    each row's newest verdict (0 failed, 1 passed, 2 kept).
    """
    rng = np.random.default_rng(seed)
    reports = [
        '{"passed": false, "kept": false, "tests": 6}',
        '{"passed": true, "kept": false, "tests": 6}',
        '{"passed": true, "kept": true, "tests": 6}',
    ]
    newest = rng.integers(0, 3, n)
    prompts, texts = [], []
    for last in newest:
        earlier = list(rng.integers(0, 3, int(rng.integers(1, 3))))
        lines = ["system: Coding agent.", "user: Write the body of f."]
        for verdict in [*earlier, last]:
            lines += ["assistant calls run_tests(...)", "tool: " + reports[verdict]]
        prompts.append("\n".join(lines))
        texts.append("assistant calls submit() " + " ".join(rng.choice(FILLER, 8)))
    y = (rng.random(n) < np.array([0.1, 0.5, 0.9])[newest]).astype(int)
    return _turns(f"a{seed}", seed, prompts, texts, tokens=12), y, newest


def _turns(tag: str, seed: int, prompts: list[str], texts: list[str], tokens: int) -> pd.DataFrame:
    """Session rows of (request, answer) pairs from 40 users, without served logprobs."""
    return pd.DataFrame(
        {
            "session_id": [f"{tag}-{i}" for i in range(len(texts))],
            "user_id": [f"u{seed}-{i % 40}" for i in range(len(texts))],
            "prompt_text": prompts,
            "completion_text": texts,
            "num_completion_tokens": tokens,
        }
    )


def test_the_newest_tool_verdict_in_the_conversation_is_read() -> None:
    train, y_train, _ = _agent_turns(1200, seed=11)
    test, y_test, newest = _agent_turns(600, seed=12)
    scores = TextRewardModel().fit(train, y_train).score(test)
    means = [scores[newest == v].mean() for v in range(3)]
    assert means[0] < means[1] < means[2], means
    truth = np.array([0.1, 0.5, 0.9])[newest]
    assert (ev.auc(y_test, scores) or 0.0) > (ev.auc(y_test, truth) or 1.0) - 0.03

    # Without the verdict columns (the words of the conversation alone), the newest is not known.
    def words(frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(prompt_text=frame["prompt_text"].str.replace("tool: ", "tool "))

    blind = TextRewardModel().fit(words(train), y_train).score(words(test))
    assert (ev.auc(y_test, blind) or 0.0) < (ev.auc(y_test, scores) or 0.0) - 0.1


def test_a_model_fitted_before_the_verdict_columns_still_scores() -> None:
    frame, y, _ = sessions(600, seed=13)
    model = TextRewardModel().fit(frame, y)
    before = model.score(frame)
    # What a model pickled before the three verdict columns joined holds: ten numeric columns.
    old = pickle.loads(pickle.dumps(model))
    old.features.fill_, old.mean_, old.std_ = old.features.fill_[:10], old.mean_[:10], old.std_[:10]
    assert old.combiner_ is not None
    old.combiner_.coef_ = old.combiner_.coef_[:, :11]
    old.combiner_.n_features_in_ = 11
    after = old.score(frame.assign(prompt_text="tool: " + '{"passed": true}'))
    assert after.shape == before.shape and np.all(np.isfinite(after))
    # Without a verdict in any prompt, the new columns are constant: the old model scores the same.
    assert np.allclose(old.score(frame), before, atol=1e-6)


def _constant_tasks(n: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """Requests that state two constants, answers that use them or swap one for another number.

    The constants are drawn afresh for every row, so no term of the answer or the request tells a
    right answer from a wrong one; only the answer read against its request does. A right answer is
    kept 90% of the time, a wrong one 10%.
    """
    rng = np.random.default_rng(seed)
    prompts, texts, right = [], [], []
    for _ in range(n):
        a, b, other = (int(v) for v in rng.choice(np.arange(2, 90), 3, replace=False))
        ok = bool(rng.random() < 0.5)
        prompts.append(f"# return x plus {a} times {b}\ndef f(x):\n")
        texts.append(
            f"    return x + {a} * {b if ok else other}\n"
            if rng.random() < 0.5
            else f"    y = {b if ok else other} * {a}\n    return x + y\n"
        )
        right.append(ok)
    y = (rng.random(n) < np.where(right, 0.9, 0.1)).astype(int)
    return _turns(f"c{seed}", seed, prompts, texts, tokens=10), y


def test_an_answer_is_read_against_the_numbers_its_request_states() -> None:
    train, y_train = _constant_tasks(1200, seed=21)
    test, y_test = _constant_tasks(600, seed=22)
    auc = ev.auc(y_test, TextRewardModel().fit(train, y_train).score(test)) or 0.0
    assert auc > 0.8, auc  # the truth reaches about 0.9 on these labels

    # With the request's numbers spelled out of reach, the same model has only the terms: chance.
    def unstated(frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(prompt_text=frame["prompt_text"].str.replace(r"\d", "#", regex=True))

    blind = TextRewardModel().fit(unstated(train), y_train).score(unstated(test))
    assert abs((ev.auc(y_test, blind) or 0.5) - 0.5) < 0.1
