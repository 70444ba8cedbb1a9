"""What a job carries from step to step: one typed :class:`LoopState`, and the steps each kind of
job runs (:data:`JOB_STEPS`), the one place task names live.

Producer: :func:`scheduler.loop.submit.submit` builds the first state from an API call, a CLI
command or the demo; consumer: every task of :mod:`scheduler.loop.tasks`, which validates the
state it receives, runs its step and hands the updated state to the next task of the chain. It
crosses the broker as JSON (``model_dump(mode="json")``), so a field a step needs and nobody set
fails where the state is built, not as a ``KeyError`` in a worker an hour later.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Step(StrEnum):
    """The loop's steps; each is one Celery task named ``undertow.<step>``."""

    COLLECT = "collect"
    RETRAIN = "retrain"
    RL_UPDATE = "rl_update"
    SNAPSHOT = "snapshot"
    ROLLOUT = "rollout"
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    EVALUATE = "evaluate"

    @property
    def task_name(self) -> str:
        """The Celery task name."""
        return f"undertow.{self.value}"


JobKind = Literal["loop", "reward_model_retrain", "rl_update", "rollout", "promote", "rollback"]

JOB_STEPS: dict[str, tuple[Step, ...]] = {
    "loop": (Step.COLLECT, Step.RETRAIN, Step.RL_UPDATE, Step.SNAPSHOT, Step.ROLLOUT, Step.EVALUATE),
    "reward_model_retrain": (Step.RETRAIN,),
    "rl_update": (Step.RL_UPDATE, Step.SNAPSHOT, Step.ROLLOUT),
    "rollout": (Step.ROLLOUT,),
    "promote": (Step.PROMOTE,),
    "rollback": (Step.ROLLBACK,),
}
"""The steps a job of each kind runs, in order (a chain: a step runs only after the one before succeeded)."""

PERIODIC_TASKS = ("undertow.plan_capacity", "undertow.reap_leases", "undertow.reap_jobs", "undertow.check_retrain")
"""Tasks celery beat runs on its own schedule (not part of any job)."""


class Model(BaseModel):
    """Strict base: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class Window(Model):
    """A telemetry window, by the sessions' ``occurred_at``: ``[since, until)``; None is open."""

    since: datetime | None = None
    """First instant included; None: from the first session."""
    until: datetime | None = None
    """First instant excluded; None: up to now."""


class RLInputs(Model):
    """What an RL update trains on and how (all optional; the trainer's config fills the rest)."""

    base_version: str | None = None
    """Policy version to train from; default: the version the pool serves, else the newest."""
    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps (overrides ``policy.rl_steps_per_version``)."""
    lr: float | None = Field(default=None, gt=0)
    """Learning rate override (the demo's gate drill uses a destructive one)."""
    groups_per_step: int | None = Field(default=None, ge=1)
    """Candidate groups per optimizer step."""
    eval: dict[str, Any] = Field(default_factory=dict)
    """``policy.evaluate.EvalConfig`` fields for the held-out evaluation of the new version."""
    label: str = ""
    """Free text kept in the version's metrics."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Inputs for an operator's own trainer (``scheduler.rl_trainer``); the default trainer ignores them."""


class IngestCounts(Model):
    """What the database holds when the loop starts."""

    sessions: int
    signals: int
    dead_letters: int


class RewardModelOutcome(Model):
    """What the retrain step did."""

    retrained: bool
    reasons: list[str] = Field(default_factory=list)
    version: str | None = None
    status: str | None = None
    promoted: bool = False
    primary_metric: float | None = None
    n_train: int = 0
    n_holdout: int = 0
    window: Window | None = None
    """The window the model was trained on (what was asked for)."""


class RLOutcome(Model):
    """What the RL update produced."""

    version: str
    checkpoint: str
    parent: str | None = None
    resumed: bool = False
    metrics: dict[str, Any] = Field(default_factory=dict)
    trained_sessions: list[str] = Field(default_factory=list)
    """Sessions the update's batches were drawn from (all inside the job's window)."""


class SnapshotOutcome(Model):
    """The stored weights version."""

    version: str
    weights_hash: str
    parent: str | None = None


class DeploymentOutcome(Model):
    """Where a rollout, promotion or rollback left the pool."""

    deployment_id: int | None = None
    status: str
    """``succeeded``, ``rolled_back`` (a failed gate, the reward-hacking guard included), ``failed``,
    ``promoted`` or ``unchanged`` (already there)."""
    message: str = ""
    version: str
    """The version the deployment moved to (or tried to)."""
    target: str | None = None
    """The pool's target version afterwards."""
    stages: list[dict[str, Any]] = Field(default_factory=list)


class LoopState(Model):
    """The state a job's chain carries (see the module docstring)."""

    run_id: str
    """The job id (also the chain id every step records)."""
    kind: JobKind = "loop"
    requested_by: str = "scheduler"
    reason: str = ""
    pool: str = "default"
    window: Window = Field(default_factory=Window)
    """Telemetry the retrain and the RL update use."""
    force: bool = False
    """Retrain even when the triggers say nothing changed."""
    evaluate: bool = False
    """Append the held-out evaluation of the new version (``loop`` jobs)."""
    rl: RLInputs = Field(default_factory=RLInputs)

    version: str | None = None
    """The policy version being deployed (set by the snapshot, or by the caller for a rollout)."""
    weights_hash: str | None = None
    """Its weights hash (from the weight store when the caller gave only a version)."""
    deployment_id: int | None = None
    """The deployment a promote or rollback acts on."""

    serving_version: str | None = None
    ingest: IngestCounts | None = None
    reward_model: RewardModelOutcome | None = None
    rl_update: RLOutcome | None = None
    snapshot: SnapshotOutcome | None = None
    deployment: DeploymentOutcome | None = None
    evaluation: dict[str, float] | None = None

    def wire(self) -> dict[str, Any]:
        """The JSON form that crosses the broker."""
        return self.model_dump(mode="json")
