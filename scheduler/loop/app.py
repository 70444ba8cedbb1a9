"""The Celery app: brokers, reliability settings and the beat schedule, built from settings.

``celery -A scheduler.loop.app worker --pool=solo`` finds the module-level :data:`app`, whose
configuration is read lazily (on first use, from ``UNDERTOW_*`` and ``undertow.toml``), so
importing this module builds nothing. Code that holds its own :class:`Settings` calls
:func:`make_celery` instead.

Broker default: the SQLAlchemy transport on the Undertow database (``sqla+<url>``), results in
the same database (``db+<url>``); a worker on it runs with ``--pool=solo`` and a task round trip
takes about a second (polling). Production sets ``UNDERTOW_SCHEDULER__CELERY_BROKER_URL`` to a
Redis (``redis://``) or RabbitMQ (``amqp://``) URL. Tasks acknowledge late (a task lost with its
worker is not acknowledged), one message is prefetched at a time, and celery beat runs the
capacity plan and the lease reaper every planning interval, and the reward-model retrain triggers
(``undertow.check_retrain``) every ``retrain_check_interval_s``, and the retention sweep
(``undertow.enforce_retention``: telemetry and audit entries past their retention) every
``ingest.retention_interval_s``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from celery import Celery

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings

TASK_MODULES = ["scheduler.loop.tasks"]


def broker_url(settings: Settings) -> str:
    """The configured broker, else the SQLAlchemy transport on the Undertow database."""
    return settings.scheduler.celery_broker_url or f"sqla+{settings.resolved_database_url}"


def result_backend(settings: Settings) -> str:
    """The configured result backend, else the database backend on the Undertow database."""
    return settings.scheduler.celery_result_backend or f"db+{settings.resolved_database_url}"


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for ``settings`` (see the module docstring)."""
    cfg = settings.scheduler
    conf: dict[str, Any] = {
        "broker_url": broker_url(settings),
        "result_backend": result_backend(settings),
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_extended": True,
        "task_track_started": True,
        "timezone": "UTC",
        "enable_utc": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "include": TASK_MODULES,
        "beat_schedule": {
            "plan-capacity": {"task": "undertow.plan_capacity", "schedule": cfg.planning_interval_s},
            "reap-leases": {
                "task": "undertow.reap_leases",
                "schedule": min(cfg.planning_interval_s, cfg.lease_ttl_s / 2),
            },
            "reap-jobs": {"task": "undertow.reap_jobs", "schedule": cfg.job_lost_after_s / 2},
            "check-retrain": {"task": "undertow.check_retrain", "schedule": cfg.retrain_check_interval_s},
            "enforce-retention": {
                "task": "undertow.enforce_retention",
                "schedule": settings.ingest.retention_interval_s,
            },
        },
    }
    if conf["broker_url"].startswith(("redis", "rediss", "sentinel")):
        # Only Redis reads it (the SQLAlchemy transport hands its options to ``create_engine``).
        conf["broker_transport_options"] = {"visibility_timeout": cfg.longest_step_s + cfg.job_lost_after_s}
    return conf


def make_celery(settings: Settings) -> Celery:
    """A Celery app configured from ``settings`` (the tasks register on the module-level app;
    send them to this one by name: ``make_celery(s).send_task("undertow.reap_leases")``)."""
    celery = Celery("undertow", set_as_current=False)
    celery.conf.update(celery_config(settings))
    return celery


@lru_cache(maxsize=1)
def worker_settings() -> Settings:
    """The settings of this process (read once, from the environment and ``undertow.toml``)."""
    from scheduler.settings import load_settings

    return load_settings()


@lru_cache(maxsize=1)
def worker_engine() -> Engine:
    """The database engine of this worker process (schema checked once)."""
    from scheduler.runtime import open_database

    return open_database(worker_settings())


def _lazy_config() -> dict[str, Any]:
    return celery_config(worker_settings())


app = Celery("undertow")
app.add_defaults(_lazy_config)
