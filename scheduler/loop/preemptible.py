"""Run a training job on borrowed replicas so that it can be preempted without losing anything.

Between two steps the runner renews the leases of its replicas. When one was recalled (or
lost), it checkpoints and yields: the task hands the replicas back and retries later, and the
next attempt loads the checkpoint and continues. Training is deterministic given its state
(model, optimizer, step counter, RNG), so a preempted job ends with exactly the result of an
uninterrupted one. A periodic checkpoint every ``checkpoint_every`` steps bounds what a killed
worker loses. The checkpoint is written to a temporary file and renamed (atomic handover).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from scheduler.loop import leases

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

log = structlog.get_logger(__name__)


class TrainerSession(Protocol):
    """What the RL trainer exposes to the scheduler (built by ``SchedulerConfig.rl_trainer``)."""

    @property
    def done(self) -> bool:
        """True once every step of this update ran."""

    def step(self) -> dict[str, float]:
        """Run one optimizer step; returns its metrics."""

    def save(self, path: Path) -> None:
        """Write everything needed to resume (model, optimizer, step, RNG) to ``path``."""

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def result(self) -> dict[str, Any]:
        """Outputs of the finished update (ids and metrics, JSON-able)."""


@dataclass
class Outcome:
    """How a run ended: finished (with the trainer's result) or yielded to a recall."""

    finished: bool
    steps: int
    cancelled: bool = False
    """The job was cancelled: the run checkpointed and stopped."""
    result: dict[str, Any] = field(default_factory=dict)
    recalled_at: float | None = None
    yielded_at: float | None = None
    resumed: bool = False


def save_atomic(session: TrainerSession, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    session.save(tmp)
    os.replace(tmp, path)


def run_preemptible(
    session: TrainerSession,
    checkpoint: Path,
    engine: Engine,
    replica_ids: list[str],
    holder: str,
    ttl_s: float,
    checkpoint_every: int = 10,
    cancelled: Callable[[], bool] = lambda: False,
) -> Outcome:
    """Step ``session`` to the end, or checkpoint and yield as soon as a replica is recalled, or
    checkpoint and stop as soon as ``cancelled()`` says the job was cancelled."""
    resumed = checkpoint.exists()
    if resumed:
        session.load(checkpoint)
        log.info("training resumed from checkpoint", holder=holder, checkpoint=str(checkpoint))
    steps = 0
    while not session.done:
        recalled = False
        for replica_id in replica_ids:
            try:
                status = leases.renew(engine, replica_id, holder, ttl_s)
            except leases.LeaseLost:
                recalled = True
                break
            recalled = recalled or status.recall_requested
        if cancelled():
            save_atomic(session, checkpoint)
            log.info("training stopped: its job was cancelled", holder=holder, steps=steps)
            return Outcome(False, steps, cancelled=True, resumed=resumed)
        if recalled:
            noticed = time.time()
            save_atomic(session, checkpoint)
            log.info("training yielded to a recall", holder=holder, steps=steps)
            return Outcome(False, steps, recalled_at=noticed, yielded_at=time.time(), resumed=resumed)
        session.step()
        steps += 1
        if steps % checkpoint_every == 0:
            save_atomic(session, checkpoint)
    result = session.result()
    checkpoint.unlink(missing_ok=True)
    return Outcome(True, steps, result=result, resumed=resumed)
