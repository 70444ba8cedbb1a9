"""The production RL update: the served sessions in the database, rewarded by what users did,
trained by GRPO over groups (and a baseline for single samples), into a new policy version (checkpoint + row).

This is the trainer session the scheduler's ``rl_update`` step runs on borrowed replicas (the
scheduler builds it from its settings sections and the job's :class:`TrainRequest`):

- **data**: every stored session of the request's window (``since``/``until`` on the session's
  ``occurred_at``) with token ids, serving logprobs and routed experts
  (:func:`policy.trajectories.session_trajectories`), at most ``max_staleness`` versions behind the
  version trained from (:func:`policy.rollouts.filter_stale`: older and unknown versions drop, and
  with ``PolicyConfig.rl_lineage_only`` so do versions off the trained one's line of ancestors);
- **reward**: the composite label from user signals (:func:`reward_models.labels.build_labels`:
  retention, acceptance, selection, switch) where a session has one; else the promoted reward
  model's score (:func:`reward_models.api.load_scorer`) as a keep probability ``sigmoid(score)``,
  for every member of a group nobody labeled (GRPO compares a group's members, so their rewards
  share one scale; a group with some labels keeps them, its unlabeled members wait); with
  ``RewardsConfig.rl_uncertainty_penalty`` (2 by default) the score is first lowered by that many
  standard errors over the users who trained the model (a pessimistic reward where the model only
  guesses); sessions with neither are skipped. The model is not trained on while the reward-hacking
  guard flags it (``RewardsConfig.rl_hacking_guard_z``: its score of the newest policy versions rose
  while their final retention fell significantly): the update then takes labels only and its metrics
  say why (``reward/model_flagged``). ``RewardsConfig.rl_reward = "labels"`` drops the second
  source: only labeled sessions are trained on (``benchmarks/ablation.py`` compares the two);
- **trajectories**: the turns of an agent session are one trajectory (:mod:`policy.trajectories`:
  only generated tokens trained, each turn's served logprobs, replay across turns, windows at
  self-summaries credited with the session's final reward);
- **update**: GRPO advantages within each group: the K choices of one request, or the sessions a
  client ran on one task (``turn.group``); a session alone (a tab completion, an agent session
  without a group) trains against a running per-context baseline, saved with the resume state.
  Each step takes ``groups_per_step`` units (groups or single sessions) from a plan fixed at the
  start (a seeded shuffle), so a run preempted and resumed trains on exactly the same batches.
  Units rewarded by labels take the draws first (``RewardsConfig.rl_labels_first``); the model's
  scores fill the rest, so an unlabeled session never displaces a labeled one. With
  ``PolicyConfig.rl_max_epochs`` the plan takes at most that many passes over short data (fewer
  steps); with ``PolicyConfig.kl_coef`` each step adds the k3 KL to a frozen reference (v0, or the
  parent: ``kl_reference``). ``RewardsConfig.rl_score_confidence = False`` hides the served logprobs
  from the reward model when it scores;
- **resume**: :meth:`ProductionSession.save` writes weights, optimizer, step and the plan (session
  ids with their rewards) to one file; :meth:`load` restores it;
- **several processes**: constructed on every rank of a ``torchrun`` job, the session shards the
  model (``PolicyConfig.parallel``), every rank reads the same sessions and plan from the
  database, and only rank 0 writes the resume file, the checkpoint and the version row (the
  scheduler's ``rl_update`` task runs it in one process);
- **result**: the new version is evaluated on the fixed held-out task set, saved and recorded
  (``policy_versions``), and its id, checkpoint and metrics are returned. The metrics say where the
  rewards came from: ``batch/sessions`` distinct sessions trained on, ``batch/model_scored`` of them
  rewarded by the model's score, and ``reward/model`` the promoted reward model that scored them
  (absent when none did).

Inputs (:class:`TrainRequest`, all optional): ``base_version`` (else the newest version), ``lr`` and
``steps`` (overrides; the demo's gate drill uses a destructive ``lr``), ``groups_per_step``,
``eval`` (``EvalConfig`` fields), ``label`` (kept in the version's metrics), ``since``/``until``,
``now`` (the time labels are built at: which signals have arrived and which horizons have elapsed).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import structlog
import torch
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, selectinload
from transformers import PreTrainedModel

from ingest.db import make_engine
from policy.advantages import RunningBaseline
from policy.config import PolicyConfig
from policy.distributed import (
    barrier,
    broadcast,
    is_main,
    load_model_and_optim_state,
    model_and_optim_state,
    on_cpu,
    place,
    shard,
    train_device,
    unsharded_copy,
    world,
)
from policy.evaluate import EvalConfig, evaluate
from policy.model import load_checkpoint, save_checkpoint
from policy.pipeline import train_config
from policy.rollouts import Rollout, filter_stale, version_number
from policy.tables import PolicyVersionRow
from policy.trainer import make_optimizer, update_step
from policy.trajectories import session_trajectories, turn_of
from policy.versions import latest_version, lineage, list_versions, record_version, version_id
from reward_models.config import RewardsConfig
from reward_models.guard import HackingReport

log = structlog.get_logger(__name__)

GROUPS_PER_STEP = 8
"""Candidate groups in one optimizer step (K=4 candidates each: 32 rollouts)."""
MAX_CONTEXT = 1024
"""Longest training window in tokens (longer agent sessions are split into windows)."""


@dataclass(frozen=True)
class TrainRequest:
    """What one production RL update trains on and how (see the module docstring)."""

    base_version: str | None = None
    steps: int | None = None
    lr: float | None = None
    groups_per_step: int = GROUPS_PER_STEP
    eval: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    since: datetime | None = None
    """First session time included (None: from the first session)."""
    until: datetime | None = None
    """First session time excluded (None: up to now)."""
    now: datetime | None = None
    """When the labels are built (None: the current time; a simulation passes its clock)."""


def session_rewards(
    engine: Engine,
    rewards_config: RewardsConfig,
    now: datetime | None = None,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, float]:
    """Reward in [0, 1] per stored session of ``[since, until)``: the composite label, else ``sigmoid``
    of the promoted reward model's score (only with ``rewards_config.rl_reward == "assisted"``), one
    source per candidate group (the model scores only groups nobody labeled, unless
    ``rl_score_partial_groups``); sessions with neither are left out."""
    return rewards_with_source(engine, rewards_config, now, since=since, until=until)[0]


@dataclass
class RewardSources:
    """What an update's rewards are made of: the reward per session, the sessions rewarded by their
    label (the others by the model's score), and the reward-hacking guard's report when it was
    consulted (``flagged``: the model's scores were left out)."""

    rewards: dict[str, float]
    labeled: set[str]
    guard: HackingReport | None = None
    model: str | None = None
    """The reward-model version that scored the sessions not in ``labeled`` (None: it scored none)."""


def rewards_with_source(
    engine: Engine,
    rewards_config: RewardsConfig,
    now: datetime | None = None,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
) -> tuple[dict[str, float], set[str]]:
    """:func:`session_rewards` and the sessions whose reward is their label (the others carry the
    reward model's score)."""
    sources = reward_sources(engine, rewards_config, now, since=since, until=until)
    return sources.rewards, sources.labeled


def reward_sources(
    engine: Engine,
    rewards_config: RewardsConfig,
    now: datetime | None = None,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
) -> RewardSources:
    """:func:`rewards_with_source` with the guard's report. Before the promoted model scores anything,
    the reward-hacking guard (``rl_hacking_guard_z``) compares its scores of the newest policy versions
    with their final retention: a model whose score the policy raised while retention fell is not
    trained on (labels only) until a model the guard does not flag is promoted."""
    from reward_models.api import hacking_check, load_scorer
    from reward_models.data import load_sessions, load_signals
    from reward_models.labels import build_labels
    from reward_models.registry import current_promoted

    sessions = load_sessions(engine, since=since, until=until)
    if sessions.empty:
        return RewardSources({}, set())
    now = now or datetime.now(UTC)
    labels = build_labels(sessions, load_signals(engine), rewards_config, now).sessions
    reward = labels["reward"]
    out = {str(k): float(v) for k, v in reward.items() if np.isfinite(v)}
    if rewards_config.rl_reward == "labels" or current_promoted(engine) is None:
        return RewardSources(out, set(out))
    guard = None
    if rewards_config.rl_hacking_guard_z > 0:
        guard = hacking_check(engine, rewards_config, now=now, min_z=rewards_config.rl_hacking_guard_z)
        if guard.flagged:
            log.warning("production.reward_model_flagged", reason=guard.reason)
            return RewardSources(out, set(out), guard)
    # GRPO compares the members of a group with each other, so a group takes its rewards from one
    # source: a label of 0 next to model scores around 0.5 would rank a rejected pick below candidates
    # nobody judged. A group with a label keeps its labels (its unlabeled members wait, as without a
    # model) and only groups nobody labeled are scored; with rl_score_partial_groups, every group not
    # labeled in full is scored in full (its labels dropped).
    labeled = sessions["session_id"].astype(str).isin(list(out)).to_numpy()
    group = _reward_groups(sessions)
    if rewards_config.rl_score_partial_groups:
        mask = group.isin(set(group[~labeled])).to_numpy()  # every member of a group with an unlabeled one
    else:
        mask = (~group.isin(set(group[labeled]))).to_numpy()  # the groups without any label
    scored = sessions[mask]
    model = None
    if not scored.empty:
        shown = scored if rewards_config.rl_score_confidence else _without_confidence(scored)
        scorer = load_scorer(engine)
        model = scorer.version
        scores = _model_scores(scorer, shown, rewards_config.rl_uncertainty_penalty)
        probability = 1.0 / (1.0 + np.exp(-scores))
        if rewards_config.rl_model_reward == "best_of_group":
            probability = _best_of_group(group[mask].to_numpy(), scores, probability)
        for sid, p in zip(scored["session_id"], probability, strict=True):
            out[str(sid)] = float(p)
    labeled_ids = set(sessions["session_id"].astype(str)[~mask])
    return RewardSources(out, labeled_ids & set(out), guard, model)


def _model_scores(scorer: Any, frame: Any, penalty: float) -> np.ndarray:
    """The reward model's log-odds for ``frame``: its score, or with ``penalty`` > 0 the lower bound
    ``score - penalty x standard error`` over the users who trained it (logged: how far it moved)."""
    if penalty <= 0:
        return np.asarray(scorer.score(frame), dtype=np.float64)
    score, error = scorer.score_with_error(frame)
    log.info(
        "production.pessimistic_reward",
        sessions=len(score),
        penalty=penalty,
        error_mean=float(np.mean(error)) if len(error) else 0.0,
        error_max=float(np.max(error)) if len(error) else 0.0,
    )
    return np.asarray(score - penalty * error, dtype=np.float64)


def _without_confidence(frame: Any) -> Any:
    """``frame`` with the served-logprob summaries blanked: the reward model scores the text alone."""
    from reward_models.data import LOGPROB_COLUMNS

    return frame.assign(**{column: np.nan for column in LOGPROB_COLUMNS if column in frame})


def _best_of_group(keys: np.ndarray, scores: np.ndarray, probability: np.ndarray) -> np.ndarray:
    """1 for the top-scored member of each group of 2 or more (the first on a tie), 0 for the others;
    a session alone keeps its probability."""
    frame = pd.DataFrame({"key": keys, "score": scores})
    size = frame.groupby("key")["score"].transform("size").to_numpy()
    best = frame.groupby("key")["score"].idxmax().to_numpy()  # the first on a tie
    out = np.where(size >= 2, 0.0, probability)
    out[best[size[best] >= 2]] = 1.0
    return out


def _reward_groups(sessions: Any) -> Any:
    """Each stored session's comparison group: its candidate group, else the group of parallel agent
    sessions its turn ran in, else its agent session, else itself."""
    group = sessions["group_id"].astype(object)
    for column in ("agent_group", "agent_session", "session_id"):
        if column in sessions:
            group = group.where(group.notna(), sessions[column])
    return group.astype(str)


def load_rollouts(
    engine: Engine, rewards: dict[str, float], *, max_tokens: int, labeled: set[str] | None = None
) -> tuple[list[Rollout], set[str]]:
    """Rollouts of the stored sessions that have a reward (segments loaded with the sessions); the
    turns of an agent session are joined into one trajectory (:mod:`policy.trajectories`). Also the
    rollouts' session ids whose every rewarded stored row is in ``labeled`` (trained on a label)."""
    from ingest.tables import SessionRow

    with Session(engine) as db:
        rows = list(
            db.scalars(
                select(SessionRow)
                .where(SessionRow.session_id.in_(list(rewards)))
                .options(selectinload(SessionRow.segments))
                .order_by(SessionRow.occurred_at, SessionRow.session_id)
            )
        )
        rollouts, stats = session_trajectories(
            rows, lambda s: rewards.get(str(getattr(s, "session_id", ""))), max_tokens=max_tokens
        )
        known = labeled or set()
        unlabeled = {
            str((turn_of(row) or {}).get("session_id") or row.session_id)
            for row in rows
            if str(row.session_id) not in known
        }
    if stats.sessions:
        log.info("production.trajectories", **vars(stats))
    return rollouts, {str(r.session_id) for r in rollouts if r.session_id} - unlabeled


def plan_batches(
    rollouts: list[Rollout],
    steps: int,
    groups_per_step: int,
    seed: int,
    *,
    singles: bool = True,
    first: set[str] | None = None,
    max_epochs: float = 0.0,
) -> list[list[str]]:
    """Session ids per step: whole candidate groups (2+ sessions) and, with ``singles``, sessions
    alone or in a group of one (trained against the running baseline), ``groups_per_step`` units a
    step, shuffled by ``seed`` and cycled. A session's windows always travel together (one id).

    With ``first``, units whose every session is in it (rewarded by a label) come before the others
    (scored by the reward model) in each cycle: the model's scores fill the draws the labels leave,
    never displace a label; the steps are then shuffled, so the model-scored ones do not all come last.

    With ``max_epochs`` > 0, fewer steps when the data is short: at most that many passes over the units
    (at least one step), so a handful of rewarded groups is not drawn again and again."""
    groups: dict[str, list[str]] = {}
    for r in rollouts:
        if r.session_id:
            key = f"g:{r.group_id}" if r.group_id else f"s:{r.session_id}"
            members = groups.setdefault(key, [])
            if r.session_id not in members:
                members.append(r.session_id)
    usable = sorted(g for g, m in groups.items() if len(m) >= 2 or singles)
    if not usable:
        return []
    primary = [g for g in usable if first is None or set(groups[g]) <= first]
    rest = [g for g in usable if g not in set(primary)]
    rng = random.Random(seed)
    rng.shuffle(primary)
    rng.shuffle(rest)
    order = primary + rest
    if max_epochs > 0:
        steps = min(steps, max(1, math.ceil(max_epochs * len(order) / max(groups_per_step, 1))))
    out = []
    for step in range(steps):
        picked = [order[(step * groups_per_step + i) % len(order)] for i in range(min(groups_per_step, len(order)))]
        out.append([sid for g in picked for sid in groups[g]])
    if primary and rest:
        rng.shuffle(out)
    return out


class ProductionSession:
    """A preemptible RL update from production rollouts (see the module docstring)."""

    def __init__(
        self, config: PolicyConfig, rewards_config: RewardsConfig, database_url: str, home: Path, request: TrainRequest
    ) -> None:
        self.cfg = config
        self.engine = make_engine(database_url)
        root = Path(self.cfg.checkpoints_dir)
        self.root = root if root.is_absolute() else Path(home) / root
        torch.set_num_threads(self.cfg.threads)
        self.parent = self._parent(request.base_version)
        self.number = max((version_number(v.version_id) or 0) for v in list_versions(self.engine)) + 1
        self.label = request.label
        tcfg = train_config(self.cfg, request.steps)
        tcfg = replace(tcfg, seed=self.cfg.seed * 7919 + self.number)
        if request.lr:
            tcfg = replace(tcfg, lr=float(request.lr))
        self.tcfg = tcfg
        self.eval_cfg = EvalConfig(**request.eval)
        self.model, self.tokenizer = load_checkpoint(self.parent.checkpoint_path)
        place(self.model, train_device(self.cfg.device))
        if world()[1] > 1 and self.cfg.parallel == "fsdp":
            shard(self.model)
        self.opt = make_optimizer(self.model, tcfg)
        self.step_no = 0
        self.history: list[dict[str, float]] = []
        sources = reward_sources(self.engine, rewards_config, request.now, since=request.since, until=request.until)
        self.guard = sources.guard  # the reward-hacking guard's report (flagged: the model's scores left out)
        rewards, labeled = sources.rewards, sources.labeled
        rollouts, from_label = load_rollouts(self.engine, rewards, max_tokens=MAX_CONTEXT, labeled=labeled)
        base_number = version_number(self.parent.version_id) or 0
        line = None
        if self.cfg.rl_lineage_only:
            line = {n for v in lineage(self.engine, self.parent.version_id) if (n := version_number(v)) is not None}
        fresh, stats = filter_stale(rollouts, base_number, self.cfg.max_staleness, lineage=line)
        self.stale = stats
        self.from_label = from_label  # rollouts rewarded by their label (the others: the model's score)
        first = from_label if rewards_config.rl_labels_first else None
        plan = plan_batches(
            fresh, tcfg.steps, request.groups_per_step, tcfg.seed, first=first, max_epochs=self.cfg.rl_max_epochs
        )
        # what the version's metrics say about its rewards: how many planned sessions the promoted reward
        # model scored, and which model that was (the retrain before this update may have registered a
        # newer candidate that the gate did not promote: its scores trained nothing)
        self.model_scored = len({sid for ids in plan for sid in ids} - from_label)  # distinct sessions
        self.reward_model = sources.model if self.model_scored else None
        if not plan:
            raise RuntimeError(
                f"no rewarded session of policy {self.parent.version_id} or the {self.cfg.max_staleness} "
                "versions before it is stored yet; let users send requests and signals first"
            )
        self._by_id: dict[str, list[Rollout]] = {}
        for r in fresh:
            self._by_id.setdefault(str(r.session_id), []).append(r)
        # an agent session's id is not a stored row's: its reward is the one its trajectory carries
        self.plan = [[(sid, self._by_id[sid][0].reward) for sid in ids] for ids in plan]
        self.baseline = RunningBaseline()
        self.reference_version: str | None = None  # loaded only for an update that has data to train on
        self.reference = self._reference() if tcfg.loss.kl_coef > 0 else None

    def _parent(self, version: str | None) -> PolicyVersionRow:
        if version:
            with Session(self.engine) as db:
                row = db.get(PolicyVersionRow, version)
                if row is not None:
                    db.expunge(row)
                    return row
        row = latest_version(self.engine)
        if row is None:
            raise RuntimeError("no policy version yet; train v0 first (`undertow policy warmup`)")
        return row

    def _reference(self) -> PreTrainedModel:
        """The frozen reference policy of the KL term (``PolicyConfig.kl_reference``), on the trainer's device."""
        row = self.parent
        if self.cfg.kl_reference == "base":
            versions = list_versions(self.engine)  # oldest first
            row = next((v for v in versions if v.parent_id is None), versions[0])
        model, _ = load_checkpoint(row.checkpoint_path)
        place(model, train_device(self.cfg.device))
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.reference_version = row.version_id
        return model

    @property
    def done(self) -> bool:
        return self.step_no >= len(self.plan)

    def _batch(self, step: int) -> list[Rollout]:
        out = []
        for sid, reward in self.plan[step]:
            out += [replace(r, reward=reward) for r in self._by_id.get(sid, [])]
        return out

    def step(self) -> dict[str, float]:
        """One step on the next planned batch: GRPO over its groups, the running baseline for singles."""
        batch = self._batch(self.step_no)
        metrics = update_step(self.model, self.opt, batch, self.tcfg, baseline=self.baseline, ref_model=self.reference)
        self.step_no += 1
        self.history.append(metrics)
        log.info("production.step", step=self.step_no, reward=round(metrics["reward/mean"], 3), rollouts=len(batch))
        return metrics

    def save(self, path: Path) -> None:
        """Weights, optimizer, step and the batch plan in one file (whole tensors; rank 0 writes)."""
        model_state, optim_state = model_and_optim_state(self.model, self.opt)
        if is_main():
            state = {"model": model_state, "optim": optim_state, "step": self.step_no}
            state["baseline"] = self.baseline.state_dict()
            sources = {"model_scored": self.model_scored, "reward_model": self.reward_model}
            torch.save({**state, "plan": self.plan, "history": self.history, "number": self.number, **sources}, path)
        barrier()

    def load(self, path: Path) -> None:
        """Restore :meth:`save` (the plan too: a resumed run trains on the same batches)."""
        state = torch.load(path, weights_only=False)
        load_model_and_optim_state(self.model, self.opt, state["model"], state["optim"])
        self.step_no, self.plan, self.history = int(state["step"]), state["plan"], state["history"]
        self.number = int(state["number"])
        self.model_scored = int(state.get("model_scored", self.model_scored))
        self.reward_model = state.get("reward_model", self.reward_model)
        if "baseline" in state:
            self.baseline = RunningBaseline.from_state(state["baseline"])

    def result(self) -> dict[str, Any]:
        """Evaluate on the held-out set, save the checkpoint and record the version row."""
        metrics: dict[str, Any] = {
            "train/steps": float(self.step_no),
            "train/lr": self.tcfg.lr,
            "reward/mean": float(np.mean([h["reward/mean"] for h in self.history])) if self.history else 0.0,
            "batch/rollouts": float(sum(len(p) for p in self.plan)),
            "batch/sessions": float(len({sid for batch in self.plan for sid, _ in batch})),
            "batch/model_scored": float(self.model_scored),
            "batch/off_lineage_dropped": float(self.stale.off_lineage),
        }
        if self.reward_model is not None:
            metrics["reward/model"] = self.reward_model
        if self.guard is not None and self.guard.flagged:
            metrics["reward/model_flagged"] = self.guard.reason
        if self.label:
            metrics["label"] = self.label
        if self.reference_version is not None:
            metrics["train/kl_reference"] = self.reference_version
            kls = [h["loss/kl"] for h in self.history if "loss/kl" in h]
            metrics["train/kl"] = float(np.mean(kls)) if kls else 0.0
        whole = unsharded_copy(self.model)  # rank 0 only: evaluation and the checkpoint need whole tensors
        if whole is None:
            return dict(broadcast(None))
        whole = on_cpu(whole)
        metrics.update(evaluate(whole, self.tokenizer, self.eval_cfg))
        vid = version_id(self.number)
        path = save_checkpoint(whole, self.tokenizer, self.root / vid)
        row = record_version(
            self.engine,
            version=vid,
            parent=self.parent.version_id,
            step=self.parent.step + self.step_no,
            checkpoint_path=path,
            metrics=metrics,
            num_samples=int(metrics["batch/rollouts"]),
            num_dropped_stale=self.stale.dropped,
            staleness_mean=self.stale.mean,
            staleness_max=self.stale.max,
        )
        log.info("policy.version", version=vid, keep_rate=metrics.get("eval/keep_rate"), label=self.label or None)
        result = {
            "version": row.version_id,
            "parent": row.parent_id,
            "checkpoint": str(path),
            "metrics": metrics,
            "staleness": {
                "kept": self.stale.kept,
                "dropped": self.stale.dropped,
                "off_lineage": self.stale.off_lineage,
                "mean": self.stale.mean,
            },
            "trained_sessions": sorted({sid for batch in self.plan for sid, _ in batch}),
        }
        return dict(broadcast(result))
