"""The scheduler's handle on the serving fleet: drain, sleep, wake, verify and rejoin replicas of
the fleet registry, and the load history and capacity the planner sizes the lending from.

:class:`RegistryFleet` implements the scheduler's ``FleetControl`` protocol over
:mod:`serving.fleet` (the registry the gateway balances over) and :class:`serving.client.EngineClient`
(the engines' dev-mode endpoints, with the fleet's control token). The scheduler builds it from its
settings; it never learns how a replica is drained or woken.

- **drain**: the replica leaves rotation (state ``draining``); the gateway re-reads the registry
  every ``fleet_refresh_s``, so after that delay no new request reaches it; a pause that waits for
  in-flight requests, then a resume, makes sure the ones already sent have finished.
- **sleep / wake**: ``POST /sleep?level=1`` / ``POST /wake_up`` (state ``sleeping`` / ``borrowed``).
- **verify**: the weights version the replica reports (``undertow_weight_info``).
- **rejoin**: state ``serving``; the next health check puts it back in rotation.
- **load history**: requests per planning window from the ``sessions`` table (a candidate group is
  one request), as a rate in requests per second of wall time; windows before the first session
  are NaN (no data), later empty windows are 0. With a compressed clock (the demo replays a day in
  minutes) a window of ``window_s`` simulated seconds spans ``window_s / clock_speedup`` wall seconds.
- **capacity**: what one replica serves at the latency SLO, measured: one replica answers one
  request at a time on CPU, so ``1 / p50 latency`` over recent requests (at most the SLO's share).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
from pydantic import SecretStr
from sqlalchemy import func, select

from serving import fleet
from serving.client import EngineClient

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

log = structlog.get_logger(__name__)

DEFAULT_CAPACITY_RPS = 1.0
"""Capacity assumed before any request was measured (planning then stays conservative via the forecast)."""
CAPACITY_SAMPLE = 200
"""Most recent requests the capacity is measured over."""


class RegistryFleet:
    """``FleetControl`` over the fleet registry and the engines' HTTP endpoints."""

    def __init__(
        self,
        engine: Engine,
        *,
        refresh_s: float = 1.0,
        pause_timeout_s: float = 60.0,
        clock_speedup: float = 1.0,
        latency_slo_s: float = 2.0,
        control_token: SecretStr | None = None,
    ) -> None:
        self.engine = engine
        self.control_token = control_token
        self.refresh_s = refresh_s
        self.pause_timeout_s = pause_timeout_s
        self.clock_speedup = clock_speedup
        self.latency_slo_s = latency_slo_s

    def _replica(self, replica_id: str) -> fleet.Replica:
        for rep in fleet.list_replicas(self.engine):
            if rep.id == replica_id:
                return rep
        raise KeyError(f"no replica {replica_id!r} in the registry; register it with `undertow fleet register`")

    def _call(self, replica_id: str, method: str, **kwargs: Any) -> Any:
        url = self._replica(replica_id).url

        async def go() -> Any:
            async with EngineClient(url, timeout_s=self.pause_timeout_s + 10, token=self.control_token) as client:
                return await getattr(client, method)(**kwargs)

        return asyncio.run(go())

    def replicas(self, pool: str) -> list[str]:
        """Replica ids of ``pool``, in rotation or not."""
        return [r.id for r in fleet.list_replicas(self.engine, pool)]

    def drain(self, replica_id: str) -> None:
        """Out of rotation, then wait for the gateway to notice and for in-flight requests."""
        fleet.set_state(self.engine, replica_id, "draining")
        time.sleep(self.refresh_s * 1.5)
        self._call(replica_id, "pause", wait_for_inflight_requests=True, timeout_s=self.pause_timeout_s)
        self._call(replica_id, "resume")

    def sleep(self, replica_id: str) -> None:
        """Free the replica's accelerator memory (sleep level 1)."""
        self._call(replica_id, "sleep", level=1)
        fleet.set_state(self.engine, replica_id, "sleeping")

    def wake(self, replica_id: str) -> None:
        """Undo :meth:`sleep`; the replica stays out of rotation until :meth:`rejoin`."""
        self._call(replica_id, "wake_up")
        fleet.set_state(self.engine, replica_id, "borrowed")

    def verify(self, replica_id: str) -> str:
        """The weights version the replica serves now."""
        return str(self._call(replica_id, "weight_info").version)

    def rejoin(self, replica_id: str) -> None:
        """Back in rotation (the next health check confirms it)."""
        fleet.set_state(self.engine, replica_id, "serving")

    def serving_version(self, pool: str) -> str:
        """The pool's target version."""
        target = fleet.get_target(self.engine, pool)
        if target is None:
            raise ValueError(f"pool {pool!r} has no target version; set one with `undertow fleet target`")
        return target.version

    def capacity_rps(self, pool: str) -> float:
        """One replica's requests per second at the SLO: ``1 / p50 latency`` of recent requests."""
        from ingest.tables import SessionRow

        with self.engine.connect() as conn:
            rows = conn.execute(
                select(SessionRow.latency_ms)
                .where(SessionRow.latency_ms.is_not(None), func.coalesce(SessionRow.candidate_index, 0) == 0)
                .order_by(SessionRow.occurred_at.desc())
                .limit(CAPACITY_SAMPLE)
            ).all()
        latencies = [float(r[0]) for r in rows if r[0] and r[0] > 0]
        if not latencies:
            return DEFAULT_CAPACITY_RPS
        p50_s = float(np.median(latencies)) / 1000.0
        return 1.0 / max(p50_s, 1e-3)

    def load_history(self, pool: str, window_s: int) -> np.ndarray:
        """Requests per wall second in each planning window, oldest first (NaN before any data)."""
        from ingest.tables import SessionRow

        with self.engine.connect() as conn:
            stamps = [
                r[0].timestamp()
                for r in conn.execute(
                    select(SessionRow.occurred_at).where(func.coalesce(SessionRow.candidate_index, 0) == 0)
                ).all()
            ]
        return load_rates(stamps, window_s / self.clock_speedup, time.time())


def load_rates(stamps: list[float], window_wall_s: float, now: float) -> np.ndarray:
    """Per-window request rate (requests per wall second) of ``stamps`` up to ``now``, oldest first.

    Windows are aligned on ``now`` (the last one ends now, so it is complete); windows before the
    first request are NaN, since the fleet had no measurement then.
    """
    if window_wall_s <= 0:
        raise ValueError("a planning window must last more than 0 seconds")
    if not stamps:
        return np.zeros(0)
    first = min(stamps)
    count = int(np.ceil((now - first) / window_wall_s)) or 1
    start = now - count * window_wall_s
    idx = np.floor((np.asarray(stamps) - start) / window_wall_s).astype(int)
    idx = idx[(idx >= 0) & (idx < count)]
    counts = np.bincount(idx, minlength=count).astype(float)
    return counts / window_wall_s
