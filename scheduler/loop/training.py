"""The RL update's trainer: the default builds :class:`policy.production.ProductionSession` from the
settings sections and the job's state; ``SchedulerConfig.rl_trainer`` names another factory (the
documented override point for an operator's own trainer: ``module:function`` taking the settings
and the :class:`~scheduler.loop.state.LoopState`, returning a
:class:`~scheduler.loop.preemptible.TrainerSession`).

A session's :meth:`result` is read into :class:`~scheduler.loop.state.RLOutcome`: ``version`` and
``checkpoint`` are required, ``parent``, ``metrics`` and ``trained_sessions`` are kept when given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.loop.borrowing import resolve
from scheduler.loop.state import LoopState, RLOutcome

if TYPE_CHECKING:
    from scheduler.loop.preemptible import TrainerSession
    from scheduler.settings import Settings


def production_trainer(settings: Settings, state: LoopState) -> TrainerSession:
    """GRPO on the production sessions of the job's window (:mod:`policy.production`)."""
    from policy.production import GROUPS_PER_STEP, ProductionSession, TrainRequest

    rl = state.rl
    request = TrainRequest(
        base_version=rl.base_version or state.serving_version,
        steps=rl.steps,
        lr=rl.lr,
        groups_per_step=rl.groups_per_step or GROUPS_PER_STEP,
        eval=dict(rl.eval),
        label=rl.label,
        since=state.window.since,
        until=state.window.until,
    )
    return ProductionSession(settings.policy, settings.rewards, settings.resolved_database_url, settings.home, request)


def trainer(settings: Settings, state: LoopState) -> TrainerSession:
    """The configured trainer for this job."""
    return resolve(settings.scheduler.rl_trainer)(settings, state)  # type: ignore[no-any-return]


def outcome(result: dict[str, Any], resumed: bool) -> RLOutcome:
    """The trainer's result as the typed outcome the next steps read."""
    return RLOutcome(
        version=str(result["version"]),
        checkpoint=str(result["checkpoint"]),
        parent=result.get("parent"),
        resumed=resumed,
        metrics=dict(result.get("metrics") or {}),
        trained_sessions=[str(s) for s in result.get("trained_sessions") or []],
    )
