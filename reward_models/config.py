"""Configuration sections owned by the reward-model layer (composed by ``scheduler.settings``).

Default composite weights, and why (see :mod:`reward_models.labels`):

- ``retention`` 0.5: what users keep is the outcome we care about; delayed but hard to game.
- ``acceptance`` 0.25: immediate and dense, but users accept and then rewrite.
- ``selection`` 0.15: a direct comparison between candidates, biased by display position.
- ``switch`` 0.10: leaving the model is a strong, rare negative.
- ``thumbs`` 0.0: explicit ratings reward flattery and agreement (sycophancy) more than working
  code; they are collected and reported, but do not steer the policy unless a team opts in.
- ``churn`` 0.0: user level, high bias (users leave for many reasons) and low variance; opt in.
- judge dimensions 0.0: an LLM judge is another model's opinion; off until a team configures it.

How much one user can weigh (:mod:`reward_models.robust`): ``max_user_share`` 0.02. Every account,
an attacker's too, stays under it, so k accounts hold at most k times it:
``benchmarks/poisoning.py`` (measured with the hashed head; 100 honest users, 5 attackers at their
full signal rate, all their signals inverted) moves the held-out AUC by 0.025 with 0.05 and by
0.011 with 0.02, while clean data trains the same model there (the AUC equal to the fourth
decimal). The price is paid by honest users far heavier than the rest: with heavy-tailed volumes
(100 users) 0.02 costs -0.009 AUC composite and -0.023 on the retention head, against +0.0015 and
-0.006 for 0.05; on 40 users with similar volumes -0.002. With fewer than 50 users the cap is ``1 /
users`` (equal shares). 1.0 turns it off.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr


class JudgeConfig(BaseModel):
    """An optional LLM-as-judge signal scored by any OpenAI-compatible chat completions endpoint."""

    enabled: bool = False
    """Score sessions with the judge while labeling (off by default)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the OpenAI-compatible API (``/chat/completions`` is appended)."""
    model: str = "judge"
    """Model name sent in each request."""
    api_key: SecretStr | None = None
    """Bearer token, if the endpoint needs one."""
    dimensions: dict[str, str] = Field(
        default_factory=lambda: {
            "correctness": "Is the code correct for the request? 10 = certainly correct, 0 = wrong.",
            "style": "Is the code idiomatic, concise and readable? 10 = excellent, 0 = poor.",
            "needless_questions": "Does the answer avoid needless questions to the user? 10 = none, 0 = only.",
        }
    )
    """Rubric: one dimension per call, name -> instruction; the judge answers with a 0-10 score."""
    timeout_s: float = 30.0
    """Timeout of one judge call."""
    max_sessions: int = Field(default=1000, ge=0)
    """Most sessions judged per labeling run (calls are cached by content hash)."""


class RewardsConfig(BaseModel):
    """Reward labels, models and retraining."""

    artifacts_dir: str = "reward_models"
    """Directory under the Undertow home where reward-model artifacts are stored."""

    # Labels
    retention_weights: dict[int, float] = Field(default_factory=lambda: {300: 1.0, 3600: 2.0, 86400: 4.0})
    """Weight of each retention horizon (seconds) in the combined label: longer horizons weigh more."""
    retention_grace_s: int = Field(default=3600, ge=0)
    """How long after the longest horizon elapsed a missing measurement is awaited before finalizing."""
    retention_require_final: bool = False
    """False: labels (the composite reward RL trains on) and the heads use the retention measured so far,
    and a later horizon revises it: a session's first horizon (1 h) reaches the next update, where waiting
    for the longest one put it past every update that needed it (docs/BENCHMARKS.md, "Retention
    measured so far"). True: only sessions whose longest horizon was measured or has elapsed (no label
    revised later). The reward-hacking guards judge on final retention either way."""
    retention_head_final: bool = False
    """True: the retention head trains on final retention only (its longest horizon measured or elapsed),
    whatever the labels use, so its score for a fresh session predicts the retention its user will end
    with, not the first hour's. Worth it where code is rewritten after the first horizon."""
    positive_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    """A retention or acceptance label at or above this counts as positive for the classifiers."""
    churn_window_s: int = Field(default=7 * 86400, gt=0)
    """Sessions of a churned user within this many seconds before the churn event get the churn label."""
    position_correction: bool = True
    """Weight selection pairs by inverse display-position propensity (corrects position bias)."""
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "retention": 0.5,
            "acceptance": 0.25,
            "selection": 0.15,
            "switch": 0.10,
            "thumbs": 0.0,
            "churn": 0.0,
        }
    )
    """Composite reward weights per signal (judge dimensions as ``judge:<name>``); see module docstring."""
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """Optional LLM judge signal."""

    # Reward of the RL update (policy.production)
    rl_reward: Literal["assisted", "labels"] = "assisted"
    """What an RL update trains on: ``assisted``, labels for a group labeled in full, else the promoted reward
    model's score (fresh sessions whose signals have not arrived yet); ``labels``, only labeled sessions."""
    rl_model_reward: Literal["probability", "best_of_group"] = "probability"
    """How a group scored by the reward model is rewarded: ``probability``, each member's calibrated keep
    probability; ``best_of_group``, 1 for the member the model ranks first and 0 for the others (the model
    stands in for the user's selection; a session alone keeps its probability)."""
    rl_uncertainty_penalty: float = Field(default=2.0, ge=0.0, le=10.0)
    """Pessimism of a model-scored reward: RL trains on the lower bound ``score - this x standard error``
    (log-odds, before the keep probability), the error being how much the score changes with the users
    who trained the model (a delete-a-group jackknife over user folds: the text heads' fold models and
    the pairwise head's members, :meth:`~reward_models.models.RewardBundle.score_with_error`). An answer
    unlike what most users labeled earns less than its mean score, so an update is not pulled where the
    model only guesses (reward-model overoptimization). 2 (default): in the scarce-label ablation it
    gained 2.7 and 2.9 points over the plain score on two machines, and tied it with labels at the
    default rate (docs/BENCHMARKS.md); 0: the mean score. Labels are never changed."""
    rl_hacking_guard_z: float = Field(default=2.0, ge=0.0)
    """The RL side of the reward-hacking guard: before an assisted update scores sessions with the
    promoted model, the guard (:func:`reward_models.api.hacking_check`) compares that model's scores of
    the newest policy versions with their final retention; when the score rose while retention fell by
    more than ``hacking_real_drop`` and by more than this many standard errors, the update trains on
    labels only (the version's metrics say why) until a model the guard does not flag is promoted. 0:
    the RL side never consults the guard (the rollout gate still does)."""
    rl_score_partial_groups: bool = False
    """False: a group with some labels trains on them (its unlabeled members wait) and the model scores
    only groups nobody labeled, so the assisted update trains on every label a labels-only one would;
    True: any group not labeled in full is scored by the model in full (its labels dropped)."""
    rl_labels_first: bool = True
    """Plan an update's draws over the groups rewarded by labels first and fill the rest with groups the
    reward model scored (False: one shuffle over both, so model-scored groups take draws from labels)."""
    rl_score_confidence: bool = True
    """Let the reward model see the served logprobs (the policy's own confidence) when it scores sessions
    for RL. False hides them (imputed, as for a session served without logprobs), so an update cannot raise
    its reward by sharpening its own distribution; on the demo's tasks the text alone then ranks a group's
    candidates at chance (docs/BENCHMARKS.md, the reward model's part), so they are shown by default."""

    # Robustness: how much one user can weigh (reward_models.robust)
    require_session_user: bool = True
    """Labels ignore a signal naming a user other than its session's (counted: ``foreign_user_signals``)."""
    max_user_share: float = Field(default=0.02, gt=0.0, le=1.0)
    """Most of a head's training weight one user's sessions or pairs may carry (at least 1/users); 1.0: no cap."""

    # Models
    backend: Literal["sklearn", "torch"] = "sklearn"
    """Reward-model backend: scikit-learn pipelines (default) or the torch reward head."""
    pointwise_model: Literal["text", "hashed"] = "text"
    """Retention and acceptance heads (scikit-learn backend): TF-IDF text model, or hashed n-grams with SGD."""
    text_c_grid: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [0.1, 0.3, 1.0, 3.0, 10.0], min_length=1
    )
    """Text model: inverse L2 strengths tried by the inner cross-validation grouped by user."""
    text_cv_folds: int = Field(default=4, ge=2)
    """Text model: folds of the inner cross-validation (grouped by user) that picks ``C`` and fits calibration."""
    text_cv_max_rows: int = Field(default=50_000, ge=100)
    """Text model: above this many training rows, the inner cross-validation runs on a seeded sample this size."""
    text_max_chars: int = Field(default=20_000, ge=100)
    """Text model: characters of a prompt or response read (the start); the rest is ignored."""
    hash_features: int = Field(default=1 << 18, ge=16)
    """Width of the hashed text feature space (unigrams and bigrams of prompt and completion)."""
    sgd_epochs: int = Field(default=8, ge=1)
    """Passes over the data of the SGD classifiers (scikit-learn backend)."""
    l2: float = Field(default=1e-3, gt=0)
    """L2 regularization strength (SGD ``alpha``; torch weight decay)."""
    bt_margin: float = Field(default=0.0, ge=0.0)
    """Margin of the Bradley-Terry loss ``-log sigmoid(r_c - r_r - margin)`` (torch backend)."""
    torch_epochs: int = Field(default=4, ge=1)
    """Epochs of the torch reward head."""
    torch_dim: int = Field(default=16, ge=1)
    """Hidden width of the torch reward head."""
    error_folds: int = Field(default=4, ge=0)
    """Folds of choosing users the pairwise head leaves out, one member each, for the score's error over users
    (``RewardBundle.score_with_error``; the text heads' error comes from their own ``text_cv_folds``).
    0 or 1: no members, that head adds no error."""
    error_max_pairs: int = Field(default=50_000, ge=0)
    """The pairwise head fits its members only on up to this many pairs (above, its error over users is
    small and the members would cost a refit each)."""
    holdout_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    """Newest fraction of sessions (by time) held out for evaluation."""
    min_train_rows: int = Field(default=20, ge=2)
    """Fewest labeled training rows (or pairs) a model needs; fewer: that model is skipped with a reason."""
    seed: int = 0
    """Random seed of training."""

    # Registry and promotion
    promote_min_delta: float = 0.0
    """A candidate is promoted only if its primary metric beats the current version's by more than this."""
    min_auc_over_baseline: float = 0.02
    """A candidate must beat the trivial baseline by this much on every head to be promotable (a head
    whose hold-out is too small to tell is not judged: ``head_check_min_evidence``)."""
    head_check_min_evidence: int = Field(default=20, ge=0)
    """Fewest hold-out observations a head's check against its trivial baseline needs to refuse a
    version: selection pairs for the pairwise head, labels of the rarer class for a pointwise head.
    On fewer the head's metric is noise (4 pairs: a standard error of 0.25), so the head is left
    unjudged (said in the reason) and the bundle's own checks decide: better than the current version
    on the same hold-out, and over chance where no version is promoted yet
    (``small_holdout_prefers_more_labels``). So is a small hold-out of one class (0 of the rarer,
    no AUC), and a head with nothing held out (no selection pair among the newest sessions). 0: every
    head is judged whatever its hold-out."""
    small_holdout_prefers_more_labels: bool = True
    """Where the bundle's hold-out is too small to tell a candidate from the current version (fewer than
    ``head_check_min_evidence`` labels of the rarer class plus selection pairs), a candidate
    that trained on more labeled sessions than the current version replaces it, and the bundle's chance
    floor is not judged there either (the current version often scores under it on the same few
    observations); a first version must still clear the floor. False: the candidate must clear the floor
    and beat the current version's score on that hold-out, so a version promoted early on little data
    can outlast every retrain on more (its comparisons decided by noise)."""

    # Triggers and guards
    retrain_min_new_labels: int = Field(default=500, ge=1)
    """Retrain when at least this many labeled sessions arrived since the current version's window."""
    retrain_interval_s: int = Field(default=6 * 3600, gt=0)
    """Retrain when the current version is older than this."""
    drift_psi_threshold: float = Field(default=0.2, gt=0)
    """Retrain when the population stability index of recent scores vs the reference exceeds this."""
    drift_ks_pvalue: float = Field(default=1e-3, gt=0, lt=1)
    """Also flag drift when a two-sample KS test rejects equality at this p-value."""
    drift_min_samples: int = Field(default=50, ge=5)
    """Fewest recent scores needed before drift is measured."""
    drift_recent_sessions: int = Field(default=2000, ge=5)
    """Drift trigger: the promoted version scores at most this many of the newest sessions it was not trained on."""
    drift_window_s: int = Field(default=86400, gt=0)
    """Drift trigger: only sessions that occurred within this many seconds before now count as recent."""
    hacking_proxy_rise: float = Field(default=0.05, ge=0)
    """Reward-hacking guard: proxy reward must rise by more than this across the window to count."""
    hacking_real_drop: float = Field(default=0.03, ge=0)
    """Reward-hacking guard: real retention must fall by more than this across the window to count."""
    hacking_window: int = Field(default=3, ge=2)
    """Reward-hacking guard: number of most recent policy versions compared."""
    guard_min_sessions: int = Field(default=30, ge=1)
    """Promotion guard: sessions with a final retention label each of the candidate and the incumbent needs
    before the guard may refuse a promotion (fewer: the promotion is not blocked, and the message says so)."""
