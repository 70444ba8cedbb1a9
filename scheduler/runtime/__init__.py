"""Shared wiring for commands and services: a database that is ready (here), structured logging
(:mod:`.logs`), the embedded stack of broker, database and ingest consumer (:mod:`.embedded`) and the
gateway's emitter and key ring (:mod:`.gateway`).

On the embedded SQLite default every command migrates the schema by itself; against any other
database a command on an outdated schema stops with a message naming ``undertow db upgrade``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings


def open_database(settings: Settings) -> Engine:
    """An engine on the configured database with a current schema (see module docstring)."""
    from ingest.db import ensure_schema, make_engine

    engine = make_engine(settings.resolved_database_url)
    ensure_schema(engine, auto_upgrade=settings.is_embedded_database)
    return engine


def require_bootstrap(settings: Settings) -> str:
    """The Kafka bootstrap servers in force, or a clear error saying how to get a broker."""
    bootstrap = settings.resolved_kafka_bootstrap()
    if not bootstrap:
        raise SystemExit(
            "No Kafka broker: set UNDERTOW_KAFKA_BOOTSTRAP=host:port, or start the embedded one "
            "with `undertow broker` (or `undertow demo --keep-running`)."
        )
    return bootstrap
