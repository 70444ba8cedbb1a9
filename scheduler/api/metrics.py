"""Prometheus ``/metrics``: gauges read from the database at scrape time.

A custom collector on a registry of the app's own (never the global one, so several apps can
live in one process): ingest lag and rate, stored events and dead letters, batches the consumer
could not read, job states, borrowed replicas and rollout state. Each scrape costs a handful of
indexed queries.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ingest.db import session_factory
from ingest.tables import DeadLetterRow, SessionRow, SignalRow
from ingest.unreadable import CODEC_UNAVAILABLE, CORRUPT_BATCH, held_counts
from scheduler.api import queue, sources


class UndertowCollector(Collector):
    """Reads the loop's state from the database on every scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        now = datetime.now(UTC)
        with session_factory(self.engine)() as session:
            recent = now - timedelta(seconds=60)
            lag = GaugeMetricFamily(
                "undertow_ingest_lag_seconds",
                "Median delay between an event happening and being stored, over the last 500 sessions.",
            )
            rows = session.execute(
                select(SessionRow.occurred_at, SessionRow.received_at)
                .order_by(SessionRow.received_at.desc())
                .limit(500)
            ).all()
            delays = sorted((r - o).total_seconds() for o, r in rows)
            lag.add_metric([], delays[len(delays) // 2] if delays else 0.0)
            yield lag

            last = session.scalar(select(func.max(SessionRow.received_at)))
            last_sig = session.scalar(select(func.max(SignalRow.received_at)))
            newest = max((t for t in (last, last_sig) if t is not None), default=None)
            age = GaugeMetricFamily(
                "undertow_ingest_last_event_age_seconds", "Seconds since the newest event was stored."
            )
            age.add_metric([], (now - newest).total_seconds() if newest else float("nan"))
            yield age

            n_recent = (session.scalar(select(func.count()).where(SessionRow.received_at >= recent)) or 0) + (
                session.scalar(select(func.count()).where(SignalRow.received_at >= recent)) or 0
            )
            rate = GaugeMetricFamily(
                "undertow_ingest_events_per_second", "Events stored per second over the last minute."
            )
            rate.add_metric([], n_recent / 60.0)
            yield rate

            events = GaugeMetricFamily("undertow_events_stored", "Distinct events stored, by type.", labels=["type"])
            events.add_metric(["session.completed"], session.scalar(select(func.count()).select_from(SessionRow)) or 0)
            for kind, count in session.execute(select(SignalRow.type, func.count()).group_by(SignalRow.type)):
                events.add_metric([kind], count)
            yield events

            dead = GaugeMetricFamily("undertow_dead_letters", "Dead letters stored, by reason.", labels=["reason"])
            for reason, count in session.execute(
                select(DeadLetterRow.reason, func.count()).group_by(DeadLetterRow.reason)
            ):
                dead.add_metric([reason], count)
            yield dead

            by_reason, held = held_counts(session)
            unreadable = CounterMetricFamily(
                "undertow_ingest_unreadable_batches",
                "Failed reads of batches the consumer could not read (codec library missing, corrupt), by reason.",
                labels=["reason"],
            )
            for reason in sorted({CODEC_UNAVAILABLE, CORRUPT_BATCH, *by_reason}):  # 0 before any: alerts can rate()
                unreadable.add_metric([reason], by_reason.get(reason, 0))
            yield unreadable
            waiting = GaugeMetricFamily(
                "undertow_ingest_held_partitions",
                "1 for each partition held at a batch that could not be read (see `undertow stats --json`).",
                labels=["group", "topic", "partition", "reason"],
            )
            for row in held:
                waiting.add_metric([row.group_id, row.topic, str(row.partition), row.reason], 1)
            yield waiting

            jobs = GaugeMetricFamily("undertow_jobs", "Jobs by kind and state.", labels=["kind", "state"])
            for (kind, state), count in queue.job_state_counts(session).items():
                jobs.add_metric([kind, state], count)
            yield jobs

            borrowed = GaugeMetricFamily(
                "undertow_borrowed_replicas", "Replicas currently lent to training.", labels=["pool"]
            )
            replicas = GaugeMetricFamily("undertow_replicas", "Replicas by pool and state.", labels=["pool", "state"])
            for (pool, state), count in sources.replica_state_counts(session).items():
                replicas.add_metric([pool, state], count)
                if state == "borrowed":
                    borrowed.add_metric([pool], count)
            yield replicas
            yield borrowed

            rollout = GaugeMetricFamily(
                "undertow_rollout_state",
                "1 for the state each pool's latest rollout is in.",
                labels=["pool", "version", "state"],
            )
            for d in sources.current_deployments(session):
                rollout.add_metric([d["pool"], d["version"] or "", d["state"]], 1)
            yield rollout


def make_registry(engine: Engine) -> CollectorRegistry:
    """A registry holding only Undertow's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(UndertowCollector(engine))
    return registry
