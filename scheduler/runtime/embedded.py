"""The embedded stack: a Kafka broker (the configured one, or an embedded Tansu), a migrated
database and an ingest consumer running in a thread. Started and stopped as one unit by the demo,
and reusable by anything that needs the telemetry path live (tests, later demo stages).

Example::

    with EmbeddedStack(settings) as stack:
        stack.start_ingest()
        ...  # produce to stack.bootstrap; rows appear in stack.engine
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from ingest.consumer import BatchReport, IngestConsumer
    from ingest.embedded import EmbeddedBroker
    from scheduler.settings import Settings

log = structlog.get_logger(__name__)


def _reachable(bootstrap: str) -> bool:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


class EmbeddedStack:
    """Broker + database + ingest consumer, started and stopped together."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.broker: EmbeddedBroker | None = None
        self.bootstrap = ""
        self.engine: Engine | None = None
        self.consumer: IngestConsumer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> EmbeddedStack:
        """Use the configured (or already running) broker, else start one; create topics; migrate."""
        from ingest.embedded import EmbeddedBroker, create_topics
        from scheduler.runtime import open_database

        existing = self.settings.resolved_kafka_bootstrap()
        if existing and _reachable(existing):
            self.bootstrap = existing
        else:
            if existing and not self.settings.kafka_bootstrap:
                (self.settings.home / "broker.json").unlink(missing_ok=True)  # stale: its broker is gone
            home = self.settings.home.resolve()
            self.broker = EmbeddedBroker(log_path=home / "broker.log", state_path=home / "broker.json").start()
            self.bootstrap = self.broker.bootstrap
        kafka = self.settings.kafka
        create_topics(self.bootstrap, {kafka.topic: kafka.partitions, kafka.dlq_topic: 1})
        self.engine = open_database(self.settings)
        log.info("stack.started", bootstrap=self.bootstrap, embedded_broker=self.broker is not None)
        return self

    def start_ingest(self, on_commit: Callable[[BatchReport], None] | None = None) -> IngestConsumer:
        """Run the ingest consumer in a background thread (every partition, no group join)."""
        from ingest.consumer import IngestConsumer

        assert self.engine is not None, "start() the stack first"
        self.consumer = IngestConsumer(
            self.engine, self.bootstrap, self.settings.kafka, self.settings.ingest, mode="assign", on_commit=on_commit
        )
        self._thread = threading.Thread(target=self.consumer.run, name="undertow-ingest", daemon=True)
        self._thread.start()
        return self.consumer

    def stop_ingest(self, timeout_s: float = 30.0) -> None:
        """Stop the consumer after the batch in hand is committed."""
        if self.consumer is not None:
            self.consumer.stop()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._thread = None

    def stop(self) -> None:
        """Stop the consumer, then the broker this stack started (a configured one is left alone)."""
        self.stop_ingest()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self.engine is not None:
            self.engine.dispose()
        log.info("stack.stopped")

    def __enter__(self) -> EmbeddedStack:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
