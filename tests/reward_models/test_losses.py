"""Reward-model losses against known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reward_models.losses import bradley_terry_loss, bradley_terry_loss_np, pointwise_loss


def test_bradley_terry_known_values() -> None:
    chosen, rejected = torch.tensor([1.0]), torch.tensor([0.0])
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(0.3132617, abs=1e-7)
    assert bradley_terry_loss(chosen, rejected, margin=0.5).item() == pytest.approx(0.4740770, abs=1e-7)
    assert bradley_terry_loss_np(np.array([1.0]), np.array([0.0])) == pytest.approx(0.3132617, abs=1e-7)
    assert bradley_terry_loss_np(np.array([1.0]), np.array([0.0]), 0.5) == pytest.approx(0.4740770, abs=1e-7)


def test_bradley_terry_is_stable_and_weighted() -> None:
    huge = bradley_terry_loss(torch.tensor([1000.0]), torch.tensor([-1000.0]))
    assert huge.item() == pytest.approx(0.0, abs=1e-12)
    wrong = bradley_terry_loss(torch.tensor([-1000.0]), torch.tensor([1000.0]))
    assert math.isfinite(wrong.item()) and wrong.item() == pytest.approx(2000.0)
    r_c, r_r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    weighted = bradley_terry_loss(r_c, r_r, weight=torch.tensor([1.0, 0.0]))
    assert weighted.item() == pytest.approx(0.3132617, abs=1e-7)


def test_bradley_terry_gradient_pushes_chosen_up() -> None:
    r_c = torch.tensor([0.2], requires_grad=True)
    r_r = torch.tensor([0.4], requires_grad=True)
    bradley_terry_loss(r_c, r_r).backward()
    assert r_c.grad is not None and r_r.grad is not None
    assert r_c.grad.item() < 0 < r_r.grad.item()


def test_pointwise_loss_matches_cross_entropy() -> None:
    loss = pointwise_loss(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0]))
    expected = (math.log(2.0) + math.log1p(math.exp(2.0))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
