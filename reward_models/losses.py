"""Reward-model losses: Bradley-Terry pairwise and pointwise binary cross-entropy.

Pure typed functions, one formula per line, in torch (training) and NumPy (evaluation).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected - margin)``.

    Bradley & Terry, "Rank Analysis of Incomplete Block Designs", Biometrika 1952; as a reward
    model loss: Ouyang et al., "Training language models to follow instructions with human
    feedback", 2022; the margin as in Touvron et al., "Llama 2", 2023. ``weight`` (e.g. inverse
    display-position propensities) weighs each pair; the mean is over the weights.
    """
    delta = r_chosen - r_rejected - margin
    per_pair = -F.logsigmoid(delta)
    if weight is None:
        return per_pair.mean()
    return (per_pair * weight).sum() / weight.sum().clamp_min(1e-12)


def bradley_terry_loss_np(r_chosen: np.ndarray, r_rejected: np.ndarray, margin: float = 0.0) -> float:
    """NumPy twin of :func:`bradley_terry_loss` (``log(1 + exp(-delta))``, computed stably)."""
    delta = np.asarray(r_chosen, dtype=np.float64) - np.asarray(r_rejected, dtype=np.float64) - margin
    return float(np.mean(np.logaddexp(0.0, -delta)))


def pointwise_loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy of kept/accepted labels: ``-y log sigmoid(r) - (1 - y) log sigmoid(-r)``."""
    per_row = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    if weight is None:
        return per_row.mean()
    return (per_row * weight).sum() / weight.sum().clamp_min(1e-12)
