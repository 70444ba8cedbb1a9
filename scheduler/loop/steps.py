"""The loop's steps: each takes the typed :class:`LoopState`, calls one layer's public function and
returns the state with its outcome filled in. No step knows which step comes next (the job's kind
decides, :data:`scheduler.loop.state.JOB_STEPS`), and each is idempotent, so a step delivered twice
(a worker killed mid-step, a Redis or RabbitMQ redelivery) leaves the same effect as once:

- ``collect``: what the database holds and the version the pool serves;
- ``retrain``: :func:`reward_models.train.train_reward_models` on the job's window, when the
  triggers (:func:`reward_models.triggers.retrain_decision`, drift included: the promoted reward
  model's scores on recent sessions, :func:`reward_models.api.recent_scores`) say so or the job
  forces it;
- ``rl_update`` lives in :mod:`scheduler.loop.tasks` (it borrows replicas and can be preempted);
- ``snapshot``: :meth:`policy.weights.WeightStore.put`, a delta against the serving version (a
  version already stored is read back, not stored again);
- ``rollout``: :func:`serving.deploy.rollout`, canary and gated stages on the gateway's online
  metrics and the reward-hacking guard (:func:`reward_models.api.promotion_check`), rolled back by
  itself when a gate fails (a pool already on the version is left alone);
- ``promote`` / ``rollback``: :func:`serving.actions.promote` / :func:`serving.actions.rollback` on
  the job's deployment; a promotion the guard refuses fails the job with the guard's reason
  (``force`` on the job overrides the guard);
- ``evaluate``: the version's held-out metrics.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import func, select

from ingest.db import transaction
from ingest.tables import DeadLetterRow, SessionRow, SignalRow
from policy.weights import WeightStore, open_store
from reward_models.api import promotion_check, recent_scores
from reward_models.guard import HackingReport
from reward_models.registry import PROMOTED, current_promoted, trained_by
from reward_models.train import TrainingDataError, train_reward_models
from reward_models.triggers import RetrainDecision, retrain_decision
from scheduler.loop.state import DeploymentOutcome, IngestCounts, LoopState, RewardModelOutcome, SnapshotOutcome
from serving import actions, deploy
from serving.fleet import get_target

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings


@dataclass(frozen=True)
class StepContext:
    """What every step may use: the worker's settings and database."""

    settings: Settings
    engine: Engine

    def store(self) -> WeightStore:
        """The policy weight store."""
        return open_store(self.settings.policy, self.settings.home)


def _target(engine: Engine, pool: str) -> str | None:
    target = get_target(engine, pool)
    return target.version if target else None


def collect(ctx: StepContext, state: LoopState) -> LoopState:
    """Ingest health: what the database holds now, and the version the pool serves."""
    with ctx.engine.connect() as conn:
        counts = IngestCounts(
            sessions=conn.scalar(select(func.count()).select_from(SessionRow)) or 0,
            signals=conn.scalar(select(func.count()).select_from(SignalRow)) or 0,
            dead_letters=conn.scalar(select(func.count()).select_from(DeadLetterRow)) or 0,
        )
    return state.model_copy(update={"ingest": counts, "serving_version": _target(ctx.engine, state.pool)})


def promotion_guard(ctx: StepContext) -> deploy.GuardCheck:
    """The reward-hacking guard the deployer and the promote action judge a new version with."""

    def check(candidate: str, incumbent: str) -> HackingReport:
        return promotion_check(ctx.engine, ctx.settings.rewards, candidate=candidate, incumbent=incumbent)

    return check


def decide_retrain(ctx: StepContext) -> RetrainDecision:
    """The retrain triggers, drift included: the promoted reward model scores the newest sessions it
    was not trained on, and :func:`reward_models.triggers.retrain_decision` compares them with its reference."""
    return retrain_decision(
        ctx.engine, ctx.settings.rewards, recent_scores=recent_scores(ctx.engine, ctx.settings.rewards)
    )


def _promoted(engine: Engine, reasons: list[str]) -> RewardModelOutcome:
    row = current_promoted(engine)
    return RewardModelOutcome(
        retrained=False,
        reasons=reasons,
        version=row.version if row else None,
        status=row.status if row else None,
        primary_metric=row.primary_metric if row else None,
    )


def retrain(ctx: StepContext, state: LoopState) -> LoopState:
    """Retrain the reward models on the job's window when forced or when the triggers fire (once per
    job: a redelivered retrain reports the version its first run registered)."""
    done = trained_by(ctx.engine, state.run_id)
    if done is not None:
        again = RewardModelOutcome(
            retrained=True,
            reasons=["registered by an earlier delivery of this job"],
            version=done.version,
            status=done.status,
            promoted=done.status == PROMOTED,
            primary_metric=done.primary_metric,
            window=state.window,
        )
        return state.model_copy(update={"reward_model": again})
    reasons = ["forced by the job"] if state.force else []
    if not state.force:
        decision = decide_retrain(ctx)
        if not decision.retrain:
            return state.model_copy(update={"reward_model": _promoted(ctx.engine, decision.reasons)})
        reasons = decision.reasons
    try:
        report = train_reward_models(
            ctx.engine,
            ctx.settings.rewards,
            ctx.settings.home,
            since=state.window.since,
            until=state.window.until,
            resolved_config={**ctx.settings.resolved(), "job_id": state.run_id},
        )
    except TrainingDataError as exc:
        if state.force:
            raise  # an operator asked for this window: say why it cannot be trained
        return state.model_copy(update={"reward_model": _promoted(ctx.engine, [*reasons, str(exc)])})
    outcome = RewardModelOutcome(
        retrained=True,
        reasons=reasons,
        version=report.version,
        status=report.status,
        promoted=report.promoted,
        primary_metric=report.primary_metric,
        n_train=report.n_train,
        n_holdout=report.n_holdout,
        window=state.window,
    )
    return state.model_copy(update={"reward_model": outcome})


def snapshot(ctx: StepContext, state: LoopState) -> LoopState:
    """Store the trained checkpoint as a new weights version (a delta against the serving version)."""
    if state.rl_update is None:
        raise ValueError("snapshot needs an RL update's checkpoint; run rl_update first")
    store = ctx.store()
    version = state.rl_update.version
    known = set(store.version_ids())
    if version in known:
        manifest = store.manifest(version)
    else:
        parent = state.serving_version or _target(ctx.engine, state.pool)
        manifest = store.put(
            state.rl_update.checkpoint, version=version, parent=parent if parent in known else "latest"
        )
    outcome = SnapshotOutcome(version=manifest.version, weights_hash=manifest.version_hash, parent=manifest.parent)
    return state.model_copy(
        update={"snapshot": outcome, "version": manifest.version, "weights_hash": manifest.version_hash}
    )


def _gateway_metrics(settings: Settings) -> deploy.MetricsSource:
    """The gateway's per-version online metrics (what the deployment gate compares)."""
    url = f"http://127.0.0.1:{settings.serving.gateway_port}/gateway/metrics"
    secret = settings.serving.gateway.metrics_key
    key = secret.get_secret_value() if secret else None
    headers = {"authorization": f"Bearer {key}"} if key else {}

    async def metrics() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10, headers=headers) as client:
            response = await client.get(url)
            response.raise_for_status()
            return response.json()  # type: ignore[no-any-return]

    return metrics


def _stages(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in st.items() if k not in ("started_at", "finished_at")} for st in stages]


def rollout(ctx: StepContext, state: LoopState) -> LoopState:
    """Roll the job's version out by delta: canary, then the gated stages (rolled back on a failed gate)."""
    if state.version is None:
        raise ValueError("rollout needs a version: the job's or the snapshot's")
    weights_hash = state.weights_hash or ctx.store().manifest(state.version).version_hash
    target = get_target(ctx.engine, state.pool)
    if target is not None and (target.version, target.weights_hash) == (state.version, weights_hash):
        outcome = DeploymentOutcome(
            status="unchanged",
            message=f"{state.pool} already serves {state.version}",
            version=state.version,
            target=target.version,
        )
    else:
        cfg = ctx.settings.serving
        result = asyncio.run(
            deploy.rollout(
                ctx.engine,
                state.version,
                weights_hash,
                cfg.deploy,
                pool=state.pool,
                kind="auto",
                metrics=_gateway_metrics(ctx.settings),
                fleet_config=cfg.fleet,
                guard=promotion_guard(ctx),
            )
        )
        outcome = DeploymentOutcome(
            deployment_id=result.deployment_id,
            status=result.status,
            message=result.message,
            version=state.version,
            target=_target(ctx.engine, state.pool),
            stages=_stages(result.stages),
        )
    return state.model_copy(
        update={"deployment": outcome, "weights_hash": weights_hash, "deployment_id": outcome.deployment_id}
    )


def _act(ctx: StepContext, state: LoopState, action: str) -> LoopState:
    if state.deployment_id is None or state.version is None:
        raise ValueError(f"{action} needs the deployment to act on and the version it leaves the pool on")
    cfg = ctx.settings.serving
    if action == "promote":
        run = actions.promote(
            ctx.engine, state.deployment_id, cfg.deploy, cfg.fleet, guard=promotion_guard(ctx), force=state.force
        )
    else:
        run = actions.rollback(ctx.engine, state.deployment_id, cfg.deploy, cfg.fleet)
    result = asyncio.run(run)
    outcome = DeploymentOutcome(
        deployment_id=result.follow_up or result.deployment_id,
        status=result.status if result.changed else "unchanged",
        message=result.message,
        version=state.version,
        target=result.target,
    )
    return state.model_copy(update={"deployment": outcome})


def promote(ctx: StepContext, state: LoopState) -> LoopState:
    """Skip the remaining gates of the job's deployment: the whole pool moves to its version, unless the
    reward-hacking guard flags it (the job fails with the guard's reason; ``force`` overrides)."""
    return _act(ctx, state, "promote")


def rollback(ctx: StepContext, state: LoopState) -> LoopState:
    """Put the pool of the job's deployment back on the version it served before."""
    return _act(ctx, state, "rollback")


def evaluate(ctx: StepContext, state: LoopState) -> LoopState:
    """Held-out metrics of the version: recorded with its row by the trainer, else computed now."""
    from policy.evaluate import EvalConfig
    from policy.evaluate import evaluate as run_eval
    from policy.model import load_checkpoint
    from policy.tables import PolicyVersionRow

    version = state.version
    if version is None:
        raise ValueError("evaluate needs a version")
    with transaction(ctx.engine) as db:
        row = db.get(PolicyVersionRow, version)
        metrics, path = (dict(row.metrics or {}), row.checkpoint_path) if row is not None else ({}, None)
    if "eval/keep_rate" not in metrics:
        if path is None:
            raise ValueError(f"policy version {version} is not recorded; nothing to evaluate")
        model, tokenizer = load_checkpoint(path)
        metrics.update(run_eval(model, tokenizer, EvalConfig(**state.rl.eval)))
    evaluation = {k: float(v) for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, int | float)}
    return state.model_copy(update={"evaluation": evaluation})
