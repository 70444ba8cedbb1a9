"""Adapters from loop steps to the layer functions they call: one call each, ids in and ids out.

Every step has the signature ``step(settings, engine, state) -> dict`` where ``state`` is the
JSON dict the chain carries (run id, versions, verdicts) and the returned dict is merged into it.
``SchedulerConfig.steps`` can replace any step by ``module:function`` (an operator's own canary,
or a test's). Steps whose layer function is named ``expected`` below call an interface the
lower layer is expected to provide; they fail with ``ModuleNotFoundError``/``AttributeError``
naming it until it exists.
"""

from __future__ import annotations

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
    return {"ingest": counts}


def retrain(settings: Settings, engine: Engine, state: State) -> State:
    """Retrain the reward model when :func:`reward_models.triggers.retrain_decision` says so."""
    from reward_models.train import TrainingDataError, train_reward_models
    from reward_models.triggers import retrain_decision

    decision = retrain_decision(engine, settings.rewards)
    if not decision.retrain:
        return {"reward_model": {"retrained": False, "reasons": decision.reasons}}
    try:
        report = train_reward_models(engine, settings.rewards, settings.home, resolved_config=settings.resolved())
    except TrainingDataError as exc:
        return {"reward_model": {"retrained": False, "reasons": [str(exc)]}}
    return {"reward_model": {"retrained": True, "version": report.version, "promoted": report.promoted}}


def snapshot(settings: Settings, engine: Engine, state: State) -> State:
    """Store the trained weights as a new version (delta against the serving one). Expected:
    ``policy.weights.store.snapshot_from_checkpoint(policy_config, home, checkpoint) -> {"version": ...}``."""
    from policy.weights import store

    out = store.snapshot_from_checkpoint(settings.policy, settings.home, state["rl_update"]["checkpoint"])  # type: ignore[attr-defined]
    return {"policy_version": out["version"]}


def canary(settings: Settings, engine: Engine, state: State) -> State:
    """Deploy the new version to the canary stage and judge it. Expected:
    ``serving.deploy.canary(engine, serving_config, version) -> {"passed": bool, ...}``."""
    from serving import deploy

    verdict = deploy.canary(engine, settings.serving, state["policy_version"])  # type: ignore[attr-defined]
    return {"canary": verdict}


def promote(settings: Settings, engine: Engine, state: State) -> State:
    """Roll the canaried version out to the whole fleet. Expected:
    ``serving.deploy.promote(engine, serving_config, version) -> dict``."""
    from serving import deploy

    return {"promoted": deploy.promote(engine, settings.serving, state["policy_version"])}  # type: ignore[attr-defined]


def rollback(settings: Settings, engine: Engine, state: State) -> State:
    """Put the previous version back. Expected: ``serving.deploy.rollback(engine, serving_config, version) -> dict``."""
    from serving import deploy

    return {"rolled_back": deploy.rollback(engine, settings.serving, state["policy_version"])}  # type: ignore[attr-defined]


def evaluate(settings: Settings, engine: Engine, state: State) -> State:
    """Held-out evaluation of a version. Expected:
    ``policy.evaluate.evaluate_version(policy_config, home, version) -> dict``."""
    from policy import evaluate as ev

    return {"evaluation": ev.evaluate_version(settings.policy, settings.home, state["policy_version"])}  # type: ignore[attr-defined]


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
