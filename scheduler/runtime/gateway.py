"""The gateway's wiring from settings: its telemetry emitter (signing what it writes) and its key ring."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from ingest.producer import TelemetryProducer
from ingest.signing import keyring
from scheduler.runtime import require_bootstrap
from scheduler.settings import Settings
from serving.keys import ClientKey, KeyRing
from serving.telemetry import PRODUCER_OPTIONS, TelemetryEmitter


def gateway_emitter(settings: Settings, bootstrap: str | None = None) -> TelemetryEmitter:
    """The gateway's telemetry emitter: events signed with ``serving.gateway.signing_key_id`` when that key
    is among ``ingest.signing_keys``; ``bootstrap`` defaults to the configured broker."""
    cfg = settings.serving.gateway
    bootstrap, topic = bootstrap or require_bootstrap(settings), settings.kafka.topic
    key = keyring(settings.ingest.signing_keys).get(cfg.signing_key_id)
    return TelemetryEmitter(
        lambda: TelemetryProducer(bootstrap, topic, signing_key=key, **PRODUCER_OPTIONS),
        settings.home / cfg.spool_dir,
        max_spool_bytes=cfg.spool_max_bytes,
        queue_size=cfg.emit_queue_size,
        spool_hours=cfg.spool_hours,
        events_per_s=cfg.spool_events_per_s,
        min_free_bytes=cfg.spool_min_free_bytes,
        signal_share=cfg.spool_signal_share,
        full_policy=cfg.spool_full_policy,
    )


def gateway_keys(settings: Settings, db: Engine | None) -> KeyRing:
    """The gateway's key ring: the keys in the database, plus ``serving.gateway.metrics_key``."""
    cfg = settings.serving.gateway
    static = {cfg.metrics_key.get_secret_value(): ClientKey("metrics-setting", ("metrics",))} if cfg.metrics_key else {}
    return KeyRing(db, cfg.key_refresh_s, static)
