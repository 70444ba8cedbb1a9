"""The text reward model: word and character n-gram TF-IDF plus numeric features, a linear model, calibrated.

Features (:class:`TextFeatures`, fitted on the training rows only):

- the response (``completion_text``): word unigrams and bigrams (words and punctuation marks as
  tokens) and character 2-5-grams within word boundaries (``char_wb``), each TF-IDF with sublinear
  term frequency (``1 + log tf``), smoothed idf and unit-length rows, terms in at least ``min_df``
  training rows;
- the request (``prompt_text``): word unigrams and bigrams, the same way, scaled by
  :data:`PROMPT_WEIGHT` (context helps a little; the answer is what is judged);
- numeric columns, standardized: log lengths (characters, lines, tokens, prompt characters), whether
  the response holds a fenced code block and which share of it is code, and the served token
  logprobs' mean, min and standard deviation with a missing indicator (missing ones take the
  training median, never a raw NaN), and the execution feedback in the request: whether the newest
  tool verdict report in it (:func:`reward_models.verdicts.last_report`: an agent's ``run_tests``
  answer) passed and was kept, with an indicator for none; and the answer's grounding in the request
  (:mod:`reward_models.literals`): the share of the request's numbers the answer uses, the share of
  its own numbers the request never stated, and whether the request states none. A model fitted
  before a group of columns existed is scored without it (new columns are appended). Edit
  statistics (``lines_added``) are left out: on the synthetic data they are a function of the
  label, and in production they describe what the user did with the answer more than the answer
  itself.

Texts are cut to ``max_chars`` (the start is kept) so one huge response cannot blow up time or
memory; anything that is not a string (None, NaN, bytes) becomes text first. Each distinct
(response, prompt) pair is featurized once, and the TF-IDF equals scikit-learn's ``TfidfVectorizer``
over every row.

Model, in two linear stages:

1. Text: L2-regularized logistic regression (liblinear) on the TF-IDF blocks, each distinct pair
   one term per class carrying its rows' summed weight (the same loss as one term per row, so a
   million sessions of a few thousand texts train in seconds). ``C`` comes from ``c_grid`` by inner
   cross-validation grouped by user (``GroupKFold``; rows without a user are their own group; with
   fewer users than ``folds``, by row): the highest pooled out-of-fold AUC, weighted by the sample
   weights. Above ``cv_max_rows`` rows the search runs on a seeded sample of that many rows and the
   text model is refitted on all of them; otherwise the fold models of the chosen ``C`` are kept and
   their scores averaged (as ``CalibratedClassifierCV`` does), so the next stage sees exactly the
   kind of score it will get.
2. Combination and calibration: a logistic regression (``C = 1``) of the label on the chosen ``C``'s
   out-of-fold text score and the standardized numeric columns. Fitted on scores of rows their text
   model never trained on, it is Platt scaling (Platt 1999) with the numeric features beside it, and
   :meth:`TextRewardModel.score` is a calibrated log-odds. A negative weight on the text score (a
   text ranking that fails on other users, as when one account floods inverted labels) is refused:
   the combination is refitted without it.
3. Members for the score's error: the chosen ``C``'s user-fold text models, each with a combination
   fitted without its fold's rows (:meth:`TextRewardModel.member_scores`); their spread is how much
   the score depends on which users trained it (``RewardBundle.score_with_error``).

Left out: isotonic calibration (its ties cost AUC, and a few hundred labels are too few for it),
the served model's name (tried on RealHumanEval's four assistants: no gain over the response text),
and a joint fit of text and numeric columns (the same AUC there, but no deduplication of texts).
Sample weights (the per-user cap of :mod:`reward_models.robust`) weigh both stages and the search.
Calibration holds for new users drawn like the training ones; on answers to tasks never seen in
training it may not (``benchmarks/rewards.py`` measures both).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp
import structlog
from sklearn.exceptions import ConvergenceWarning
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold

from reward_models.data import LOGPROB_COLUMNS
from reward_models.literals import grounding
from reward_models.verdicts import last_report

log = structlog.get_logger(__name__)

PROMPT_WEIGHT = 0.5
MAX_TERMS = 1 << 18
WORD_TOKENS = r"(?u)\b\w+\b|[^\w\s]"
NUMERIC = [
    "log_chars",
    "log_lines",
    "log_tokens",
    "log_prompt_chars",
    "has_code_block",
    "code_share",
    "logprob_mean",
    "logprob_min",
    "logprob_std",
    "logprob_missing",
    "tool_passed",
    "tool_kept",
    "tool_verdict_missing",
    "literal_coverage",
    "literal_extra",
    "literal_none",
]
_LOGPROB = list(LOGPROB_COLUMNS)


def as_text(values: Any, max_chars: int) -> pd.Series:
    """Strings of at most ``max_chars`` characters: None and NaN become empty, bytes are decoded leniently."""

    def one(value: Any) -> str:
        if isinstance(value, bytes | bytearray):
            value = bytes(value).decode("utf-8", errors="replace")
        elif value is None or (isinstance(value, float) and not np.isfinite(value)):
            value = ""
        elif not isinstance(value, str):
            value = str(value)
        return value[:max_chars]

    return pd.Series([one(v) for v in values], dtype=object)


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series([None] * len(frame), index=frame.index)


def _numbers(frame: pd.DataFrame, name: str) -> np.ndarray:
    values = pd.to_numeric(_column(frame, name), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    return np.where(np.isfinite(values), values, np.nan)


def verdict_columns(frame: pd.DataFrame) -> np.ndarray:
    """Per row: whether the newest verdict report in the prompt passed, was kept, and whether there is
    none (:func:`reward_models.verdicts.last_report`; read from the whole prompt, not the cut one)."""
    codes, uniques = pd.factorize(_column(frame, "prompt_text").reset_index(drop=True), use_na_sentinel=True)
    per_text = np.zeros((len(uniques) + 1, 3))
    per_text[-1, 2] = 1.0  # code -1: no prompt
    for i, text in enumerate(as_text(uniques, sys.maxsize)):
        verdict = last_report(text)
        per_text[i] = (0.0, 0.0, 1.0) if verdict is None else (float(verdict.passed), float(verdict.kept), 0.0)
    return per_text[codes]


def _code_share(text: str) -> float:
    parts = text.split("```")
    return sum(len(p) for p in parts[1::2]) / max(len(text), 1)


class TfidfBlock:
    """TF-IDF of one text column over distinct texts, each counted as often as rows carry it.

    Sublinear tf (``1 + log tf``), smoothed idf ``log((1 + n) / (1 + df)) + 1`` and unit-length rows,
    terms in at least ``min_df`` rows: what scikit-learn's ``TfidfVectorizer`` gives over every row.
    Beyond ``max_terms`` terms only the most frequent (by rows) are kept, which bounds the artifact.
    """

    def __init__(self, analyzer: str, ngram_range: tuple[int, int], min_df: int, max_terms: int = MAX_TERMS) -> None:
        self.analyzer = analyzer
        self.ngram_range = ngram_range
        self.min_df = min_df
        self.max_terms = max_terms

    def _vectorizer(self, vocabulary: dict[str, int] | None = None) -> CountVectorizer:
        return CountVectorizer(
            analyzer=self.analyzer,  # type: ignore[arg-type]
            ngram_range=self.ngram_range,
            token_pattern=WORD_TOKENS if self.analyzer == "word" else None,
            vocabulary=vocabulary,
            dtype=np.float64,
        )

    def fit_transform(self, texts: np.ndarray, copies: np.ndarray) -> sp.csr_matrix:
        """Learn terms and idf from distinct ``texts``, text ``i`` carried by ``copies[i]`` rows; weigh them."""
        vec = self._vectorizer()
        try:
            counts = vec.fit_transform(texts).tocsc()
        except ValueError:  # only empty texts: no terms at all
            self.vocabulary_: dict[str, int] = {}
            self.idf_ = np.zeros(0)
            return sp.csr_matrix((len(texts), 0), dtype=np.float64)
        present = counts.copy()
        present.data[:] = 1.0
        df = np.asarray(present.T @ copies).ravel()
        keep = np.flatnonzero(df >= self.min_df)
        if len(keep) > self.max_terms:
            keep = np.sort(keep[np.argsort(-df[keep], kind="stable")[: self.max_terms]])
        self.vocabulary_ = {str(t): i for i, t in enumerate(vec.get_feature_names_out()[keep])}
        self.idf_ = np.log((1.0 + copies.sum()) / (1.0 + df[keep])) + 1.0
        return self._weigh(counts[:, keep].tocsr())

    def transform(self, texts: np.ndarray) -> sp.csr_matrix:
        """TF-IDF of distinct ``texts`` over the fitted terms (unseen terms are dropped)."""
        if not self.vocabulary_:
            return sp.csr_matrix((len(texts), 0), dtype=np.float64)
        return self._weigh(self._vectorizer(self.vocabulary_).transform(texts).tocsr())

    def _weigh(self, counts: sp.csr_matrix) -> sp.csr_matrix:
        tfidf = counts.astype(np.float64)
        tfidf.data = 1.0 + np.log(tfidf.data)
        tfidf = tfidf @ sp.diags(self.idf_)
        norms = np.sqrt(np.asarray(tfidf.multiply(tfidf).sum(axis=1)).ravel())
        return sp.csr_matrix(sp.diags(1.0 / np.where(norms > 0, norms, 1.0)) @ tfidf)


@dataclass
class Design:
    """A frame's features: TF-IDF rows per distinct (response, prompt) pair, each row's pair, numeric columns."""

    text: sp.csr_matrix
    pair: np.ndarray
    numeric: np.ndarray


class TextFeatures:
    """Session frame -> :class:`Design`: response words and characters, prompt words, numeric columns."""

    def __init__(self, max_chars: int = 20_000, min_df: int = 2) -> None:
        self.max_chars = max_chars
        self.min_df = min_df
        self.blocks = {
            "completion_words": TfidfBlock("word", (1, 2), min_df),
            "completion_chars": TfidfBlock("char_wb", (2, 5), min_df),
            "prompt_words": TfidfBlock("word", (1, 2), min_df),
        }

    def _pairs(self, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each row's distinct (response, prompt) pair, the pairs' two texts, and the rows per pair."""
        completion = as_text(_column(frame, "completion_text"), self.max_chars)
        prompt = as_text(_column(frame, "prompt_text"), self.max_chars)
        c_code, _ = pd.factorize(completion)
        p_code, _ = pd.factorize(prompt)
        key = c_code.astype(np.int64) * (p_code.max(initial=0) + 1) + p_code
        _, first, pair = np.unique(key, return_index=True, return_inverse=True)
        copies = np.bincount(pair, minlength=len(first)).astype(np.float64)
        return pair, completion.to_numpy()[first], prompt.to_numpy()[first], copies

    def _numeric(self, frame: pd.DataFrame, pair: np.ndarray, completion: np.ndarray, prompt: np.ndarray) -> np.ndarray:
        """The raw :data:`NUMERIC` columns per row (logprobs may be NaN)."""
        per_pair = np.column_stack(
            [
                np.log1p(np.fromiter(map(len, completion), dtype=np.float64, count=len(completion))),
                np.log1p(np.fromiter((t.count("\n") for t in completion), dtype=np.float64, count=len(completion))),
                np.log1p(np.fromiter(map(len, prompt), dtype=np.float64, count=len(prompt))),
                np.fromiter(("```" in t for t in completion), dtype=np.float64, count=len(completion)),
                np.fromiter(map(_code_share, completion), dtype=np.float64, count=len(completion)),
            ]
        ).reshape(len(completion), 5)[pair]
        tokens = np.nan_to_num(_numbers(frame, "num_completion_tokens"), nan=0.0).clip(min=0.0)
        logprobs = np.column_stack([_numbers(frame, name) for name in _LOGPROB]).reshape(len(frame), 3)
        columns = [per_pair[:, :2], np.log1p(tokens), per_pair[:, 2:], logprobs, np.isnan(logprobs[:, 0])]
        return np.column_stack([*columns, verdict_columns(frame), grounding(prompt, completion)[pair]]).astype(
            np.float64
        )

    def fit_design(self, frame: pd.DataFrame) -> Design:
        """Fit every block (and the numeric imputation) on ``frame`` and return its design."""
        pair, completion, prompt, copies = self._pairs(frame)
        numeric = self._numeric(frame, pair, completion, prompt)
        self.fill_ = np.array([np.median(c[~np.isnan(c)]) if (~np.isnan(c)).any() else 0.0 for c in numeric.T])
        text = sp.hstack(
            [
                self.blocks["completion_words"].fit_transform(completion, copies),
                self.blocks["completion_chars"].fit_transform(completion, copies),
                PROMPT_WEIGHT * self.blocks["prompt_words"].fit_transform(prompt, copies),
            ],
            format="csr",
        )
        return Design(text, pair, np.where(np.isnan(numeric), self.fill_, numeric))

    def design(self, frame: pd.DataFrame) -> Design:
        """The design of ``frame`` with the fitted terms and imputation."""
        pair, completion, prompt, _ = self._pairs(frame)
        numeric = self._numeric(frame, pair, completion, prompt)[:, : len(self.fill_)]
        text = sp.hstack(
            [
                self.blocks["completion_words"].transform(completion),
                self.blocks["completion_chars"].transform(completion),
                PROMPT_WEIGHT * self.blocks["prompt_words"].transform(prompt),
            ],
            format="csr",
        )
        return Design(text, pair, np.where(np.isnan(numeric), self.fill_, numeric))


def user_groups(frame: pd.DataFrame, folds: int) -> np.ndarray:
    """Cross-validation groups: the user, or the row itself where there is none (or too few users)."""
    users = _column(frame, "user_id").reset_index(drop=True)
    rows = pd.Series([f"\x00row{i}" for i in range(len(frame))], dtype=object)
    groups = users.where(users.notna(), rows).astype(str).to_numpy(dtype=object)
    return groups if len(set(groups)) >= folds else rows.to_numpy(dtype=object)


def _weighted_auc(y: np.ndarray, score: np.ndarray, weight: np.ndarray) -> float:
    if len(np.unique(y[weight > 0])) < 2 or not np.all(np.isfinite(score)):
        return float("nan")
    return float(roc_auc_score(y, score, sample_weight=weight))


def _quiet_fit(clf: LogisticRegression, x: Any, y: np.ndarray, weight: np.ndarray) -> LogisticRegression:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return clf.fit(x, y, sample_weight=weight)


class TextRewardModel:
    """Pointwise reward head: text logistic regression (``C`` by grouped CV), then a calibrated combination."""

    def __init__(
        self,
        c_grid: Sequence[float] = (0.1, 0.3, 1.0, 3.0, 10.0),
        folds: int = 4,
        cv_max_rows: int = 50_000,
        max_chars: int = 20_000,
        seed: int = 0,
    ) -> None:
        if not c_grid or min(c_grid) <= 0:
            raise ValueError(f"c_grid needs at least one positive value, got {list(c_grid)}")
        if folds < 2:
            raise ValueError(f"folds must be at least 2, got {folds}")
        self.c_grid = sorted(float(c) for c in c_grid)
        self.folds = folds
        self.cv_max_rows = cv_max_rows
        self.seed = seed
        self.features = TextFeatures(max_chars)

    def fit(self, frame: pd.DataFrame, y: np.ndarray, weight: np.ndarray | None = None) -> TextRewardModel:
        """Fit on ``frame`` (session rows) with binary labels ``y`` and optional non-negative row weights."""
        y = np.asarray(y, dtype=int)
        weight = np.ones(len(y)) if weight is None else np.asarray(weight, dtype=np.float64)
        if len(y) != len(frame) or len(weight) != len(frame):
            raise ValueError(f"{len(frame)} rows, {len(y)} labels and {len(weight)} weights: they must match")
        if not np.all(np.isfinite(weight)) or np.any(weight < 0):
            raise ValueError("sample weights must be finite and non-negative")
        if not np.isin(y, (0, 1)).all() or len(np.unique(y[weight > 0])) < 2:
            raise ValueError("labels must be 0 or 1, and both classes need rows of positive weight")
        frame = frame.reset_index(drop=True)
        design = self.features.fit_design(frame)
        self.mean_ = design.numeric.mean(axis=0)
        std = design.numeric.std(axis=0)
        self.std_ = np.where(std > 1e-9, std, 1.0)
        groups = user_groups(frame, self.folds)
        rows = self._search_rows(len(frame))
        oof, self.cv_auc_, fold_models = self._search(design, y, weight, groups, rows)
        if len(rows) == len(y) and fold_models:
            self.text_models_ = fold_models  # the very models whose out-of-fold scores the combiner sees
        else:
            self.text_models_ = [self._fit_text(self.c_, design, y, weight, np.arange(len(y)))]
        self._fit_combination(oof[self.c_], self._scaled(design.numeric[rows]), y[rows], weight[rows])
        log.info(
            "text reward model",
            rows=len(y),
            distinct_texts=design.text.shape[0],
            c=self.c_,
            cv_auc=self.cv_auc_.get(self.c_),
            text_coef=self.text_coef_,
        )
        return self

    def _scaled(self, numeric: np.ndarray) -> np.ndarray:
        return np.asarray((numeric - self.mean_) / self.std_, dtype=np.float64)

    def _fit_text(
        self, c: float, design: Design, y: np.ndarray, weight: np.ndarray, rows: np.ndarray
    ) -> LogisticRegression:
        """Logistic regression on the text of ``rows``, each distinct pair once per class with its summed weight.

        The same loss as one term per row (rows of one pair share their text features), in far fewer terms.
        """
        n_pairs = design.text.shape[0]
        pair = design.pair[rows]
        pos = np.bincount(pair, weights=weight[rows] * (y[rows] == 1), minlength=n_pairs)
        neg = np.bincount(pair, weights=weight[rows] * (y[rows] == 0), minlength=n_pairs)
        has_pos, has_neg = np.flatnonzero(pos > 0), np.flatnonzero(neg > 0)
        x = sp.vstack([design.text[has_pos], design.text[has_neg]], format="csr")
        target = np.concatenate([np.ones(len(has_pos), dtype=int), np.zeros(len(has_neg), dtype=int)])
        clf = LogisticRegression(C=c, solver="liblinear", max_iter=1000, random_state=self.seed)
        return _quiet_fit(clf, x, target, np.concatenate([pos[has_pos], neg[has_neg]]))

    def _search_rows(self, n: int) -> np.ndarray:
        """Rows of the ``C`` search and of the calibration: all, or a seeded sample of ``cv_max_rows``."""
        if n <= self.cv_max_rows:
            return np.arange(n)
        return np.sort(np.random.default_rng(self.seed).choice(n, self.cv_max_rows, replace=False))

    def _search(
        self, design: Design, y: np.ndarray, weight: np.ndarray, groups: np.ndarray, rows: np.ndarray
    ) -> tuple[dict[float, np.ndarray], dict[float, float], list[LogisticRegression]]:
        """Out-of-fold text scores of ``rows`` per ``C`` (folds grouped by user; a fold with one class
        scores NaN), their pooled weighted AUC, and the fold models of the best ``C`` (set as ``c_``)."""
        oof = {c: np.full(len(rows), np.nan) for c in self.c_grid}
        models: dict[float, list[LogisticRegression]] = {c: [] for c in self.c_grid}
        folds = min(self.folds, len(set(groups[rows])))
        held: list[np.ndarray] = []  # positions in ``rows`` each kept fold model never saw
        for train, test in GroupKFold(folds).split(rows, groups=groups[rows]):
            if len(np.unique(y[rows[train]][weight[rows[train]] > 0])) < 2:
                continue
            held.append(test)
            test_pairs = design.text[design.pair[rows[test]]]
            for c in self.c_grid:
                models[c].append(self._fit_text(c, design, y, weight, rows[train]))
                oof[c][test] = models[c][-1].decision_function(test_pairs)
        scored = np.isfinite(oof[self.c_grid[0]])
        y_s, w_s = y[rows][scored], weight[rows][scored]
        aucs = {c: _weighted_auc(y_s, oof[c][scored], w_s) for c in self.c_grid}
        valid = {c: a for c, a in aucs.items() if np.isfinite(a)}
        self.c_ = max(valid, key=lambda c: (valid[c], -abs(np.log(c)))) if valid else 1.0
        self.fold_models_, self._held_rows = models[self.c_], held  # members of the score's error
        return oof, aucs, models[self.c_] if scored.all() else []

    def _fit_combination(self, text_score: np.ndarray, numeric: np.ndarray, y: np.ndarray, weight: np.ndarray) -> None:
        """Logistic regression of the label on the out-of-fold text score and the numeric columns.

        Fitted on scores of rows their text model never saw, it is the calibration too. A negative
        weight on the text score (a text ranking that fails across users) is refused: refitted without it.
        """
        held: list[np.ndarray] = self.__dict__.pop("_held_rows", [])
        self.fold_combiners_: list[LogisticRegression] = []
        scored = np.isfinite(text_score) & (weight > 0)
        z = np.column_stack([np.where(scored, text_score, 0.0), numeric])
        self.text_coef_ = 0.0
        if len(np.unique(y[scored])) < 2:
            self.combiner_ = None
            return
        clf = _quiet_fit(LogisticRegression(C=1.0, max_iter=1000), z[scored], y[scored], weight[scored])
        if clf.coef_[0, 0] <= 0:
            z[:, 0] = 0.0
            clf = _quiet_fit(LogisticRegression(C=1.0, max_iter=1000), z[scored], y[scored], weight[scored])
        self.text_coef_ = float(clf.coef_[0, 0])
        self.combiner_ = clf
        # One combiner per user fold, fitted without that fold's rows; with the fold's text model it is one
        # member of member_scores. A fold whose other rows hold one class keeps the shared combiner.
        for fold in held:
            rest = scored.copy()
            rest[fold] = False
            if len(np.unique(y[rest])) < 2:
                self.fold_combiners_.append(clf)
                continue
            self.fold_combiners_.append(
                _quiet_fit(LogisticRegression(C=1.0, max_iter=1000), z[rest], y[rest], weight[rest])
            )

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        """Calibrated log-odds of a positive label per row."""
        if len(frame) == 0:
            return np.zeros(0)
        design = self.features.design(frame.reset_index(drop=True))
        text = np.mean([m.decision_function(design.text) for m in self.text_models_], axis=0)[design.pair]
        if self.combiner_ is None:
            return text
        z = np.column_stack([text, self._scaled(design.numeric)])
        return np.asarray(self.combiner_.decision_function(z), dtype=np.float64)

    def member_scores(self, frame: pd.DataFrame) -> np.ndarray:
        """Calibrated log-odds per user fold, shape ``(folds, len(frame))``: each fold's text model of the
        ``C`` search through that fold's combiner, both fitted without the fold's rows.

        Their spread is how much the score depends on which users trained it, in both stages (a
        delete-a-group jackknife over users): wide where an answer's text or its numeric columns (its
        length, the served logprobs) lie where few users' labels reach. Their mean is close to
        :meth:`score`, not equal to it (the score's combiner saw every fold). Above ``cv_max_rows`` rows
        the folds were fitted on the search's sample. Without a kept fold (a fold of one class) or in a
        model pickled before folds were kept: the one score."""
        models = getattr(self, "fold_models_", None) or []
        combiners = getattr(self, "fold_combiners_", None) or []
        if len(frame) == 0:
            return np.zeros((max(len(models), 1), 0))
        if not models or (self.combiner_ is not None and len(combiners) != len(models)):
            return self.score(frame)[None, :]
        design = self.features.design(frame.reset_index(drop=True))
        texts = [m.decision_function(design.text)[design.pair] for m in models]
        if self.combiner_ is None:
            return np.asarray(texts, dtype=np.float64)
        numeric = self._scaled(design.numeric)
        return np.asarray(
            [c.decision_function(np.column_stack([t, numeric])) for t, c in zip(texts, combiners, strict=True)],
            dtype=np.float64,
        )

    def predict_proba(self, frame: pd.DataFrame) -> np.ndarray:
        """Calibrated probability of a positive label per row."""
        return np.asarray(np.exp(-np.logaddexp(0.0, -self.score(frame))), dtype=np.float64)
