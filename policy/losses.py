"""RL losses as pure typed functions: ``LossInputs -> LossOutputs`` (token and sequence level).

All tensors are flat over the scored tokens of one or more sequences (``seq_index`` says which);
the loss is a *sum* divided by ``normalizer`` (the token count of the whole optimizer batch),
so per-sequence backward passes accumulate exactly the batch's token mean (DAPO-style
token-level aggregation, Yu et al. 2025).

Policy gradient with off-policy correction. With behaviour (serving-time) logprobs ``mu``,
the trainer's proximal logprobs ``old`` (recomputed before the update, no grad; equal to
``mu`` when omitted) and the current ``logp``:

    ratio   = exp(logp - old)                                   (PPO ratio, Schulman et al. 2017)
    clipped = clip(ratio, 1 - eps_low, 1 + eps_high)            (asymmetric clip, DAPO)
    w       = min(exp(old - mu), tis_cap)                       (truncated IS, Ionides 2008;
                                                                 decoupled PPO, Hilton et al. 2022;
                                                                 Yao et al. 2025, "TIS")
    L_pg    = -sum_t w_t * min(ratio_t * A_t, clipped_t * A_t) / normalizer

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization") replaces the token ratio by the
length-normalised sequence ratio ``s_i = exp(mean_t(logp - old))`` (gradient through the mean),
clipped with a much smaller range (``gspo_eps``, 3e-4 .. 4e-4 in the paper).

KL to the reference policy with the k3 estimator (Schulman 2020, "Approximating KL
Divergence"; GRPO eq. 4): ``kl_t = exp(ref - logp) - (ref - logp) - 1 >= 0``.
Entropy bonus: ``-entropy_coef * sum_t H_t / normalizer``.
MoE load balancing (Switch Transformer, Fedus et al. 2021, eq. 4, with top-k dispatch):
``L_lb = E * sum_e f_e * P_e`` per layer, averaged over layers, where ``f_e`` is the fraction of
token-slots routed to expert ``e`` and ``P_e`` its mean router probability.

Diagnostics (under no_grad, namespaced): ``loss/*``, ``ratio/clip_frac``, ``ratio/approx_kl``
(``mean((ratio - 1) - log ratio)``), ``is/mean_weight``, ``is/truncated_frac``, ``entropy/mean``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    """Coefficients and clipping ranges of the RL objective."""

    level: str = "token"
    """``token`` (PPO/GRPO ratio per token) or ``sequence`` (GSPO)."""
    clip_low: float = 0.2
    """PPO lower clip range ``eps_low``."""
    clip_high: float = 0.28
    """PPO upper clip range ``eps_high`` (DAPO clip-higher)."""
    gspo_eps: float = 4e-4
    """GSPO sequence-ratio clip range."""
    tis_cap: float = 2.0
    """Truncation of the importance weight between proximal and behaviour policy."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    load_balance_coef: float = 0.0
    """Weight of the MoE load-balancing loss."""


@dataclass
class LossInputs:
    """Flat per-token tensors of one or more sequences."""

    logprobs: torch.Tensor
    """Current policy logprobs (with grad)."""
    served_logprobs: torch.Tensor
    """Behaviour (serving-time) logprobs ``mu``."""
    advantages: torch.Tensor
    """Per-token advantage (a sequence's advantage repeated over its tokens)."""
    seq_index: torch.Tensor
    """int64 sequence id of each token (0..S-1)."""
    normalizer: float
    """Token count of the whole optimizer batch."""
    old_logprobs: torch.Tensor | None = None
    """Proximal-policy logprobs ``old`` (no grad); None means ``old = mu``."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-policy logprobs for the KL term."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of the current policy (with grad) for the bonus."""


@dataclass
class LossOutputs:
    """Scalar loss to backpropagate and detached diagnostics."""

    loss: torch.Tensor
    metrics: dict[str, float]


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1``."""
    delta = ref_logprobs - logprobs
    return delta.exp() - delta - 1


def truncated_is_weight(old_logprobs: torch.Tensor, served_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(old - mu), cap)``: proximal over behaviour probability, truncated (no grad)."""
    return torch.exp(old_logprobs - served_logprobs).clamp(max=cap).detach()


def sequence_ratio(log_ratio: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """GSPO's per-token view of ``exp(mean_t log_ratio)`` of each token's sequence."""
    sums = torch.zeros(num_seqs, dtype=log_ratio.dtype).index_add(0, seq_index, log_ratio)
    counts = torch.zeros(num_seqs, dtype=log_ratio.dtype).index_add(0, seq_index, torch.ones_like(log_ratio))
    return torch.exp(sums / counts.clamp(min=1))[seq_index]


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Clipped, importance-corrected policy gradient (+ KL, entropy); see the module docstring."""
    if cfg.level not in ("token", "sequence"):
        raise ValueError(f"unknown loss level {cfg.level!r}; use token or sequence")
    logp = inputs.logprobs
    mu = inputs.served_logprobs.to(logp.dtype)
    old = mu if inputs.old_logprobs is None else inputs.old_logprobs.to(logp.dtype).detach()
    adv = inputs.advantages.to(logp.dtype)
    log_ratio = logp - old
    if cfg.level == "sequence":
        num_seqs = int(inputs.seq_index.max()) + 1 if inputs.seq_index.numel() else 0
        ratio = sequence_ratio(log_ratio, inputs.seq_index, num_seqs)
        clipped = ratio.clamp(1 - cfg.gspo_eps, 1 + cfg.gspo_eps)
    else:
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    weight = truncated_is_weight(old, mu, cfg.tis_cap)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    pg_loss = -(weight * surrogate).sum() / inputs.normalizer
    loss = pg_loss
    metrics: dict[str, float] = {}
    if inputs.ref_logprobs is not None and cfg.kl_coef > 0:
        kl = k3_kl(logp, inputs.ref_logprobs.to(logp.dtype).detach())
        kl_loss = kl.sum() / inputs.normalizer
        loss = loss + cfg.kl_coef * kl_loss
        metrics["loss/kl"] = float(kl_loss.detach())
    if inputs.entropy is not None:
        ent = inputs.entropy.sum() / inputs.normalizer
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
        metrics["entropy/sum_over_norm"] = float(ent.detach())
    with torch.no_grad():
        r = ratio.detach()
        metrics["loss/policy"] = float(pg_loss.detach())
        metrics["ratio/clip_frac_sum"] = float(((r - clipped.detach()).abs() > 0).float().sum())
        metrics["ratio/approx_kl_sum"] = float(((r - 1) - torch.log(r)).sum())
        metrics["is/weight_sum"] = float(weight.sum())
        metrics["is/truncated_sum"] = float((torch.exp(old - mu) > cfg.tis_cap).float().sum())
        metrics["tokens"] = float(logp.numel())
    return LossOutputs(loss=loss, metrics=metrics)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss ``E * sum_e f_e P_e``, averaged over MoE layers (1.0 = balanced)."""
    if not router_logits:
        return torch.zeros(())
    total = torch.zeros(())
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        dispatch = torch.zeros_like(probs).scatter(-1, chosen, 1.0)
        f = dispatch.mean(dim=0) / top_k
        p = probs.mean(dim=0)
        total = total + num_experts * (f * p).sum()
    return total / len(router_logits)
