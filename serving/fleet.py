"""The fleet registry in the database, periodic health checks, and reconciliation.

A health check asks each replica for ``/health`` and the weights it serves. A replica that
claims the pool's target version with another hash is ``hash_mismatch`` and leaves rotation
(its weights are not what the version says); one on another version is ``behind``; one that
fails ``unhealthy_after`` checks in a row is ``unreachable``. Replicas in state ``updating``
(a deployment is working on them) are checked but never judged.

:func:`reconcile` brings every ``behind`` or ``hash_mismatch`` replica to the pool's target by
the cheapest path the weight store offers (a chain of deltas from the version it serves, or
the full snapshot when its weights are unknown or the chain costs more), then it rejoins
rotation at the next check.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy import inspect, select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from serving.client import EngineClient, EngineError
from serving.config import FleetConfig
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.tables import REPLICA_STATES, DeploymentRow, ReplicaRow, TargetRow

log = structlog.get_logger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Replica:
    """A replica as read from the registry (a plain snapshot, safe to pass between tasks)."""

    id: str
    url: str
    pool: str
    region: str
    backend: str
    state: str
    version: str | None
    weights_hash: str | None
    health: str

    @property
    def in_rotation(self) -> bool:
        return self.state == "serving" and self.health == "ok"


def _view(row: ReplicaRow) -> Replica:
    return Replica(
        row.id, row.url, row.pool, row.region, row.backend, row.state, row.version, row.weights_hash, row.health
    )


def register_replica(
    engine: Engine, replica_id: str, url: str, *, pool: str = "default", region: str = "local", backend: str = "cpu"
) -> Replica:
    """Add a replica (or update its address); it joins rotation after its first healthy check."""
    with transaction(engine) as s:
        row = s.get(ReplicaRow, replica_id)
        if row is None:
            row = ReplicaRow(
                id=replica_id, url=url, registered_at=_now(), state="serving", health="unknown", failures=0
            )
            s.add(row)
        row.url, row.pool, row.region, row.backend = url, pool, region, backend
        s.flush()
        return _view(row)


def remove_replica(engine: Engine, replica_id: str) -> None:
    with transaction(engine) as s:
        row = s.get(ReplicaRow, replica_id)
        if row is not None:
            s.delete(row)


def list_replicas(engine: Engine, pool: str | None = None) -> list[Replica]:
    with transaction(engine) as s:
        query = select(ReplicaRow).order_by(ReplicaRow.id)
        if pool is not None:
            query = query.where(ReplicaRow.pool == pool)
        return [_view(r) for r in s.scalars(query)]


def set_state(engine: Engine, replica_id: str, state: str) -> None:
    """Move a replica to one of :data:`serving.tables.REPLICA_STATES`."""
    if state not in REPLICA_STATES:
        raise ValueError(f"unknown replica state {state!r}; use one of {REPLICA_STATES}")
    with transaction(engine) as s:
        row = s.get(ReplicaRow, replica_id)
        if row is None:
            raise KeyError(f"no replica {replica_id!r} in the registry")
        row.state = state


def record_weights(
    engine: Engine, replica_id: str, version: str, weights_hash: str, health: str = "ok", state: str | None = None
) -> None:
    """Record what a replica serves after an update (the deployer calls this), and its new ``state`` if given."""
    if state is not None and state not in REPLICA_STATES:
        raise ValueError(f"unknown replica state {state!r}; use one of {REPLICA_STATES}")
    with transaction(engine) as s:
        row = s.get(ReplicaRow, replica_id)
        if row is not None:
            if state is not None:
                row.state = state
            row.version, row.weights_hash, row.health, row.failures, row.last_check = (
                version,
                weights_hash,
                health,
                0,
                _now(),
            )


def get_target(engine: Engine, pool: str = "default") -> TargetRow | None:
    with transaction(engine) as s:
        return s.get(TargetRow, pool)


def set_target(engine: Engine, version: str, weights_hash: str, pool: str = "default") -> None:
    """The version a pool should serve (set by a deployment, or once at bootstrap)."""
    with transaction(engine) as s:
        row = s.get(TargetRow, pool)
        if row is None:
            s.add(TargetRow(pool=pool, version=version, weights_hash=weights_hash, updated_at=_now()))
        else:
            row.version, row.weights_hash, row.updated_at = version, weights_hash, _now()


def judge(version: str | None, weights_hash: str | None, accepted: dict[str, str] | None) -> str:
    """Health of a reachable replica against the versions its pool may serve (``{version: hash}``)."""
    if accepted is None:
        return "ok"
    if version in accepted:
        return "ok" if weights_hash == accepted[version] else "hash_mismatch"
    return "behind"


def accepted_versions(engine: Engine, pool: str) -> dict[str, str] | None:
    """The pool's target and the version of a running deployment (its replicas are not behind)."""
    target = get_target(engine, pool)
    if target is None:
        return None
    accepted = {target.version: target.weights_hash}
    with transaction(engine) as s:
        running = s.scalars(select(DeploymentRow).where(DeploymentRow.pool == pool, DeploymentRow.status == "running"))
        accepted.update({d.to_version: d.to_hash for d in running})
    return accepted


def recover_stale(engine: Engine, stale_after_s: float, pool: str | None = None) -> list[int]:
    """Fail deployments left ``running`` by a deployer that stopped beating for ``stale_after_s``.

    Their replicas still marked ``updating`` go back to ``serving``; the pool's target never
    moved (only a finished rollout moves it), so the next check finds any replica the crashed
    deployer had updated ``behind`` and :func:`reconcile` returns it to the target. Returns the
    ids of the deployments failed.
    """
    cutoff = _now() - timedelta(seconds=stale_after_s)
    failed: list[int] = []
    with transaction(engine) as s:
        query = select(DeploymentRow).where(DeploymentRow.status == "running")
        if pool is not None:
            query = query.where(DeploymentRow.pool == pool)
        for dep in s.scalars(query):
            last = dep.heartbeat_at or dep.started_at
            if last >= cutoff:
                continue
            dep.status, dep.finished_at = "failed", _now()
            dep.message = (
                f"the deployer stopped (no heartbeat since {last.isoformat()}); "
                f"target left at {dep.from_version}, replicas reconciled to it"
            )
            for row in s.scalars(select(ReplicaRow).where(ReplicaRow.pool == dep.pool, ReplicaRow.state == "updating")):
                row.state = "serving"
            failed.append(dep.id)
            log.warning("fleet.stale_deployment", deployment=dep.id, pool=dep.pool, last_heartbeat=last.isoformat())
    return failed


def versions_in_use(engine: Engine) -> set[str]:
    """Every weights version a replica holds or is moving to: what the weight store's GC must keep.

    Counts the versions replicas reported, each pool's target, and both ends of running
    deployments. A database without the serving tables has none in use.
    """
    if not inspect(engine).has_table(ReplicaRow.__tablename__):
        return set()
    with transaction(engine) as s:
        used = {v for v in s.scalars(select(ReplicaRow.version)) if v}
        used |= set(s.scalars(select(TargetRow.version)))
        for dep in s.scalars(select(DeploymentRow).where(DeploymentRow.status == "running")):
            used |= {dep.from_version, dep.to_version}
    return used


async def check_fleet(
    engine: Engine, config: FleetConfig, pool: str | None = None, *, stale_after_s: float | None = None
) -> list[Replica]:
    """Check every replica once (concurrently) and record the results; with ``stale_after_s``,
    first fail deployments whose deployer crashed (:func:`recover_stale`)."""
    if stale_after_s is not None:
        recover_stale(engine, stale_after_s, pool)
    replicas = list_replicas(engine, pool)
    targets = {p: accepted_versions(engine, p) for p in {r.pool for r in replicas}}

    async def one(rep: Replica) -> tuple[Replica, str | None, str | None, bool]:
        async with EngineClient(rep.url, timeout_s=config.health_timeout_s, token=config.control_token) as client:
            try:
                await client.health(timeout_s=config.health_timeout_s)
                info = await client.weight_info(timeout_s=config.health_timeout_s)
            except EngineError:
                return rep, None, None, False
        return rep, info.version, info.hash, True

    results = await asyncio.gather(*(one(r) for r in replicas))
    with transaction(engine) as s:
        for rep, version, weights_hash, reachable in results:
            row = s.get(ReplicaRow, rep.id)
            if row is None:
                continue
            row.last_check = _now()
            if not reachable:
                row.failures += 1
                if row.failures >= config.unhealthy_after:
                    row.health = "unreachable"
                continue
            row.failures = 0
            row.version, row.weights_hash = version, weights_hash
            if row.state != "updating":
                health = judge(version, weights_hash, targets[row.pool])
                if health != row.health:
                    log.info("fleet.health", replica=row.id, health=health, version=version)
                row.health = health
    return list_replicas(engine, pool)


async def update_replica(
    client: EngineClient,
    to_version: str,
    to_hash: str,
    *,
    from_version: str | None,
    kind: str,
    pause_timeout_s: float,
    pulled: dict[str, Any] | None = None,
    timings: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], float]:
    """Pull (unless ``pulled`` says it was), pause (requests held), apply with hash check, resume.
    Returns (prefetch info, pause ms); ``timings`` (if given) receives the seconds of each call
    (``prefetch``, ``drain``: pausing until running requests finish, ``apply``, ``resume``) and
    the engine's own apply phases (``engine_apply``).

    The engine is resumed whatever happens once paused: a refused update leaves it serving the
    old weights.
    """
    import time

    times = timings if timings is not None else {}
    start = time.perf_counter()
    if pulled is None:
        pulled = await client.prefetch(PrefetchRequest(to_version=to_version, from_version=from_version, kind=kind))  # type: ignore[arg-type]
        times["prefetch"] = time.perf_counter() - start
    start = time.perf_counter()
    await client.pause(wait_for_inflight_requests=True, timeout_s=pause_timeout_s)
    paused = time.perf_counter()
    times["drain"] = paused - start
    try:
        applied = await client.apply(ApplyRequest(to_version=to_version, expected_hash=to_hash))
        times["engine_apply"] = applied.timings
    finally:
        resuming = time.perf_counter()
        times["apply"] = resuming - paused
        await client.resume()
        times["resume"] = time.perf_counter() - resuming
    return pulled, (time.perf_counter() - paused) * 1000


async def reconcile(
    engine: Engine, config: FleetConfig, pool: str = "default", pause_timeout_s: float = 60.0
) -> dict[str, str]:
    """Bring ``behind`` and ``hash_mismatch`` replicas of ``pool`` to its target; returns replica -> outcome."""
    target = get_target(engine, pool)
    if target is None:
        return {}
    outcomes: dict[str, str] = {}
    for rep in list_replicas(engine, pool):
        if rep.health not in ("behind", "hash_mismatch") or rep.state not in ("serving", "sleeping"):
            continue
        kind = "snapshot" if rep.health == "hash_mismatch" else "auto"
        set_state(engine, rep.id, "updating")
        try:
            async with EngineClient(rep.url, token=config.control_token) as client:
                pulled, _ = await update_replica(
                    client,
                    target.version,
                    target.weights_hash,
                    from_version=None,
                    kind=kind,
                    pause_timeout_s=pause_timeout_s,
                )
            record_weights(engine, rep.id, target.version, target.weights_hash)
            outcomes[rep.id] = f"updated ({pulled.get('kind')}, {pulled.get('bytes')} bytes)"
        except EngineError as exc:
            log.warning("fleet.reconcile_failed", replica=rep.id, error=str(exc))
            outcomes[rep.id] = f"failed: {exc.message}"
        finally:
            set_state(engine, rep.id, rep.state)
    return outcomes
