"""Configuration sections owned by the scheduler layer."""

from __future__ import annotations

from pydantic import BaseModel


class SchedulerConfig(BaseModel):
    """Celery, capacity planning and borrowing (filled in by the scheduler package)."""

    celery_broker_url: str | None = None
    """Celery broker; default: the SQLAlchemy transport on the Undertow database."""


class ApiConfig(BaseModel):
    """The FastAPI control plane."""

    port: int = 8200
    """Port the control plane listens on."""
