"""Advantage estimators for the RL update (pure, typed functions over reward tensors).

- GRPO group normalisation (Shao et al. 2024, "DeepSeekMath", eq. 3; TRL ``GRPOTrainer``,
  OpenRLHF ``group_norm``): ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the G rollouts of
  one prompt, with the unbiased (n-1) standard deviation as TRL and OpenRLHF compute it.
  Rewards ``[1, 0, 0, 1]``, eps ``1e-4``: ``A = [+0.8658754, -0.8658754, -0.8658754, +0.8658754]``.
- GRPO with the batch's scale (``grpo_batch``; TRL's ``scale_rewards="batch"``): each reward less its
  group's mean, divided by the std of every grouped reward in the batch (not the group's own). A group
  whose rewards barely differ keeps small advantages instead of unit-size ones: with a continuous
  reward (a reward model's probability) a group of near ties would otherwise push as hard as a group
  with a real winner, in whatever direction the reward's small errors point.
- REINFORCE with a baseline (Williams 1992): ``A_i = r_i - b``; ``b`` is the group mean when
  the rollout belongs to a candidate group (with ``leave_one_out``, the mean of the *other*
  members: RLOO, Ahmadian et al. 2024), else a running per-context baseline
  (:class:`RunningBaseline`, an exponential moving average keyed by the context, e.g. the
  prompt or the user's task type), which needs no extra generation.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

METHODS = ("grpo", "grpo_batch", "reinforce", "rloo")
"""Advantage estimators :func:`compute_advantages` knows."""


def group_normalized(rewards: torch.Tensor, eps: float = 1e-4, unbiased: bool = True) -> torch.Tensor:
    """GRPO: ``(r - mean(r)) / (std(r) + eps)`` over one group (last dimension)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=unbiased) if rewards.shape[-1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


def group_baseline(rewards: torch.Tensor, leave_one_out: bool = False) -> torch.Tensor:
    """REINFORCE with the group mean as baseline: ``r_i - mean(r)``; RLOO: ``r_i - mean(r_{-i})``."""
    n = rewards.shape[-1]
    if not leave_one_out or n < 2:
        return rewards - rewards.mean(dim=-1, keepdim=True)
    others = (rewards.sum(dim=-1, keepdim=True) - rewards) / (n - 1)
    return rewards - others


@dataclass
class RunningBaseline:
    """Per-context exponential moving average of rewards: ``b_c <- (1 - alpha) b_c + alpha r``.

    The advantage of a reward is taken against the baseline *before* the update with it, so a
    rollout never baselines itself. A context seen for the first time uses ``default``.
    """

    alpha: float = 0.1
    default: float = 0.0
    values: dict[str, float] = field(default_factory=dict)

    def advantage(self, context: Hashable, reward: float) -> float:
        """``reward - b_context``, then fold ``reward`` into ``b_context``."""
        key = str(context)
        base = self.values.get(key, self.default)
        self.values[key] = (1 - self.alpha) * base + self.alpha * reward
        return reward - base

    def state_dict(self) -> dict[str, object]:
        """Serializable state (saved with the trainer state for exact resume)."""
        return {"alpha": self.alpha, "default": self.default, "values": dict(self.values)}

    @classmethod
    def from_state(cls, state: dict[str, object]) -> RunningBaseline:
        """Inverse of :meth:`state_dict`."""
        values = state.get("values", {})
        assert isinstance(values, dict)
        return cls(float(state["alpha"]), float(state["default"]), {str(k): float(v) for k, v in values.items()})  # type: ignore[arg-type]


def compute_advantages(
    rewards: Sequence[float],
    groups: Sequence[str | None],
    contexts: Sequence[str],
    *,
    method: str = "grpo",
    eps: float = 1e-4,
    baseline: RunningBaseline | None = None,
) -> list[float]:
    """Advantages for a batch: grouped rollouts by ``method`` (:data:`METHODS`),
    ungrouped ones (and groups of one) against ``baseline`` (a fresh one when None)."""
    if not len(rewards) == len(groups) == len(contexts):
        raise ValueError("rewards, groups and contexts must have equal lengths")
    if method not in METHODS:
        raise ValueError(f"unknown advantage method {method!r}; use {', '.join(METHODS)}")
    baseline = baseline if baseline is not None else RunningBaseline()
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if g is not None:
            members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    scale = 1.0
    if method == "grpo_batch":
        grouped = [float(rewards[i]) for idx in members.values() if len(idx) >= 2 for i in idx]
        spread = torch.tensor(grouped, dtype=torch.float64).std() if len(grouped) > 1 else torch.tensor(0.0)
        scale = float(spread) + eps
    for idx in members.values():
        if len(idx) < 2:
            continue
        r = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
        if method == "grpo_batch":
            adv = group_baseline(r) / scale
        elif method == "grpo":
            adv = group_normalized(r, eps)
        else:
            adv = group_baseline(r, leave_one_out=method == "rloo")
        for i, a in zip(idx, adv.tolist(), strict=True):
            out[i] = a
    for i, g in enumerate(groups):
        if g is None or len(members[g]) < 2:
            out[i] = baseline.advantage(contexts[i], float(rewards[i]))
    return out
