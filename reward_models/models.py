"""Reward heads and the bundle a version serves.

Two backends behind one interface (``fit`` / ``score``), chosen by ``RewardsConfig.backend``
through :func:`setup_pointwise` and :func:`setup_pairwise`:

- ``sklearn`` (default): the pointwise heads (retention, acceptance) are the text model
  :class:`~reward_models.text_model.TextRewardModel` (word and character TF-IDF plus numeric
  features, ``C`` by cross-validation grouped by user, calibrated on out-of-fold scores;
  ``pointwise_model = "text"``), or with ``pointwise_model = "hashed"`` a ``Pipeline`` of
  :class:`~reward_models.features.Featurizer` and an ``SGDClassifier`` with log loss. The
  pairwise head is Bradley-Terry fitted as a logistic regression without intercept on feature
  differences ``x_chosen - x_rejected`` (each pair also mirrored), whose loss is exactly
  ``-log sigmoid(r_c - r_r)`` with ``r = w . x``, on the hashed features.
- ``torch``: :class:`~reward_models.torch_head.TorchRewardHead` on the same sparse features,
  trained with :func:`~reward_models.losses.bradley_terry_loss` (with margin) or BCE.

Every head scores on the log-odds scale. A :class:`RewardBundle` combines its heads with the
composite weights: ``reward = sum_k w_k r_k / sum_k w_k`` (retention, acceptance, selection).
The privileged head (:class:`PrivilegedModel`) sees ``final_text`` and is kept out of the
bundle's serving path: it labels and audits, it never scores a fresh completion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, SGDClassifier
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import Pipeline

from reward_models.config import RewardsConfig
from reward_models.features import Featurizer
from reward_models.text_model import TextRewardModel, user_groups


class Head(Protocol):
    """What a reward head offers: a log-odds score per session row."""

    def score(self, frame: pd.DataFrame) -> np.ndarray: ...


class SklearnPointwise:
    """Keep/accept classifier: features -> SGD logistic regression."""

    def __init__(self, config: RewardsConfig) -> None:
        self.pipeline = Pipeline(
            [
                ("features", Featurizer(config.hash_features)),
                (
                    "clf",
                    SGDClassifier(
                        loss="log_loss",
                        alpha=config.l2,
                        max_iter=config.sgd_epochs,
                        tol=None,
                        random_state=config.seed,
                    ),
                ),
            ]
        )

    def fit(self, frame: pd.DataFrame, y: np.ndarray, weight: np.ndarray | None = None) -> SklearnPointwise:
        with warnings.catch_warnings():  # a fixed number of epochs is the budget, not a failure
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.pipeline.fit(frame, y, clf__sample_weight=weight)
        return self

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        return np.asarray(self.pipeline.decision_function(frame), dtype=np.float64)


def pair_design(features: sp.csr_matrix, chosen: np.ndarray, rejected: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray]:
    """Mirrored difference rows ``[x_c - x_r; x_r - x_c]`` with targets ``[1; 0]``."""
    diff = features[chosen] - features[rejected]
    design = sp.vstack([diff, -diff], format="csr")
    target = np.concatenate([np.ones(len(chosen)), np.zeros(len(chosen))])
    return design, target


class SklearnPairwise:
    """Bradley-Terry from selections: logistic regression on feature differences, no intercept.

    Beside the model on every pair, up to ``config.error_folds`` members each fitted without one fold of
    the choosing users' pairs (``GroupKFold`` by the chosen session's user), on at most
    ``config.error_max_pairs`` pairs: their spread is the score's error over users (:meth:`member_scores`).
    """

    def __init__(self, config: RewardsConfig) -> None:
        self.config = config
        self.featurizer = Featurizer(config.hash_features)
        self.clf = self._classifier()

    def _classifier(self) -> SGDClassifier:
        return SGDClassifier(
            loss="log_loss",
            alpha=self.config.l2,
            max_iter=self.config.sgd_epochs,
            tol=None,
            fit_intercept=False,
            random_state=self.config.seed,
        )

    def fit(self, frame: pd.DataFrame, chosen: np.ndarray, rejected: np.ndarray, weight: np.ndarray) -> SklearnPairwise:
        features = self.featurizer.fit(frame).transform(frame)
        design, target = pair_design(features, chosen, rejected)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.clf.fit(design, target, sample_weight=np.concatenate([weight, weight]))
            self.members_ = self._fit_members(frame, features, np.asarray(chosen), np.asarray(rejected), weight)
        return self

    def _fit_members(
        self, frame: pd.DataFrame, features: sp.csr_matrix, chosen: np.ndarray, rejected: np.ndarray, weight: np.ndarray
    ) -> list[np.ndarray]:
        """Coefficients of the models fitted without one fold of users' pairs each ([] when off, over the
        pair cap, or with fewer than two users)."""
        folds, n = self.config.error_folds, len(chosen)
        if folds < 2 or n > self.config.error_max_pairs:
            return []
        users = user_groups(frame.reset_index(drop=True), folds)[chosen]  # a pair without a user: its own group
        folds = min(folds, len(set(users)))
        if folds < 2:
            return []
        members = []
        for keep, _ in GroupKFold(folds).split(np.arange(n), groups=users):
            design, target = pair_design(features, chosen[keep], rejected[keep])
            clf = self._classifier().fit(design, target, sample_weight=np.concatenate([weight[keep], weight[keep]]))
            members.append(np.asarray(clf.coef_, dtype=np.float64).ravel())
        return members

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        features = self.featurizer.transform(frame)
        return np.asarray(features @ self.clf.coef_.ravel(), dtype=np.float64)

    def member_scores(self, frame: pd.DataFrame) -> np.ndarray:
        """Scores per user-fold member, shape ``(members, len(frame))``; the one score without members."""
        members = getattr(self, "members_", None) or []  # a head pickled before members were fitted: none
        if not members:
            return self.score(frame)[None, :]
        features = self.featurizer.transform(frame)
        return np.asarray([features @ coef for coef in members], dtype=np.float64)


def setup_pointwise(config: RewardsConfig) -> Any:
    """The pointwise head of the configured backend."""
    if config.backend == "torch":
        from reward_models.torch_head import TorchPointwise

        return TorchPointwise(config)
    if config.pointwise_model == "text":
        return TextRewardModel(
            c_grid=config.text_c_grid,
            folds=config.text_cv_folds,
            cv_max_rows=config.text_cv_max_rows,
            max_chars=config.text_max_chars,
            seed=config.seed,
        )
    return SklearnPointwise(config)


def setup_pairwise(config: RewardsConfig) -> Any:
    """The pairwise (Bradley-Terry) head of the configured backend."""
    if config.backend == "torch":
        from reward_models.torch_head import TorchPairwise

        return TorchPairwise(config)
    return SklearnPairwise(config)


def closeness_features(completion: pd.Series, final: pd.Series) -> np.ndarray:
    """How close a completion is to what the user kept: line overlap (both ways), token Jaccard, length ratio."""
    rows = []
    for comp, fin in zip(completion.fillna("").astype(str), final.fillna("").astype(str), strict=True):
        c_lines = {line.strip() for line in comp.splitlines() if line.strip()}
        f_lines = {line.strip() for line in fin.splitlines() if line.strip()}
        kept = len(c_lines & f_lines)
        c_tok, f_tok = set(comp.split()), set(fin.split())
        jaccard = len(c_tok & f_tok) / max(len(c_tok | f_tok), 1)
        ratio = min(len(comp), len(fin)) / max(len(comp), len(fin), 1)
        rows.append([kept / max(len(c_lines), 1), kept / max(len(f_lines), 1), jaccard, ratio])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 4)


class PrivilegedModel:
    """Scores a completion by its closeness to the user's ``final_text`` (labeling and audit only)."""

    def __init__(self, config: RewardsConfig) -> None:
        self.clf = LogisticRegression(C=1.0, max_iter=200, random_state=config.seed)

    def fit(
        self, completion: pd.Series, final: pd.Series, y: np.ndarray, weight: np.ndarray | None = None
    ) -> PrivilegedModel:
        self.clf.fit(closeness_features(completion, final), y, sample_weight=weight)
        return self

    def score(self, completion: pd.Series, final: pd.Series) -> np.ndarray:
        """Log-odds that the completion was kept, given what the user finally had."""
        return np.asarray(self.clf.decision_function(closeness_features(completion, final)), dtype=np.float64)


@dataclass
class RewardBundle:
    """The heads of one version and their composite weights; what ``Scorer`` serves."""

    heads: dict[str, Any]
    weights: dict[str, float]
    privileged: PrivilegedModel | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def head_scores(self, frame: pd.DataFrame) -> dict[str, np.ndarray]:
        """Each serving head's log-odds score."""
        return {name: head.score(frame) for name, head in self.heads.items()}

    def _head_weight(self, name: str) -> float:
        """A head's weight in the composite (a head without a positive weight counts a little, never 0)."""
        return max(self.weights.get(name, 0.0), 0.0) or 1e-3

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        """Composite reward on the log-odds scale: weighted mean of the heads' scores."""
        if len(frame) == 0:
            return np.zeros(0)
        scores = self.head_scores(frame)
        total = np.zeros(len(frame))
        weight_sum = 0.0
        for name, values in scores.items():
            w = self._head_weight(name)
            total += w * values
            weight_sum += w
        return total / max(weight_sum, 1e-12)

    def score_with_error(self, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`score` and its standard error per row over the users who trained it.

        A head with several models fitted on different users (the text model's user folds,
        :func:`head_members`) has the delete-a-group jackknife's error ``sqrt((M-1)/M * sum_m (s_m -
        mean)^2)`` over its ``M`` models (around their own mean); a head of one model has none. The
        composite's error takes the heads' errors as independent: ``sqrt(sum_k (w_k / sum w)^2
        se_k^2)``. Large where the score rests on few users' labels (text unlike anything most folds
        saw); what a pessimistic RL reward subtracts (``RewardsConfig.rl_uncertainty_penalty``)."""
        if len(frame) == 0:
            return np.zeros(0), np.zeros(0)
        variance = np.zeros(len(frame))
        weight_sum = sum(self._head_weight(name) for name in self.heads)
        for name, head in self.heads.items():
            members = head_members(head, frame)
            m = len(members)
            if m > 1:
                jackknife = (m - 1) / m * np.sum((members - members.mean(axis=0)) ** 2, axis=0)
                variance += (self._head_weight(name) / max(weight_sum, 1e-12)) ** 2 * jackknife
        return self.score(frame), np.sqrt(variance)


def head_members(head: Any, frame: pd.DataFrame) -> np.ndarray:
    """A head's scores per model it holds, shape ``(models, rows)``: the user-fold models of a text head
    (:meth:`~reward_models.text_model.TextRewardModel.member_scores`), else its one score."""
    members = getattr(head, "member_scores", None)
    if members is not None:
        return np.asarray(members(frame), dtype=np.float64)
    return np.asarray(head.score(frame), dtype=np.float64)[None, :]
