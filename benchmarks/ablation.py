"""Does the reward model carry the reward? RL from simulated users with labels only, against labels
plus the promoted reward model's score, on the same seeds; scored by the users' true utility.

One closed loop per seed and arm, in process, on a fresh SQLite database:

- **v0** is a modest supervised warm-up (:func:`policy.sft.warmup`, ``--sft-steps``), trained once and
  cached under ``<home>/bench-cache`` (the key holds the warm-up settings; ``--v0 DIR`` uses a checkpoint
  directory instead), recorded as version ``v0000``.
- **rounds**: each round is ``--round-minutes`` of simulated time. The arm's current version samples
  ``--groups`` candidate groups of K on training tasks (:func:`policy.rollouts.rollouts_from_tasks`:
  tokens, served logprobs and routed experts), stored as ``session.completed`` events through the
  ingest writer (:func:`ingest.writer.write_events`, what the consumer calls), spread over the round.
  A user of :class:`scheduler.demo.population.Population` is drawn per group and reacts; each signal
  is stored once the simulated clock passes its arrival. The round's update runs at its end, after
  every due signal, before the 1 h retention of its newest sessions (let alone the day and the week)
  arrived.
- **update**, the only difference between the arms (same steps, learning rate, groups per step and
  plan seeds; no held-out evaluation inside):

  - ``assisted``: the loop's retrain rule (:func:`reward_models.triggers.retrain_decision`: no model
    promoted yet, or ``--rm-min-new-labels`` labeled sessions newer than the promoted model's window;
    the age and drift triggers off) trains and maybe promotes a reward model
    (:func:`reward_models.train.train_reward_models`, its own promotion gate); then a
    :class:`policy.production.ProductionSession` with ``rl_reward = "assisted"``: every label a
    labels-only update would train on, and the promoted model's score for every member of a group
    nobody labeled (one scale per GRPO group); labeled units take the update's draws first and the
    model-scored ones fill the rest (``--no-labels-first``: one shuffle over both);
  - ``labels``: the same session with ``rl_reward = "labels"``: sessions without a label wait.

  An update with nothing to train on (no rewarded session yet) is skipped and counted. Options of
  both arms' updates: ``--kl-coef`` (KL to v0), ``--max-epochs`` (passes over the data an update takes
  at most), ``--advantage`` (``grpo_batch``: the group's mean, the batch's std); of the assisted arm:
  ``--no-score-confidence`` (the model scores without the served logprobs).
- **score**: v0 (once) and each arm's last version on the held-out tasks (single completions,
  ``--eval-per-tier`` tasks per tier, ``--eval-samples`` each, the evaluator's fixed seed), scored by
  :meth:`Population.expected_utility` from the keep and pass rates. Gain in points: ``100 x (final -
  v0)``. The true utility of what users were served stays in this process (``served_utility_by_round``,
  the diagnostics below); it is never stored.

Same seed, same draws: both arms of a seed get the same population, tasks, users (drawn with the same
random stream; a user who churned in one arm only is the exception) and reaction streams, and the
same sampling seeds (identical sessions while the policies are equal: round 0).

Prints one JSON object: per arm the gain's mean, std (ddof 1), min, max and per-seed values, the
keep and pass rates, the sessions trained on and where their rewards came from (a label or the
reward model), the reward models trained and promoted (and the updates that left the model out because the
reward-hacking guard flagged it, ``RewardsConfig.rl_hacking_guard_z``); the per-seed difference; whether assisted beat
labels-only by more than the spread (``verdict.rule``); the conditions and the wall time. Diagnostics,
from the true utility this process kept: ``reward_quality`` (per reward source, how well the rewards
the updates trained with track the true utility: Pearson correlation, within-group pairwise
agreement, and the advantages as the updates computed them: their cosine with the true centred
utilities, the share of trained groups whose true utilities all tie, and the share of the advantages'
squared norm on those groups, which GRPO's per-group scaling gives a full unit of push in whatever
direction the reward's noise points) and ``groups_mixing_sources`` (trained groups where some
candidates had a label and the others the model's score). ``--workers`` runs (seed, arm) jobs in
parallel processes, one torch thread each.

Retention: labels use the retention measured so far (``rewards.retention_require_final`` false, the
default), so a session's 1 h retention reaches the updates a round or two after it in both arms, and a
later horizon revises it. ``--rewards retention_require_final=true`` makes labels wait for the longest
horizon (one day), as the product did before 2026-12-06; what follows is that case. With the default
twelve simulated hours no session reaches its final retention horizon, so the labels are selections,
accepts and rejects, and model switches; both arms alike. With longer rounds (``--round-minutes 360``:
four simulated days) retention becomes final a day after its session, when the session is four or more
updates old (an update trains on sessions at most ``policy.max_staleness`` = 4 versions behind, so
labels-only gets little of it), but in time for the reward model, which then carries it to fresh
sessions (``docs/BENCHMARKS.md``, "Late retention"). With rounds of four hours (``--round-minutes 240``:
six updates a simulated day) a session's retention is final six or more updates after it, past the
staleness limit: labels-only never trains on retention and the reward model is its only way into an
update. ``--max-staleness`` (both arms) lifts the limit, so labels-only can train on those late labels
off-policy: the baseline that waits for the labels instead of predicting them. The default (labels use
retention measured so far) is the baseline that does not wait at all (``docs/BENCHMARKS.md``, "Retention
measured so far").

The room a reward signal has: the labels-only arm run with users who label nearly everything,
nearly exactly (``--population select_rate=1 --population accept_rate=1 --population retention_rate=1
--population noise_max=0.02 --population bad_actor_share=0``) is what a reward model as good as a label
on every session could reach at best; its gain over the scarce labels-only arm bounds what the
assisted arm can add (``docs/BENCHMARKS.md``, "How much room a reward signal has in the ablation").

A control, ``--noisy-truth PEARSON``: the assisted arm's model-scored sessions train on their true
utility plus Gaussian noise drawn anew for every session and update (at that Pearson correlation with
the truth) instead of the model's score; the same sessions, labels and plan. A reward model of the same
accuracy that gains less than this control loses by its error being the same in every update (a
function of the text), which the policy can follow, not by its accuracy.

The assisted arm is pessimistic by default (``RewardsConfig.rl_uncertainty_penalty`` 2: model-scored
sessions train on the score minus two standard errors over the users who trained the model);
``--rewards rl_uncertainty_penalty=0`` gives the plain score. ``--arms assisted`` runs that arm alone;
labels-only is deterministic on one machine, so it pairs by seed with an earlier run's.

Run: ``python benchmarks/ablation.py`` (defaults: seeds 0,1,2, 16 rounds of 32 groups; ``--quick`` for a
smoke run).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import heapq  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import Future, ProcessPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from datetime import UTC, datetime, timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = ("assisted", "labels")
T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
"""Start of the simulated clock."""
NO_EVAL = {"per_tier": 0, "agent_per_tier": 0}


@dataclass(frozen=True)
class AblationConfig:
    """Sizes of one ablation run (the command line's options)."""

    seeds: tuple[int, ...] = (0, 1, 2)
    rounds: int = 16
    """Updates per arm; each after one round of simulated time (16 x 45 min: 12 simulated hours)."""
    groups: int = 32
    """Candidate groups served per round."""
    k: int = 4
    """Candidates per group."""
    round_minutes: float = 45.0
    """Simulated minutes per round (shorter than the first retention horizon, 1 h)."""
    steps: int = 8
    """Optimizer steps per update."""
    advantage: str = "grpo"
    """Advantage estimator of both arms (``PolicyConfig.advantage``: grpo, grpo_batch, reinforce, rloo)."""
    model_reward: str = "probability"
    """How the assisted arm rewards a group the reward model scores (``RewardsConfig.rl_model_reward``)."""
    labels_first: bool = True
    """Labeled groups take an update's draws first, model-scored ones fill the rest
    (``RewardsConfig.rl_labels_first``)."""
    score_confidence: bool = True
    """The reward model sees the served logprobs when it scores for RL (``RewardsConfig.rl_score_confidence``)."""
    population: tuple[tuple[str, float | bool], ...] = ()
    """Overrides of :class:`scheduler.demo.population.PopulationConfig` knobs (name, value)."""
    rewards: tuple[tuple[str, float | bool], ...] = ()
    """Overrides of :class:`reward_models.config.RewardsConfig` settings of both arms (name, value), e.g.
    ``retention_require_final=True``: labels and the retention head wait for retention's longest horizon."""
    lr: float = 3e-4
    """Learning rate of the updates."""
    max_epochs: float = 0.0
    """Passes over the rewarded groups an update takes at most (``PolicyConfig.rl_max_epochs``; 0: no cap)."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (``PolicyConfig.kl_coef``; 0: off)."""
    kl_reference: str = "base"
    """The KL's reference (``PolicyConfig.kl_reference``): ``base`` (v0) or ``parent``."""
    max_staleness: int = 4
    """Versions an update's sessions may lag its parent (``PolicyConfig.max_staleness``): older ones wait
    no longer for their labels; a larger value lets labels-only train on late labels off-policy."""
    groups_per_step: int = 8
    """Units (candidate groups, or sessions alone) per optimizer step."""
    max_tokens: int = 48
    temperature: float = 1.0
    sft_steps: int = 300
    """Warm-up steps of v0 (modest: v0 has room to improve)."""
    eval_per_tier: int = 48
    """Held-out tasks per tier (3 tiers; tier 3 has 48) in the final evaluation."""
    eval_samples: int = 8
    """Samples per held-out task."""
    rm_min_new_labels: int = 50
    """Retrain the reward model when this many labeled sessions are newer than the promoted one's window."""
    workers: int = 2
    """(seed, arm) jobs run at once, one process and one torch thread each."""
    arms: tuple[str, ...] = ARMS
    """The arms run (both by default). One arm alone has no difference or verdict: labels-only is
    deterministic on one machine, so a variant of the assisted arm can be paired with an earlier run's
    labels-only figures by seed."""
    noisy_truth: float | None = None
    """A control, not a product setting: the assisted arm's model-scored sessions train on their true
    utility plus fresh Gaussian noise instead of the model's score, the noise set per update so that
    the scores' Pearson correlation with the truth is this value. The same sessions, labels and plan:
    what differs from the model is only that the error is drawn anew for every session and update
    instead of being a function of the text."""

    @property
    def round_s(self) -> float:
        return self.round_minutes * 60.0


QUICK = AblationConfig(seeds=(0,), rounds=2, groups=12, steps=2, groups_per_step=4, sft_steps=40)
QUICK = replace(QUICK, eval_per_tier=4, eval_samples=2, rm_min_new_labels=10, workers=1)


def v0_checkpoint(home: Path, sft_steps: int, seed: int = 0) -> Path:
    """The cached warm-up checkpoint (trained and saved atomically when missing)."""
    from policy.model import PRESETS_REVISION, save_checkpoint
    from policy.sft import SFTConfig, warmup
    from policy.tokenizer import REVISION

    key = f"ablation-v0-tiny-seed{seed}-sft{sft_steps}-tok{REVISION}-m{PRESETS_REVISION}"
    path = home / "bench-cache" / key
    if (path / "config.json").exists():
        return path
    import torch

    torch.set_num_threads(1)
    model, tokenizer, _ = warmup(SFTConfig(preset="tiny", seed=seed, steps=sft_steps))
    tmp = path.with_name(key + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tokenizer, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _iso(ts: datetime) -> str:
    return ts.isoformat()


def session_event(
    sid: str, user: str, at: datetime, version: str, group: str, index: int, rollout: Any, prompt_text: str, body: str
) -> dict[str, Any]:
    """A ``session.completed`` envelope as the gateway emits it for one candidate of a group."""
    from ingest.arrays import npy_to_b64

    segment = {"role": "assistant", "text": body, "token_ids": [int(t) for t in rollout.completion_ids]}
    if rollout.served_logprobs is not None:
        segment["logprobs"] = [float(x) for x in rollout.served_logprobs]
    payload: dict[str, Any] = {
        "model": "undertow",
        "policy_version": version,
        "prompt": {"text": prompt_text, "token_ids": [int(t) for t in rollout.prompt_ids]},
        "segments": [segment],
        "sampling": {"temperature": 1.0, "max_tokens": 48},
        "group_id": group,
        "candidate_index": index,
    }
    if rollout.routed_experts is not None:
        payload["routed_experts"] = npy_to_b64(rollout.routed_experts)
    return {
        "schema_version": 1,
        "event_id": f"ev-{sid}",
        "type": "session.completed",
        "occurred_at": _iso(at),
        "session_id": sid,
        "user_id": user,
        "payload": payload,
    }


def signal_event(signal: Any, n: int, at: datetime, user: str, group: str, ids: list[str]) -> dict[str, Any]:
    """The envelope of one population signal, with the ids the caller owns added."""
    payload = dict(signal.payload)
    if signal.type == "candidates.shown":
        payload.update(group_id=group, session_ids=list(ids))
    elif signal.type == "candidate.selected":
        payload.update(group_id=group, chosen_session_id=ids[signal.index])
    event: dict[str, Any] = {
        "schema_version": 1,
        "event_id": f"sig-{group}-{n}",
        "type": signal.type,
        "occurred_at": _iso(at),
        "user_id": user,
        "payload": payload,
    }
    if signal.index is not None:
        event["session_id"] = ids[signal.index]
    return event


def store(engine: Any, events: list[dict[str, Any]]) -> None:
    """Validate and store events the way the consumer does (idempotent on ``event_id``)."""
    if not events:
        return
    from ingest.db import transaction
    from ingest.schemas import validate_event
    from ingest.writer import write_events

    with transaction(engine) as db:
        write_events(db, [validate_event(e) for e in events])


@dataclass
class Pending:
    """Signals not arrived yet, by arrival time."""

    heap: list[tuple[datetime, int, dict[str, Any]]] = field(default_factory=list)
    count: int = 0

    def push(self, at: datetime, event: dict[str, Any]) -> None:
        heapq.heappush(self.heap, (at, self.count, event))
        self.count += 1

    def due(self, now: datetime) -> list[dict[str, Any]]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            out.append(heapq.heappop(self.heap)[2])
        return out


def _serve_round(
    model: Any, tokenizer: Any, cfg: AblationConfig, seed: int, rnd: int, version: str, population: Any
) -> tuple[list[dict[str, Any]], list[tuple[datetime, dict[str, Any]]], dict[str, float], dict[str, float]]:
    """Sample the round's groups, draw a user per group and their reactions: the session events, the
    signals with their arrival times, the served outcomes' mean true utility and keep and pass rates, and
    each session's true utility (kept in this process, never stored)."""
    import numpy as np

    from policy.evaluate import decode_body
    from policy.rollouts import rollouts_from_tasks, version_number
    from policy.tasks import train_tasks
    from scheduler.demo.population import Outcome

    tasks = random.Random(f"tasks/{seed}/{rnd}").sample(train_tasks(), cfg.groups)
    rollouts = rollouts_from_tasks(
        model,
        tokenizer,
        tasks,
        group_size=cfg.k,
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens,
        seed=seed * 100_003 + rnd,
        version=version_number(version) or 0,
    )
    by_task: dict[int, list[Any]] = {}
    for r in rollouts:
        by_task.setdefault(int(str(r.group_id).rsplit("/", 1)[1]), []).append(r)
    sessions, signals = [], []
    utilities, kept, passed, confidence = [], [], [], []
    truth: dict[str, float] = {}
    start = T0 + timedelta(seconds=rnd * cfg.round_s)
    for g, task in enumerate(tasks):
        members = by_task.get(g, [])
        if len(members) < 2:
            continue
        at = start + timedelta(seconds=(g + 0.5) * cfg.round_s / cfg.groups)
        group = f"grp-{seed}-{rnd}-{g}"
        user = population.draw(random.Random(f"user/{seed}/{rnd}/{g}"))
        ids = [f"s-{seed}-{rnd}-{g}-{i}" for i in range(len(members))]
        outcomes = []
        for i, r in enumerate(members):
            body = decode_body(tokenizer, r.completion_ids)
            lines = max(1, sum(1 for line in body.splitlines() if line.strip()))
            outcomes.append(
                Outcome(
                    passed=bool(r.info["passed"]),
                    kept=bool(r.info["kept"]),
                    lines=lines,
                    size=int(r.info["size"]),
                    size_limit=task.size_limit,
                )
            )
            sessions.append(session_event(ids[i], user.user_id, at, version, group, i, r, task.prompt, body))
        reaction = population.react(user, outcomes, grouped=True, rng=random.Random(f"react/{seed}/{rnd}/{g}"))
        for n, s in enumerate(reaction.signals):
            when = at + timedelta(seconds=s.delay_s)
            signals.append((when, signal_event(s, n, when, user.user_id, group, ids)))
        utilities += list(reaction.utility)
        truth.update(zip(ids, reaction.utility, strict=True))
        kept += [o.kept for o in outcomes]
        confidence += [float(np.nanmean(r.served_logprobs)) for r in members if r.served_logprobs is not None]
        passed += [o.passed for o in outcomes]
    n = max(len(utilities), 1)
    served = {
        "utility": sum(utilities) / n,
        "keep_rate": sum(kept) / n,
        "pass_rate": sum(passed) / n,
        "mean_logprob": statistics.fmean(confidence) if confidence else float("nan"),
    }
    return sessions, signals, served, truth


def reward_quality(
    records: list[tuple[str, str, float, float]], method: str = "grpo"
) -> dict[str, dict[str, float | int | None]]:
    """How well each reward source tracks the true utility, over ``(group, source, reward, utility)`` of
    the trained sessions: Pearson correlation, and the within-group pairwise agreement (pairs of one
    group and one source whose true utilities differ: 1 when the rewards order them alike, 0.5 on a
    reward tie), which is what a group-relative advantage uses; and :func:`advantage_alignment` under
    the updates' ``method``."""
    import numpy as np

    from benchmarks.rm_features import pairwise_accuracy

    out: dict[str, dict[str, float | int | None]] = {}
    for source in ("label", "reward_model"):
        rows = [r for r in records if r[1] == source]
        rewards = np.array([r[2] for r in rows], dtype=float)
        utils = np.array([r[3] for r in rows], dtype=float)
        pearson = None
        if len(rows) > 2 and rewards.std() > 0 and utils.std() > 0:
            pearson = float(np.corrcoef(rewards, utils)[0, 1])
        agreement, pairs = pairwise_accuracy([r[0] for r in rows], utils.tolist(), rewards.tolist())
        out[source] = {
            "sessions": len(rows),
            "pearson": pearson,
            "pairs": pairs,
            "pairwise_agreement": agreement if pairs else None,
            **advantage_alignment(rows, method),
        }
    return out


def advantage_alignment(
    rows: list[tuple[str, str, float, float]], method: str = "grpo"
) -> dict[str, float | int | None]:
    """Where the advantages of ``(round/group, source, reward, utility)`` rows point, computed as the
    update computes them (``method``, per round): their cosine with the groups' centred true utilities
    (1: the update's direction is the true one), the share of groups of 2 or more whose true utilities
    all tie (no true direction at all), and the share of the advantages' squared norm on those groups
    (what the update follows that is noise only). Sessions alone (no group to compare with) are left out."""
    import numpy as np

    from policy.advantages import compute_advantages

    members: dict[str, list[tuple[float, float]]] = {}
    for group, _, reward, utility in rows:
        members.setdefault(group, []).append((reward, utility))
    by_round: dict[str, list[str]] = {}
    for group, items in members.items():
        if len(items) >= 2:
            by_round.setdefault(group.split("/", 1)[0], []).append(group)
    dot = adv_sq = true_sq = tied_sq = 0.0
    groups = tied = 0
    for names in by_round.values():
        keys = [name for name in names for _ in members[name]]
        rewards = [reward for name in names for reward, _ in members[name]]
        advantages = compute_advantages(rewards, keys, [""] * len(keys), method=method)
        at = 0
        for name in names:
            n = len(members[name])
            adv = np.array(advantages[at : at + n])
            at += n
            utils = np.array([u for _, u in members[name]], dtype=float)
            centred = utils - utils.mean()
            groups += 1
            dot += float(adv @ centred)
            adv_sq += float(adv @ adv)
            true_sq += float(centred @ centred)
            if np.ptp(utils) == 0:
                tied += 1
                tied_sq += float(adv @ adv)
    cosine = dot / float(np.sqrt(adv_sq * true_sq)) if adv_sq > 0 and true_sq > 0 else None
    return {
        "advantage_cosine": cosine,
        "groups": groups,
        "tied_groups_share": tied / groups if groups else None,
        "advantage_on_tied_groups": tied_sq / adv_sq if adv_sq > 0 else None,
    }


def noisy_truth(
    plan: list[list[tuple[str, float]]], labeled: set[str], truth: dict[str, float], pearson: float, rng: random.Random
) -> list[list[tuple[str, float]]]:
    """``plan`` with every session not in ``labeled`` rewarded by its true utility plus independent
    Gaussian noise of std ``sd(truth) * sqrt(1/pearson^2 - 1)`` (over those sessions): scores whose
    Pearson correlation with the truth is ``pearson`` in expectation, with an error drawn anew each time."""
    scored = [truth[sid] for batch in plan for sid, _ in batch if sid not in labeled]
    sd = statistics.pstdev(scored) if scored else 0.0
    noise = sd * math.sqrt(1.0 / pearson**2 - 1.0)
    return [
        [(sid, reward if sid in labeled else truth[sid] + rng.gauss(0.0, noise)) for sid, reward in batch]
        for batch in plan
    ]


def mixed_groups(records: list[tuple[str, str, float, float]]) -> dict[str, float | int]:
    """Trained groups whose members' rewards came from both sources (some labels, some scores): their
    group-relative advantages compare a label with a score on another scale."""
    sources: dict[str, set[str]] = {}
    for group, source, _, _ in records:
        sources.setdefault(group, set()).add(source)
    mixed = sum(len(s) > 1 for s in sources.values())
    return {"groups": len(sources), "mixed": mixed, "share": mixed / len(sources) if sources else 0.0}


def _retrain(engine: Any, rewards: Any, home: Path, now: datetime) -> dict[str, Any]:
    """The loop's retrain rule, then a training run (which promotes or not by its own gate)."""
    from reward_models.train import TrainingDataError, train_reward_models
    from reward_models.triggers import retrain_decision

    decision = retrain_decision(engine, rewards, now=now)
    if not decision.retrain:
        return {"trained": False}
    try:
        report = train_reward_models(engine, rewards, home, now=now)
    except TrainingDataError as exc:
        return {"trained": False, "reason": str(exc)[:160]}
    return {"trained": True, "promoted": report.promoted, "status": report.status, "reason": report.reason[:160]}


def policy_config(cfg: AblationConfig, seed: int) -> Any:
    """Both arms' update settings (:class:`policy.config.PolicyConfig`) for ``seed``."""
    from policy.config import PolicyConfig

    return PolicyConfig(
        seed=seed,
        threads=1,
        advantage=cfg.advantage,
        kl_coef=cfg.kl_coef,
        kl_reference=cfg.kl_reference,
        rl_max_epochs=cfg.max_epochs,
        max_staleness=cfg.max_staleness,
    )


def rewards_config(cfg: AblationConfig, arm: str) -> Any:
    """An arm's reward settings (:class:`reward_models.config.RewardsConfig`): its reward source, the
    retrain rule (age trigger off) and the ``--rewards`` overrides both arms share (an override of a
    setting another option gives wins)."""
    from reward_models.config import RewardsConfig

    base: dict[str, Any] = {
        "rl_reward": arm,
        "rl_model_reward": cfg.model_reward,
        "rl_labels_first": cfg.labels_first,
        "rl_score_confidence": cfg.score_confidence,
        "retrain_min_new_labels": cfg.rm_min_new_labels,
        "retrain_interval_s": 10**9,
    }
    return RewardsConfig(**{**base, **dict(cfg.rewards)})


def run_arm(
    arm: str, seed: int, cfg: AblationConfig, v0_path: str, workdir: str, progress: Any = None
) -> dict[str, Any]:
    """One closed loop (see the module docstring); returns its figures."""
    import torch

    from ingest.db import make_engine, upgrade
    from policy.evaluate import EvalConfig, evaluate
    from policy.model import load_checkpoint
    from policy.production import ProductionSession, TrainRequest, session_rewards
    from policy.versions import record_version, version_id
    from reward_models.registry import current_promoted
    from scheduler.runtime.logs import configure_logging

    configure_logging("WARNING")
    torch.set_num_threads(1)
    home = Path(workdir) / f"{arm}-seed{seed}"
    home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{home / 'undertow.db'}"
    upgrade(url)
    engine = make_engine(url)
    record_version(engine, version=version_id(0), parent=None, step=0, checkpoint_path=Path(v0_path), metrics={})
    population = make_population(cfg, seed)
    rewards = rewards_config(cfg, arm)
    labels_only = rewards.model_copy(update={"rl_reward": "labels"})
    policy = policy_config(cfg, seed)
    model, tokenizer = load_checkpoint(v0_path)
    version = version_id(0)
    pending = Pending()
    rounds: list[dict[str, Any]] = []
    truth: dict[str, float] = {}
    quality: list[tuple[str, str, float, float]] = []
    for rnd in range(cfg.rounds):
        sessions, signals, served, served_truth = _serve_round(model, tokenizer, cfg, seed, rnd, version, population)
        truth.update(served_truth)
        store(engine, sessions)
        for when, event in signals:
            pending.push(when, event)
        now = T0 + timedelta(seconds=(rnd + 1) * cfg.round_s)
        arrived = pending.due(now)
        store(engine, arrived)
        row: dict[str, Any] = {"round": rnd, "version": version, "served": served, "signals_arrived": len(arrived)}
        if arm == "assisted":
            row["reward_model"] = _retrain(engine, rewards, home, now)
        row["reward_model_promoted"] = current_promoted(engine) is not None
        label_of = session_rewards(engine, labels_only, now)
        row["labeled_sessions"] = len(label_of)
        request = TrainRequest(
            steps=cfg.steps,
            lr=cfg.lr,
            groups_per_step=cfg.groups_per_step,
            eval=dict(NO_EVAL),
            label=f"{arm} round {rnd}",
            now=now,
        )
        try:
            trainer = ProductionSession(policy, rewards, url, home, request)
        except RuntimeError as exc:
            if "no rewarded session" not in str(exc):
                raise
            row["skipped"] = True
        else:
            if cfg.noisy_truth is not None:
                rng = random.Random(f"noisy-truth/{seed}/{rnd}")
                trainer.plan = noisy_truth(trainer.plan, trainer.from_label, truth, cfg.noisy_truth, rng)
            used = {sid: reward for batch in trainer.plan for sid, reward in batch}
            labeled = trainer.from_label & set(used)
            for sid, reward in used.items():
                group = sid.rsplit("-", 1)[0]
                quality.append((f"{rnd}/{group}", "label" if sid in labeled else "reward_model", reward, truth[sid]))
            while not trainer.done:
                trainer.step()
            result = trainer.result()
            trained = set(result["trained_sessions"])
            row.update(
                skipped=False,
                trained_sessions=len(trained),
                from_label=len(trained & labeled),
                from_reward_model=len(trained - labeled),
                reward_mean=result["metrics"]["reward/mean"],
                kl=result["metrics"].get("train/kl"),
                steps=len(trainer.plan),
                model_flagged=result["metrics"].get("reward/model_flagged"),
            )
            version = result["version"]
            model, tokenizer = load_checkpoint(result["checkpoint"])
        rounds.append(row)
        if progress is not None:
            progress.put(1)
    final = evaluate(model, tokenizer, EvalConfig(per_tier=cfg.eval_per_tier, samples_per_task=cfg.eval_samples))
    if progress is not None:
        progress.put(1)
    engine.dispose()
    return {
        "arm": arm,
        "seed": seed,
        "final_version": version,
        "keep_rate": final["eval/keep_rate"],
        "pass_rate": final["eval/pass_rate"],
        "utility": population.expected_utility(final["eval/keep_rate"], final["eval/pass_rate"]),
        "rounds": rounds,
        "reward_quality": reward_quality(quality, cfg.advantage),
        "groups_mixing_sources": mixed_groups(quality),
        "database": url,
    }


def make_population(cfg: AblationConfig, seed: int) -> Any:
    """The seed's population, with the configured knob overrides."""
    from scheduler.demo.population import Population, PopulationConfig

    return Population(PopulationConfig(**dict(cfg.population)), seed=seed)


def evaluate_v0(v0_path: str, cfg: AblationConfig, progress: Any = None) -> dict[str, float]:
    """v0's held-out keep and pass rates (the same evaluation as the arms' final versions)."""
    import torch

    from policy.evaluate import EvalConfig, evaluate
    from policy.model import load_checkpoint
    from scheduler.runtime.logs import configure_logging

    configure_logging("WARNING")
    torch.set_num_threads(1)
    model, tokenizer = load_checkpoint(v0_path)
    out = evaluate(model, tokenizer, EvalConfig(per_tier=cfg.eval_per_tier, samples_per_task=cfg.eval_samples))
    if progress is not None:
        progress.put(1)
    return {"keep_rate": out["eval/keep_rate"], "pass_rate": out["eval/pass_rate"]}


def spread(values: list[float]) -> dict[str, float | None]:
    """Mean, std (ddof 1; None for one value), min and max."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
    }


def _mean_of(values: Any) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _arm_summary(runs: list[dict[str, Any]], v0_utility: dict[int, float]) -> dict[str, Any]:
    gains = {r["seed"]: 100.0 * (r["utility"] - v0_utility[r["seed"]]) for r in runs}
    updates = [row for r in runs for row in r["rounds"]]
    done = [row for row in updates if not row.get("skipped")]
    label = sum(row["from_label"] for row in done)
    scored = sum(row["from_reward_model"] for row in done)
    rms = [row["reward_model"] for row in updates if "reward_model" in row]
    return {
        "gain_points": {**spread(list(gains.values())), "per_seed": gains},
        "keep_rate": {r["seed"]: r["keep_rate"] for r in runs},
        "pass_rate": {r["seed"]: r["pass_rate"] for r in runs},
        "utility": {r["seed"]: r["utility"] for r in runs},
        "updates": len(done),
        "updates_skipped": len(updates) - len(done),
        "trained_sessions": label + scored,
        "trained_sessions_per_update": (label + scored) / max(len(done), 1),
        "reward_source": {
            "label": label,
            "reward_model": scored,
            "label_share": label / max(label + scored, 1),
            "reward_model_share": scored / max(label + scored, 1),
        },
        "reward_models": {
            "trained": sum(bool(x.get("trained")) for x in rms),
            "promoted": sum(bool(x.get("promoted")) for x in rms),
            "updates_with_a_promoted_model": sum(bool(row["reward_model_promoted"]) for row in updates),
            # updates that left the promoted model's scores out: the reward-hacking guard flagged it
            "updates_with_the_model_flagged": sum(bool(row.get("model_flagged")) for row in done),
        },
        "reward_quality": {
            source: {
                "sessions": sum(int(r["reward_quality"][source]["sessions"] or 0) for r in runs),
                "pearson_mean_over_seeds": _mean_of(r["reward_quality"][source]["pearson"] for r in runs),
                **{
                    f"{key}_mean_over_seeds": _mean_of(r["reward_quality"][source].get(key) for r in runs)
                    for key in (
                        "pairwise_agreement",
                        "advantage_cosine",
                        "tied_groups_share",
                        "advantage_on_tied_groups",
                    )
                },
            }
            for source in ("label", "reward_model")
        },
        "groups_mixing_sources": {
            "groups": sum(int(r["groups_mixing_sources"]["groups"]) for r in runs),
            "mixed": sum(int(r["groups_mixing_sources"]["mixed"]) for r in runs),
        },
        "served_utility_by_round": _by_round(runs, "utility"),
        "served_mean_logprob_by_round": _by_round(runs, "mean_logprob"),
        "runs": runs,
    }


def _by_round(runs: list[dict[str, Any]], key: str) -> list[float]:
    """The mean over seeds of each round's served ``key``."""
    return [statistics.fmean(r["rounds"][i]["served"][key] for r in runs) for i in range(len(runs[0]["rounds"]))]


def _jobs(cfg: AblationConfig, v0_path: str, workdir: str, progress: Any) -> tuple[dict[str, float], list[Any]]:
    """v0's evaluation and every (seed, arm) loop, in ``cfg.workers`` processes (in this one for 1)."""
    jobs = [(arm, seed) for seed in cfg.seeds for arm in cfg.arms]
    if cfg.workers <= 1:
        v0 = evaluate_v0(v0_path, cfg, progress)
        return v0, [run_arm(arm, seed, cfg, v0_path, workdir, progress) for arm, seed in jobs]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=cfg.workers, mp_context=ctx) as pool:
        futures: list[Future[Any]] = [
            pool.submit(run_arm, arm, seed, cfg, v0_path, workdir, progress) for arm, seed in jobs
        ]
        v0_future = pool.submit(evaluate_v0, v0_path, cfg, progress)
        return v0_future.result(), [f.result() for f in futures]


def run(cfg: AblationConfig, v0: Path | None, home: Path, keep: Path | None = None) -> dict[str, Any]:
    """The whole ablation; returns the JSON object."""
    from tqdm import tqdm

    started = time.monotonic()
    v0_source = "given" if v0 is not None else "cache"
    v0_path = v0 if v0 is not None else v0_checkpoint(home, cfg.sft_steps)
    setup_s = time.monotonic() - started
    workdir = Path(tempfile.mkdtemp(prefix="ablation-")) if keep is None else keep
    total = len(cfg.seeds) * len(cfg.arms) * (cfg.rounds + 1) + 1
    manager = multiprocessing.get_context("spawn").Manager() if cfg.workers > 1 else None
    progress: Any = manager.Queue() if manager is not None else queue.SimpleQueue()
    bar = tqdm(total=total, desc="ablation (rounds and evaluations)", file=sys.stderr, unit="step")
    try:
        import threading

        done = threading.Event()

        def pump() -> None:
            while not done.is_set() or not progress.empty():
                try:
                    bar.update(progress.get(timeout=0.2))
                except queue.Empty:
                    continue

        pumper = threading.Thread(target=pump, daemon=True)
        pumper.start()
        v0_rates, runs = _jobs(cfg, str(v0_path), str(workdir), progress)
        done.set()
        pumper.join()
    finally:
        bar.close()
        if manager is not None:
            manager.shutdown()
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    v0_utility = {
        s: make_population(cfg, s).expected_utility(v0_rates["keep_rate"], v0_rates["pass_rate"]) for s in cfg.seeds
    }
    arms = {arm: _arm_summary([r for r in runs if r["arm"] == arm], v0_utility) for arm in cfg.arms}
    return {
        "arms": arms,
        "v0": {"source": v0_source, **v0_rates, "utility": v0_utility},
        **_verdict(arms, cfg.seeds),
        "conditions": {
            **{k: v for k, v in asdict(cfg).items() if k != "seeds"},
            "seeds": list(cfg.seeds),
            "simulated_minutes_per_round": cfg.round_minutes,
            "population": "scheduler.demo.population.PopulationConfig() defaults"
            + "".join(f", {k}={v}" for k, v in cfg.population),
            "rewards": "reward_models.config.RewardsConfig() defaults" + "".join(f", {k}={v}" for k, v in cfg.rewards),
            "retrain_rule": "reward_models.triggers.retrain_decision: no promoted model, or >= "
            f"{cfg.rm_min_new_labels} labeled sessions newer than its window (age and drift triggers off)",
            "eval": f"{cfg.eval_per_tier} held-out tasks per tier x 3 tiers x {cfg.eval_samples} samples, "
            "single completions, EvalConfig seed",
            "machine_threads": os.cpu_count(),
            "torch_threads_per_job": 1,
            "load_average_at_end": list(os.getloadavg()),
        },
        "setup_s": setup_s,
        "wall_s": time.monotonic() - started,
    }


def _verdict(arms: dict[str, Any], seeds: tuple[int, ...]) -> dict[str, Any]:
    """The assisted arm's gain minus labels-only's per seed and the verdict (both None with one arm)."""
    if set(ARMS) - set(arms):
        return {"difference_points": None, "verdict": None}
    diffs = {
        s: arms["assisted"]["gain_points"]["per_seed"][s] - arms["labels"]["gain_points"]["per_seed"][s] for s in seeds
    }
    stds = [arms[a]["gain_points"]["std"] for a in ARMS]
    worst = max((s for s in stds if s is not None), default=None)
    mean_diff = statistics.fmean(diffs.values())
    return {
        "difference_points": {**spread(list(diffs.values())), "per_seed": diffs},
        "verdict": {
            "assisted_beats_labels_by_more_than_spread": worst is not None and mean_diff > worst,
            "rule": "mean over seeds of (assisted gain - labels-only gain) > the larger of the two arms' gain std "
            "(ddof 1, over seeds); undecided (false) with one seed",
            "margin_points": None if worst is None else mean_diff - worst,
        },
    }


def parse_args(argv: list[str] | None = None) -> tuple[AblationConfig, argparse.Namespace]:
    from policy.advantages import METHODS

    d = AblationConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--seeds", default=",".join(map(str, d.seeds)), help="comma-separated seeds (3 or more for a spread)"
    )
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--groups", type=int, default=d.groups, help="candidate groups per round")
    p.add_argument("--k", type=int, default=d.k, help="candidates per group")
    p.add_argument("--round-minutes", type=float, default=d.round_minutes, help="simulated minutes per round")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per update")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--max-epochs", type=float, default=d.max_epochs, help="passes over the data per update (0: no cap)")
    p.add_argument("--kl-coef", type=float, default=d.kl_coef, help="KL to the reference policy (0: off)")
    p.add_argument("--kl-reference", choices=("base", "parent"), default=d.kl_reference)
    p.add_argument(
        "--max-staleness",
        type=int,
        default=d.max_staleness,
        help="versions an update's sessions may lag (both arms; larger: labels-only trains on late labels off-policy)",
    )
    p.add_argument("--advantage", choices=METHODS, default=d.advantage)
    p.add_argument("--model-reward", choices=("probability", "best_of_group"), default=d.model_reward)
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument(
        "--labels-first",
        action=argparse.BooleanOptionalAction,
        default=d.labels_first,
        help="labeled groups take the draws first (--no-labels-first: one shuffle over both sources)",
    )
    p.add_argument(
        "--score-confidence",
        action=argparse.BooleanOptionalAction,
        default=d.score_confidence,
        help="the reward model sees the served logprobs when it scores sessions for RL",
    )
    p.add_argument(
        "--population",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="override a PopulationConfig knob, e.g. select_rate=0.2 (repeatable)",
    )
    p.add_argument(
        "--rewards",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="override a numeric or boolean RewardsConfig setting of both arms, e.g. "
        "retention_require_final=false (repeatable)",
    )
    p.add_argument("--sft-steps", type=int, default=d.sft_steps, help="warm-up steps of v0 (cached)")
    p.add_argument("--eval-per-tier", type=int, default=d.eval_per_tier)
    p.add_argument("--eval-samples", type=int, default=d.eval_samples)
    p.add_argument("--rm-min-new-labels", type=int, default=d.rm_min_new_labels)
    p.add_argument("--workers", type=int, default=d.workers, help="(seed, arm) jobs at once")
    p.add_argument(
        "--arms",
        default=",".join(d.arms),
        help="comma-separated arms to run: assisted, labels (one alone: no difference or verdict)",
    )
    p.add_argument(
        "--noisy-truth",
        type=float,
        default=None,
        metavar="PEARSON",
        help="a control: the assisted arm's model-scored sessions train on true utility plus fresh noise "
        "at this Pearson correlation with it, instead of the model's score",
    )
    p.add_argument("--v0", type=Path, default=None, help="an existing v0 checkpoint directory")
    p.add_argument("--home", type=Path, default=Path(".undertow"), help="Undertow home (v0 cache)")
    p.add_argument("--keep", type=Path, default=None, help="keep the databases and checkpoints in this directory")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (1 seed, 2 rounds, small sizes)")
    p.add_argument("--json", action="store_true", help="print one JSON object (always printed; `make bench` passes it)")
    args = p.parse_args(argv)
    if args.quick:
        return QUICK, args
    cfg = AblationConfig(
        seeds=tuple(int(s) for s in str(args.seeds).split(",") if s.strip()),
        rounds=args.rounds,
        groups=args.groups,
        k=args.k,
        round_minutes=args.round_minutes,
        steps=args.steps,
        lr=args.lr,
        max_epochs=args.max_epochs,
        kl_coef=args.kl_coef,
        kl_reference=args.kl_reference,
        max_staleness=args.max_staleness,
        advantage=args.advantage,
        model_reward=args.model_reward,
        labels_first=args.labels_first,
        score_confidence=args.score_confidence,
        population=tuple(_knob(item) for item in args.population),
        rewards=tuple(_rewards_knob(item) for item in args.rewards),
        groups_per_step=args.groups_per_step,
        sft_steps=args.sft_steps,
        eval_per_tier=args.eval_per_tier,
        eval_samples=args.eval_samples,
        rm_min_new_labels=args.rm_min_new_labels,
        workers=args.workers,
        noisy_truth=args.noisy_truth,
        arms=tuple(a.strip() for a in str(args.arms).split(",") if a.strip()),
    )
    if not cfg.arms or set(cfg.arms) - set(ARMS) or len(set(cfg.arms)) != len(cfg.arms):
        raise SystemExit(f"--arms: one or both of {', '.join(ARMS)}, each once; got {args.arms!r}")
    if cfg.noisy_truth is not None and not 0.0 < cfg.noisy_truth <= 1.0:
        raise SystemExit(f"--noisy-truth: a Pearson correlation in (0, 1], got {cfg.noisy_truth}")
    from pydantic import ValidationError

    try:  # an override out of its setting's range fails here, not in a worker after the warm-up
        rewards_config(cfg, ARMS[0])
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SystemExit(f"--rewards: {why}") from None
    return cfg, args


def _override(item: str, defaults: Any, option: str) -> tuple[str, float | bool]:
    """``name=value`` of a numeric or boolean field of ``defaults`` (a config object) given to ``option``:
    an integer stays an integer, a boolean is ``true`` or ``false``; anything else exits with the reason."""
    name, sep, value = item.partition("=")
    default = getattr(defaults, name, None) if sep else None
    kind = type(defaults).__name__
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            raise SystemExit(f"{option} {name}: {value!r} is not true or false")
        return name, value.lower() == "true"
    if not isinstance(default, int | float):
        raise SystemExit(f"{option} expects KNOB=VALUE with a numeric or boolean {kind} setting, got {item!r}")
    try:
        return name, type(default)(value)
    except ValueError:
        raise SystemExit(f"{option} {name}: {value!r} is not a {type(default).__name__}") from None


def _knob(item: str) -> tuple[str, float | bool]:
    """``--population name=value``: a PopulationConfig knob."""
    from scheduler.demo.population import PopulationConfig

    return _override(item, PopulationConfig(), "--population")


def _rewards_knob(item: str) -> tuple[str, float | bool]:
    """``--rewards name=value``: a RewardsConfig setting of both arms."""
    from reward_models.config import RewardsConfig

    return _override(item, RewardsConfig(), "--rewards")


def main(argv: list[str] | None = None) -> None:
    from scheduler.runtime.logs import configure_logging

    configure_logging("WARNING")  # stdout carries the one JSON object
    cfg, args = parse_args(argv)
    print(json.dumps(run(cfg, args.v0, args.home, args.keep), default=str))


if __name__ == "__main__":
    main()
