"""Adapters from loop steps to the layer functions they call: one call each, ids in and ids out.

Every step has the signature ``step(settings, engine, state) -> dict`` where ``state`` is the
JSON dict the chain carries (run id, versions, verdicts) and the returned dict is merged into it.
``SchedulerConfig.steps`` can replace any step by ``module:function`` (an operator's own canary,
or a test's). Every default step calls a real layer function: ``collect`` (database counts and the serving
version), ``retrain`` (:func:`reward_models.train.train_reward_models` when the triggers fire),
``snapshot`` (:meth:`policy.weights.WeightStore.put`: a delta against the serving version),
``canary`` (:func:`serving.deploy.rollout`: canary and progressive stages gated on the gateway's
``/gateway/metrics``, automatic rollback), ``promote``/``rollback`` (check and record where the
fleet ended), ``evaluate`` (held-out metrics of the version).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.tasks.borrowing import resolve

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings

State = dict[str, Any]


def collect(settings: Settings, engine: Engine, state: State) -> State:
    """Ingest health: what the database holds now (sessions, signals, dead letters)."""
    from sqlalchemy import func, select

    from ingest.tables import DeadLetterRow, SessionRow, SignalRow

    with engine.connect() as conn:
        counts = {
            "sessions": conn.scalar(select(func.count()).select_from(SessionRow)) or 0,
            "signals": conn.scalar(select(func.count()).select_from(SignalRow)) or 0,
            "dead_letters": conn.scalar(select(func.count()).select_from(DeadLetterRow)) or 0,
        }
    return {"ingest": counts, "serving_version": state.get("serving_version") or _target(engine)}


def _promoted_rm(engine: Engine) -> dict[str, Any]:
    from reward_models.registry import current_promoted

    row = current_promoted(engine)
    return {} if row is None else {"version": row.version, "primary_metric": row.primary_metric, "status": row.status}


def retrain(settings: Settings, engine: Engine, state: State) -> State:
    """Retrain the reward model when :func:`reward_models.triggers.retrain_decision` says so."""
    from reward_models.train import TrainingDataError, train_reward_models
    from reward_models.triggers import retrain_decision

    decision = retrain_decision(engine, settings.rewards)
    if not decision.retrain:
        return {"reward_model": {"retrained": False, "reasons": decision.reasons, **_promoted_rm(engine)}}
    try:
        report = train_reward_models(engine, settings.rewards, settings.home, resolved_config=settings.resolved())
    except TrainingDataError as exc:
        return {"reward_model": {"retrained": False, "reasons": [str(exc)], **_promoted_rm(engine)}}
    return {
        "reward_model": {
            "retrained": True,
            "version": report.version,
            "promoted": report.promoted,
            "status": report.status,
            "primary_metric": report.primary_metric,
            "n_train": report.n_train,
            "n_holdout": report.n_holdout,
        }
    }


def _store(settings: Settings) -> Any:
    from policy.weights import WeightStore

    url = settings.policy.weights_url
    if "://" not in url and not Path(url).is_absolute():
        url = str(Path(settings.home) / url)
    return WeightStore(url, settings.policy.weights)


def _gateway_metrics(settings: Settings) -> Any:
    """The gateway's per-version online metrics (what the deployment gate compares)."""
    import httpx

    url = f"http://127.0.0.1:{settings.serving.gateway_port}/gateway/metrics"

    async def metrics() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10) as client:
            return (await client.get(url)).json()  # type: ignore[no-any-return]

    return metrics


def snapshot(settings: Settings, engine: Engine, state: State) -> State:
    """Store the trained checkpoint in the weight store as a delta against the serving version."""
    store = _store(settings)
    version = state["rl_update"]["version"]
    parent = state.get("serving_version")
    known = set(store.version_ids())
    manifest = store.put(
        state["rl_update"]["checkpoint"], version=version, parent=parent if parent in known else "latest"
    )
    return {"policy_version": manifest.version, "weights_hash": manifest.version_hash}


def _rollout(settings: Settings, engine: Engine, state: State) -> dict[str, Any]:
    import asyncio
    import dataclasses

    from serving.deploy import rollout

    result = asyncio.run(
        rollout(
            engine,
            state["policy_version"],
            state["weights_hash"],
            settings.serving.deploy,
            kind="auto",
            metrics=_gateway_metrics(settings),
            fleet_config=settings.serving.fleet,
        )
    )
    out = dataclasses.asdict(result)
    for stage in out["stages"]:
        stage.pop("started_at", None)
        stage.pop("finished_at", None)
    return out


def canary(settings: Settings, engine: Engine, state: State) -> State:
    """Deploy by delta: canary, then the progressive stages, each judged by the gate on the gateway's
    online metrics (:func:`serving.deploy.rollout`, which rolls back by itself when a gate fails)."""
    result = _rollout(settings, engine, state)
    canary_stage = result["stages"][0] if result["stages"] else {}
    return {
        "canary": {
            "passed": result["status"] == "succeeded",
            "outcome": canary_stage.get("outcome"),
            "deployment": result,
        }
    }


def _target(engine: Engine) -> str | None:
    from serving.fleet import get_target

    target = get_target(engine)
    return target.version if target else None


def promote(settings: Settings, engine: Engine, state: State) -> State:
    """The gated stages already brought the whole fleet to the version: check and record it."""
    served = _target(engine)
    if served != state["policy_version"]:
        raise RuntimeError(f"the fleet serves {served}, not the promoted {state['policy_version']}")
    return {"promoted": {"version": served, "deployment_id": state["canary"]["deployment"]["deployment_id"]}}


def rollback(settings: Settings, engine: Engine, state: State) -> State:
    """The failed gate already put the previous version back on every updated replica: check and record."""
    served = _target(engine)
    deployment = state.get("canary", {}).get("deployment", {})
    return {
        "rolled_back": {
            "version": state["policy_version"],
            "serving": served,
            "reason": deployment.get("message", ""),
        }
    }


def evaluate(settings: Settings, engine: Engine, state: State) -> State:
    """Held-out metrics of the version: recorded with its row by the trainer, else computed now."""
    from ingest.db import transaction
    from policy.evaluate import EvalConfig
    from policy.evaluate import evaluate as run_eval
    from policy.model import load_checkpoint
    from policy.tables import PolicyVersionRow

    version = state["policy_version"]
    with transaction(engine) as db:
        row = db.get(PolicyVersionRow, version)
        metrics, path = (dict(row.metrics or {}), row.checkpoint_path) if row is not None else ({}, None)
    if "eval/keep_rate" not in metrics:
        if path is None:
            raise ValueError(f"policy version {version} is not recorded; nothing to evaluate")
        model, tokenizer = load_checkpoint(path)
        metrics.update(run_eval(model, tokenizer, EvalConfig(**state.get("eval", {}))))
    return {"evaluation": {k: v for k, v in metrics.items() if k.startswith("eval/")}}


DEFAULTS = {
    "collect": collect,
    "retrain": retrain,
    "snapshot": snapshot,
    "canary": canary,
    "promote": promote,
    "rollback": rollback,
    "evaluate": evaluate,
}


def step(settings: Settings, name: str) -> Any:
    """The function for step ``name``: the configured override, else the default adapter."""
    override = settings.scheduler.steps.get(name)
    return resolve(override) if override else DEFAULTS[name]
