"""Configuration sections owned by the reward-model layer."""

from __future__ import annotations

from pydantic import BaseModel


class RewardsConfig(BaseModel):
    """Reward labels, models and retraining (filled in by the reward-model package)."""

    artifacts_dir: str = "reward_models"
    """Directory under the Undertow home where reward-model artifacts are stored."""
