"""Borrowing through the serving fleet: lend a replica (lease, drain, sleep) and return it (wake,
verify the weights version, rejoin, release the lease), following the borrowing state machine.

The fleet is reached through :class:`FleetControl`. The default is the serving registry's
(:func:`registry_fleet`, :class:`serving.control.RegistryFleet`); ``SchedulerConfig.fleet_control``
names another factory (``module:function`` taking the settings), the documented override point for
a fleet the registry does not manage. The scheduler never knows how the serving layer drains or
wakes a replica; the serving layer never knows who borrows.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from scheduler.loop import jobs, leases
from scheduler.planner.borrow import ReplicaState, return_path

if TYPE_CHECKING:
    import numpy as np
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings
    from serving.control import RegistryFleet

log = structlog.get_logger(__name__)


class FleetControl(Protocol):
    """What the scheduler needs from the serving fleet."""

    def replicas(self, pool: str) -> list[str]:
        """Replica ids of a pool, in rotation or not."""

    def drain(self, replica_id: str) -> None:
        """Take the replica out of the gateway's rotation and wait for in-flight requests."""

    def sleep(self, replica_id: str) -> None:
        """Free the replica's accelerator memory (vLLM sleep level 1)."""

    def wake(self, replica_id: str) -> None:
        """Undo :meth:`sleep`."""

    def verify(self, replica_id: str) -> str:
        """The weights version the replica serves now."""

    def rejoin(self, replica_id: str) -> None:
        """Put the replica back in rotation."""

    def capacity_rps(self, pool: str) -> float:
        """One replica's capacity at the latency SLO (``planner.capacity.capacity_at_slo`` on measurements)."""

    def serving_version(self, pool: str) -> str:
        """The version the pool should serve."""

    def load_history(self, pool: str, window_s: int) -> np.ndarray:
        """Per-window peak request rate of the pool (NaN for windows without data), oldest first."""


class VersionMismatch(RuntimeError):
    """A returned replica does not serve the version its pool serves."""


def resolve(path: str) -> Any:
    """Import ``module:attribute``; a clear error names the setting when it does not exist."""
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"{path!r} is not of the form module:function")
    return getattr(importlib.import_module(module), attr)


def fleet_control(settings: Settings) -> FleetControl:
    """The fleet named by ``settings.scheduler.fleet_control`` (default: :func:`registry_fleet`)."""
    return resolve(settings.scheduler.fleet_control)(settings)  # type: ignore[no-any-return]


def registry_fleet(settings: Settings) -> RegistryFleet:
    """The fleet of the serving registry in the configured database."""
    from ingest.db import make_engine
    from serving.control import RegistryFleet

    return RegistryFleet(
        make_engine(settings.resolved_database_url),
        refresh_s=settings.serving.gateway.fleet_refresh_s,
        pause_timeout_s=settings.serving.deploy.pause_timeout_s,
        clock_speedup=settings.scheduler.clock_speedup,
        latency_slo_s=settings.scheduler.latency_slo_s,
        control_token=settings.serving.fleet.control_token,
    )


def lend(
    fleet: FleetControl, engine: Engine, replica_id: str, pool: str, holder: str, purpose: str, ttl_s: float
) -> bool:
    """Lease, drain and (for training) sleep ``replica_id``; False when another holder has it."""
    if not leases.acquire(engine, replica_id, pool, holder, purpose, ttl_s):
        return False
    current = next(
        (lease["state"] for lease in leases.active_leases(engine) if lease["replica_id"] == replica_id), None
    )
    if current == ReplicaState.LENT.value:
        return True  # idempotent re-run of the same holder
    fleet.drain(replica_id)
    if purpose == "training":
        leases.set_state(engine, replica_id, holder, ReplicaState.SLEEPING)
        fleet.sleep(replica_id)
    leases.set_state(engine, replica_id, holder, ReplicaState.LENT)
    log.info("replica lent", replica=replica_id, pool=pool, holder=holder, purpose=purpose)
    return True


def give_back(
    fleet: FleetControl,
    engine: Engine,
    replica_id: str,
    pool: str,
    holder: str,
    *,
    from_state: ReplicaState = ReplicaState.LENT,
    generation: bool = False,
    event: str = "returned",
    record_states: bool = True,
) -> None:
    """Walk the return path (wake, verify, rejoin) and release the lease.

    ``record_states`` is False when the lease is already gone (reaped), so only the fleet moves.
    """
    expected = fleet.serving_version(pool)
    for state in return_path(from_state, generation=generation):
        if record_states and state is not ReplicaState.SERVING:
            leases.set_state(engine, replica_id, holder, state)
        if state is ReplicaState.WAKING:
            fleet.wake(replica_id)
        elif state is ReplicaState.VERIFYING:
            served = fleet.verify(replica_id)
            if served != expected:
                raise VersionMismatch(f"replica {replica_id} serves {served!r}, pool {pool} serves {expected!r}")
        elif state is ReplicaState.SERVING:
            fleet.rejoin(replica_id)
    if record_states:
        leases.release(engine, replica_id, holder, event=event)
    log.info("replica returned", replica=replica_id, pool=pool, holder=holder, reason=event)


def reap(fleet: FleetControl, engine: Engine) -> list[str]:
    """Return every replica whose lease expired, and mark its holder's job LOST."""
    out = []
    for replica_id, pool, holder, purpose in leases.reap_expired(engine):
        give_back(
            fleet,
            engine,
            replica_id,
            pool,
            holder,
            event="expired",
            record_states=False,
            generation=purpose == "generation",
        )
        jobs.mark_lost(engine, holder, f"lease on {replica_id} expired: the worker stopped renewing it")
        out.append(replica_id)
    return out
