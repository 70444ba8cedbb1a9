"""Configuration sections owned by the serving layer."""

from __future__ import annotations

from pydantic import BaseModel


class ServingConfig(BaseModel):
    """Engines, gateway and deployment (filled in by the serving package)."""

    gateway_port: int = 8100
    """Port the gateway listens on."""
