"""Operator actions on a deployment: promote it (skip its remaining gates) or roll it back (the pool
returns to the version it served before).

A deployment is either still **running** in its deployer (a scheduler worker inside
:func:`serving.deploy.rollout`) or **finished**. A running one is asked, through its row
(``requested``), and its deployer acts at its next gate: ``promote`` passes every remaining gate,
``rollback`` fails the current one, which rolls back every updated replica the usual way. The
caller waits until the deployer recorded the outcome. A running deployment whose deployer stopped
beating is failed first (:func:`serving.fleet.recover_stale`), then treated as finished.

A finished deployment is acted on directly: promoting one that did not reach its version rolls
that version out again without gates; rolling back one that succeeded rolls the version it
replaced out without gates and marks it ``rolled_back``. Both are idempotent: acting on a
deployment already where the action would leave it changes nothing and says ``unchanged``.

Promotion passes the reward-hacking guard (``guard``, see :mod:`serving.deploy`): a running
deployment's deployer judges it at its next gate (and rolls back a flagged version); a finished
one is judged here before its version is rolled out again, and a flagged version is refused
(:class:`PromotionRefused`, the reason recorded in the deployment's message). ``force`` skips
the guard (the deployer is asked ``force_promote``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

import structlog
from sqlalchemy.engine import Engine

from ingest.db import as_utc, transaction
from reward_models.guard import HackingReport
from serving import fleet
from serving.config import DeployConfig, FleetConfig
from serving.deploy import GuardCheck, rollout
from serving.tables import DeploymentRow

log = structlog.get_logger(__name__)

Action = Literal["promote", "rollback"]
Request = Literal["promote", "force_promote", "rollback"]


class ActionRefused(ValueError):
    """The deployment cannot take this action (the message says why and what to do)."""


class PromotionRefused(ActionRefused):
    """The reward-hacking guard flagged the version a promotion would move the pool to."""

    def __init__(self, message: str, report: HackingReport) -> None:
        super().__init__(message)
        self.report = report


def refusal_message(to_version: str, from_version: str, report: HackingReport) -> str:
    """What a refused promotion records and answers."""
    return (
        f"promotion of {to_version} over {from_version} refused by the reward-hacking guard: {report.reason}; "
        "promote with force to override"
    )


def note_refusal(db: Engine, deployment_id: int, message: str) -> None:
    """Record a refused promotion in the deployment's message (kept after a running rollout ends)."""
    with transaction(db) as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is not None and message not in (row.message or ""):
            row.message = f"{row.message}; {message}" if row.message else message


@dataclass
class ActionResult:
    """Where an action left the pool."""

    deployment_id: int
    action: Action
    status: str
    """The acted-on deployment's status afterwards (``succeeded``, ``rolled_back``, ...)."""
    message: str
    target: str | None
    """The pool's target version afterwards."""
    follow_up: int | None = None
    """The gateless deployment the action ran, when it needed one."""
    changed: bool = True


def _load(db: Engine, deployment_id: int) -> DeploymentRow:
    with transaction(db) as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is None:
            raise ActionRefused(f"no deployment {deployment_id}")
        s.expunge(row)
        return row


def _alive(row: DeploymentRow, config: DeployConfig) -> bool:
    last = as_utc(row.heartbeat_at or row.started_at)
    return row.status == "running" and last >= datetime.now(UTC) - timedelta(seconds=config.stale_after_s)


def request(db: Engine, deployment_id: int, action: Request) -> None:
    """Ask the deployer of a running deployment to ``action`` it at its next gate (``force_promote``:
    promote without the reward-hacking guard)."""
    with transaction(db) as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is not None and row.status == "running":
            row.requested = action


async def _wait_finished(db: Engine, deployment_id: int, config: DeployConfig, timeout_s: float) -> DeploymentRow:
    deadline = time.monotonic() + timeout_s
    while True:
        row = _load(db, deployment_id)
        if row.status != "running":
            return row
        if not _alive(row, config):
            fleet.recover_stale(db, config.stale_after_s, row.pool)
            return _load(db, deployment_id)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"deployment {deployment_id} did not act on the request within {timeout_s:.0f}s; its deployer "
                f"is slow or stuck (it is failed automatically {config.stale_after_s:.0f}s after it stops beating)"
            )
        await asyncio.sleep(0.2)


async def _ask_deployer(
    db: Engine,
    deployment_id: int,
    action: Action,
    outcome: str,
    config: DeployConfig,
    timeout_s: float,
    *,
    asked: Request | None = None,
) -> tuple[DeploymentRow, ActionResult | None]:
    """A running deployment's deployer is asked to ``action`` it (``asked``: the request, by default
    ``action``) and waited for; returns the row as it ended, and the result when the deployer reached
    ``outcome`` itself (else the caller acts)."""
    row = _load(db, deployment_id)
    if not _alive(row, config):
        return row, None
    request(db, deployment_id, asked or action)
    row = await _wait_finished(db, deployment_id, config, timeout_s)
    if row.status != outcome:
        return row, None
    return row, ActionResult(deployment_id, action, row.status, row.message, _target(db, row.pool))


def _target(db: Engine, pool: str) -> str | None:
    row = fleet.get_target(db, pool)
    return row.version if row is not None else None


async def promote(
    db: Engine,
    deployment_id: int,
    config: DeployConfig,
    fleet_config: FleetConfig,
    *,
    timeout_s: float = 600.0,
    guard: GuardCheck | None = None,
    force: bool = False,
) -> ActionResult:
    """Bring the whole pool of deployment ``deployment_id`` to its version (see the module docstring).

    Raises :class:`PromotionRefused` when ``guard`` flags the version (unless ``force``)."""
    asked: Request = "force_promote" if force else "promote"
    row, done = await _ask_deployer(db, deployment_id, "promote", "succeeded", config, timeout_s, asked=asked)
    if done is not None:
        return done
    target = _target(db, row.pool)
    if target == row.to_version and row.status == "succeeded":
        return ActionResult(deployment_id, "promote", row.status, "already promoted", target, changed=False)
    if guard is not None and not force:
        incumbent = target or row.from_version
        report = await asyncio.to_thread(guard, row.to_version, incumbent)
        if report.flagged:
            message = refusal_message(row.to_version, incumbent, report)
            note_refusal(db, deployment_id, message)
            log.warning("deploy.promotion_refused", deployment=deployment_id, reason=report.reason)
            raise PromotionRefused(message, report)
    result = await rollout(
        db, row.to_version, row.to_hash, config, pool=row.pool, metrics=None, fleet_config=fleet_config
    )
    return ActionResult(
        deployment_id,
        "promote",
        _load(db, deployment_id).status,
        result.message,
        _target(db, row.pool),
        follow_up=result.deployment_id,
    )


async def rollback(
    db: Engine, deployment_id: int, config: DeployConfig, fleet_config: FleetConfig, *, timeout_s: float = 600.0
) -> ActionResult:
    """Return the pool of deployment ``deployment_id`` to the version it served before (module docstring)."""
    row, done = await _ask_deployer(db, deployment_id, "rollback", "rolled_back", config, timeout_s)
    if done is not None:
        return done
    target = _target(db, row.pool)
    if row.status in ("rolled_back", "failed") and target == row.from_version:
        return ActionResult(
            deployment_id,
            "rollback",
            row.status,
            "the pool already serves the previous version",
            target,
            changed=False,
        )
    if not row.from_hash:
        raise ActionRefused(
            f"deployment {deployment_id} does not record the hash of {row.from_version}; "
            f"roll that version out instead (POST /api/v1/deployments with version {row.from_version})"
        )
    result = await rollout(
        db, row.from_version, row.from_hash, config, pool=row.pool, metrics=None, fleet_config=fleet_config
    )
    if result.status != "succeeded":
        raise ActionRefused(f"rolling {row.pool} back to {row.from_version} failed: {result.message}")
    with transaction(db) as s:
        acted = s.get(DeploymentRow, deployment_id)
        assert acted is not None
        acted.status = "rolled_back"
        acted.message = f"rolled back by operator: deployment {result.deployment_id} restored {row.from_version}"
        message = acted.message
    log.info("deploy.operator_rollback", deployment=deployment_id, restored=row.from_version)
    return ActionResult(
        deployment_id, "rollback", "rolled_back", message, _target(db, row.pool), follow_up=result.deployment_id
    )
