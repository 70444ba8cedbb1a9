"""Configuration sections owned by the policy layer."""

from __future__ import annotations

from pydantic import BaseModel


class PolicyConfig(BaseModel):
    """The policy model, RL trainer and weight store (filled in by the policy package)."""

    preset: str = "tiny"
    """Model preset: ``tiny``, ``small`` or a local Hugging Face MoE checkpoint directory."""
    weights_url: str = "weights"
    """Weight store location: a path under the Undertow home, or any fsspec URL."""
