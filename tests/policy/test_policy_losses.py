"""Advantages and losses against values computed by hand from the formulas TRL and OpenRLHF use."""

from __future__ import annotations

import math

import pytest
import torch

from policy.advantages import RunningBaseline, compute_advantages, group_baseline, group_normalized
from policy.losses import LossConfig, LossInputs, k3_kl, load_balancing_loss, policy_loss, sequence_ratio


def test_grpo_group_normalized_known_value() -> None:
    adv = group_normalized(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=1e-4)
    assert adv.tolist() == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754], abs=1e-7)


def test_grpo_constant_group_is_zero_and_singleton_is_safe() -> None:
    assert group_normalized(torch.tensor([0.5, 0.5, 0.5])).tolist() == [0.0, 0.0, 0.0]
    assert group_normalized(torch.tensor([1.0])).tolist() == [0.0]


def test_reinforce_and_rloo_baselines() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert group_baseline(r).tolist() == [0.5, -0.5, -0.5, 0.5]
    # RLOO: r_i - mean of the other three
    assert group_baseline(r, leave_one_out=True).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_running_baseline_never_uses_own_reward() -> None:
    b = RunningBaseline(alpha=0.5)
    assert b.advantage("ctx", 1.0) == 1.0  # baseline starts at 0
    assert b.advantage("ctx", 1.0) == 0.5  # baseline now 0.5
    assert b.advantage("other", 0.0) == 0.0
    restored = RunningBaseline.from_state(b.state_dict())
    assert restored.values == b.values


def test_compute_advantages_mixes_groups_and_running_baseline() -> None:
    adv = compute_advantages([1, 0, 0, 1, 0.7], ["g", "g", "g", "g", None], ["a"] * 4 + ["b"], method="grpo")
    assert adv[:4] == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754], abs=1e-6)
    assert adv[4] == pytest.approx(0.7)
    with pytest.raises(ValueError):
        compute_advantages([1.0], ["g", "h"], ["a"])
    with pytest.raises(ValueError):
        compute_advantages([1.0], ["g"], ["a"], method="ppo-lol")


def test_grpo_batch_keeps_a_near_tie_small_where_grpo_blows_it_up() -> None:
    # a reward model's probabilities: group "a" has a real winner, group "b" is a near tie
    rewards = [0.9, 0.2, 0.2, 0.2, 0.41, 0.40, 0.40, 0.39]
    groups = ["a"] * 4 + ["b"] * 4
    grpo = compute_advantages(rewards, groups, [""] * 8, method="grpo")
    batch = compute_advantages(rewards, groups, [""] * 8, method="grpo_batch")
    # per-group scaling makes the tie's 0.01 differences as large as the winner's 0.7 lead
    assert max(map(abs, grpo[4:])) > 0.8 * max(map(abs, grpo[:4]))
    # the batch's std keeps them in proportion: centred rewards over one shared scale
    scale = float(torch.tensor(rewards, dtype=torch.float64).std()) + 1e-4
    expected = [0.9 - 0.375, 0.2 - 0.375, 0.2 - 0.375, 0.2 - 0.375, 0.01, 0.0, 0.0, -0.01]
    assert batch == pytest.approx([e / scale for e in expected], abs=1e-9)
    assert max(map(abs, batch[4:])) < 0.05 * max(map(abs, batch[:4]))
    # order within a group is the same under both; a lone session still takes the running baseline
    assert sorted(range(4), key=lambda i: batch[i]) == sorted(range(4), key=lambda i: grpo[i])
    alone = compute_advantages([0.3, 0.9, 0.1], [None, "g", "g"], ["c", "", ""], method="grpo_batch")
    assert alone[0] == pytest.approx(0.3)
    assert alone[1] == pytest.approx(-alone[2])
    # all ties: zero advantages, no division by zero
    assert compute_advantages([0.5] * 4, ["g"] * 4, [""] * 4, method="grpo_batch") == [0.0] * 4


def _inputs(logp: list[float], served: list[float], adv: list[float], **kw: object) -> LossInputs:
    t = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    return LossInputs(
        logprobs=t,
        served_logprobs=torch.tensor(served, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        seq_index=torch.zeros(len(logp), dtype=torch.int64),
        normalizer=float(len(logp)),
        **kw,  # type: ignore[arg-type]
    )


def test_ppo_clip_on_policy_equals_vanilla_pg() -> None:
    inp = _inputs([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    out = policy_loss(inp, LossConfig())
    # ratio = 1 -> loss = -(1*1 + 1*(-1)) / 2 = 0, gradient = -A / N
    assert float(out.loss.detach()) == pytest.approx(0.0)
    out.loss.backward()
    assert inp.logprobs.grad is not None
    assert inp.logprobs.grad.tolist() == pytest.approx([-0.5, 0.5])


def test_ppo_clip_and_truncated_is_values() -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, tis_cap=2.0)
    # token 0: ratio e^0.5 = 1.6487 > 1.2 with A=+1 -> clipped 1.2; old = served -> weight 1
    inp = _inputs([-0.5], [-1.0], [1.0])
    assert float(policy_loss(inp, cfg).loss.detach()) == pytest.approx(-1.2)
    # A=-1 takes the unclipped (pessimistic) branch: min(-1.6487, -1.2) = -1.6487
    inp = _inputs([-0.5], [-1.0], [-1.0])
    assert float(policy_loss(inp, cfg).loss.detach()) == pytest.approx(math.exp(0.5))
    # decoupled: old = -0.5 (proximal), served mu = -2 -> weight min(e^1.5, 2) = 2; ratio = 1
    inp = _inputs([-0.5], [-2.0], [1.0], old_logprobs=torch.tensor([-0.5], dtype=torch.float64))
    out = policy_loss(inp, cfg)
    assert float(out.loss.detach()) == pytest.approx(-2.0)
    assert out.metrics["is/truncated_sum"] == 1.0


def test_gspo_sequence_ratio_is_geometric_mean() -> None:
    lr = torch.tensor([0.1, 0.3, -0.2], dtype=torch.float64)
    idx = torch.tensor([0, 0, 1])
    ratio = sequence_ratio(lr, idx, 2)
    assert ratio.tolist() == pytest.approx([math.exp(0.2), math.exp(0.2), math.exp(-0.2)])
    inp = _inputs([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0])
    out = policy_loss(inp, LossConfig(level="sequence"))
    assert float(out.loss.detach()) == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        policy_loss(inp, LossConfig(level="bogus"))


def test_k3_kl_known_value_and_nonnegative() -> None:
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.0, -2.0])
    kl = k3_kl(logp, ref)
    assert kl.tolist() == pytest.approx([0.0, math.exp(-1) + 1 - 1])
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_kl_and_entropy_terms_enter_the_loss() -> None:
    base = _inputs([-1.0], [-1.0], [0.0])
    with_kl = _inputs([-1.0], [-1.0], [0.0], ref_logprobs=torch.tensor([-2.0], dtype=torch.float64))
    out = policy_loss(with_kl, LossConfig(kl_coef=0.5))
    assert float(out.loss.detach()) == pytest.approx(0.5 * (math.exp(-1) + 1 - 1))
    assert float(policy_loss(base, LossConfig()).loss.detach()) == 0.0
    ent = _inputs([-1.0], [-1.0], [0.0], entropy=torch.tensor([2.0], dtype=torch.float64))
    assert float(policy_loss(ent, LossConfig(entropy_coef=0.1)).loss.detach()) == pytest.approx(-0.2)


def test_load_balancing_loss_is_one_when_balanced_and_higher_when_collapsed() -> None:
    balanced = [torch.zeros(8, 4)]
    assert float(load_balancing_loss(balanced, top_k=1)) == pytest.approx(1.0, abs=0.3)
    collapsed = torch.full((8, 4), -10.0)
    collapsed[:, 0] = 10.0
    assert float(load_balancing_loss([collapsed], top_k=1)) == pytest.approx(4.0, rel=1e-3)
    assert float(load_balancing_loss([], top_k=2)) == 0.0
