"""The RL trainer: scored rollouts in, a new policy version (checkpoint + row) out.

One optimizer step (:func:`update_step`): advantages for the batch (GRPO groups, or REINFORCE
against a running per-context baseline), then for each rollout one full-sequence forward,
batch of one, through :func:`policy.forward.forward_tokens` (the serving engine's code path,
with routing replay of the served experts), the clipped and importance-corrected loss of
:mod:`policy.losses`, and backward. Gradients accumulate over the batch; with several processes
(``torchrun``, gloo on CPU) each rank takes every ``world``-th rollout and the gradients are
summed with an all-reduce before the step (data parallel; the loss is normalised by the
*global* token count, so 2 processes compute the same loss and update as 1).

Rollouts with zero advantage are skipped when no KL or entropy term needs them (they carry no
policy gradient; DAPO's dynamic sampling drops such groups for the same reason).

Online mode (:func:`train_on_rollouts`) takes scored production rollouts (see
:func:`policy.rollouts.rollouts_from_sessions`), drops and counts stale ones, and steps once
per batch of whole candidate groups. Offline mode (:func:`train_offline`) samples its own
rollouts on the task family, seeded by ``(seed, step)`` only, and saves a resumable state
(weights, optimizer, baseline, step) every ``save_every`` steps; a run killed and resumed ends
with bit-identical weights to an uninterrupted run, and two runs with one seed produce
bit-identical weights (CPU, same thread count).

Left out: PPO multi-epoch minibatching over one batch (each batch is used for one step, so the
proximal policy equals the served one and the ratio starts at 1; the clip and truncated IS
matter for stale production data), and FSDP sharding (the tiny presets fit one process; the
all-reduce data-parallel path is what FSDP reduces to without sharding).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policy.advantages import RunningBaseline, compute_advantages
from policy.forward import forward_tokens, routers
from policy.losses import LossConfig, LossInputs, load_balancing_loss, policy_loss
from policy.rollouts import Rollout, StalenessStats, filter_stale, rollouts_from_tasks
from policy.tasks import train_tasks

log = structlog.get_logger(__name__)
STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    """RL hyperparameters (defaults tuned for the ``tiny`` preset on the task family)."""

    seed: int = 0
    steps: int = 20
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tasks_per_step: int = 8
    group_size: int = 6
    temperature: float = 1.0
    max_tokens: int = 48
    advantage: str = "grpo"
    replay: bool = True
    max_staleness: int = 4
    loss: LossConfig = field(default_factory=LossConfig)
    save_every: int = 1


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def update_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: list[Rollout],
    cfg: TrainConfig,
    *,
    baseline: RunningBaseline | None = None,
    ref_model: PreTrainedModel | None = None,
) -> dict[str, float]:
    """One optimizer step on ``batch`` (the global batch: every rank passes the same list)."""
    rank, world = _world()
    advantages = compute_advantages(
        [r.reward for r in batch],
        [r.group_id for r in batch],
        [r.context for r in batch],
        method=cfg.advantage,
        baseline=baseline,
    )
    normalizer = float(max(1, sum(sum(r.mask) for r in batch)))
    needs_all = cfg.loss.kl_coef > 0 or cfg.loss.entropy_coef > 0 or cfg.loss.load_balance_coef > 0
    top_k = int(routers(model)[0].top_k)
    sums: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), dtype=torch.float64)
    for i in range(rank, len(batch), world):
        r, adv = batch[i], advantages[i]
        if adv == 0.0 and not needs_all:
            continue
        mask = torch.tensor(r.mask, dtype=torch.bool)
        out = forward_tokens(
            model,
            r.prompt_ids + r.completion_ids,
            prompt_len=len(r.prompt_ids),
            routed_experts=r.routed_experts if cfg.replay else None,
        )
        logp = out.logprobs[mask]
        served = torch.as_tensor(r.served_logprobs) if r.served_logprobs is not None else None
        served_t = served[mask] if served is not None else logp.detach()
        served_t = torch.where(torch.isnan(served_t), logp.detach().to(served_t.dtype), served_t)
        ref = None
        if ref_model is not None and cfg.loss.kl_coef > 0:
            with torch.no_grad():
                ref = forward_tokens(ref_model, r.prompt_ids + r.completion_ids, prompt_len=len(r.prompt_ids)).logprobs
            ref = ref[mask]
        inputs = LossInputs(
            logprobs=logp,
            served_logprobs=served_t,
            advantages=torch.full_like(logp, adv),
            seq_index=torch.zeros(logp.shape[0], dtype=torch.int64),
            normalizer=normalizer,
            ref_logprobs=ref,
            entropy=out.entropy[mask],
        )
        result = policy_loss(inputs, cfg.loss)
        loss = result.loss
        if cfg.loss.load_balance_coef > 0:
            lb = load_balancing_loss(out.router_logits, top_k)
            loss = loss + cfg.loss.load_balance_coef * lb * (logp.shape[0] / normalizer)
            sums["moe/load_balance_sum"] = sums.get("moe/load_balance_sum", 0.0) + float(lb) * logp.shape[0]
        loss.backward()
        total_loss += float(loss.detach())
        sums["gap/max_abs"] = max(sums.get("gap/max_abs", 0.0), float((logp.detach() - served_t).abs().max()))
        for k, v in result.metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    if world > 1:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        dist.all_reduce(total_loss, op=dist.ReduceOp.SUM)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    tokens = max(1.0, sums.get("tokens", 0.0))
    rewards = [r.reward for r in batch]
    metrics = {
        "loss/total": float(total_loss),
        "loss/policy": sums.get("loss/policy", 0.0),
        "ratio/clip_frac": sums.get("ratio/clip_frac_sum", 0.0) / tokens,
        "ratio/approx_kl": sums.get("ratio/approx_kl_sum", 0.0) / tokens,
        "is/mean_weight": sums.get("is/weight_sum", 0.0) / tokens,
        "is/truncated_frac": sums.get("is/truncated_sum", 0.0) / tokens,
        "entropy/mean": sums.get("entropy/sum_over_norm", 0.0) * normalizer / tokens,
        "gap/max_abs_logprob": sums.get("gap/max_abs", 0.0),
        "optim/grad_norm": float(grad_norm),
        "reward/mean": float(np.mean(rewards)) if rewards else 0.0,
        "batch/rollouts": float(len(batch)),
        "batch/trained_tokens": tokens,
    }
    if "moe/load_balance_sum" in sums:
        metrics["moe/load_balance"] = sums["moe/load_balance_sum"] / tokens
    return metrics


def make_optimizer(model: PreTrainedModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over all parameters (foreach off: the same summation order on every run)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)


def save_state(
    path: Path, model: PreTrainedModel, opt: torch.optim.Optimizer, step: int, extra: dict[str, Any]
) -> None:
    """Write the resumable trainer state atomically (temporary file, then rename)."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (STATE_FILE + ".tmp")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "extra": extra}, tmp)
    os.replace(tmp, path / STATE_FILE)


def load_state(path: Path, model: PreTrainedModel, opt: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
    """Restore weights and optimizer from :func:`save_state`; returns (step, extra)."""
    state = torch.load(path / STATE_FILE, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["step"]), dict(state["extra"])


def step_tasks(seed: int, step: int, count: int) -> list[Any]:
    """The training tasks of an offline step: a function of ``(seed, step)`` only."""
    return random.Random(seed * 1_000_003 + step).sample(train_tasks(), count)


def train_offline(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: TrainConfig,
    *,
    state_dir: Path | None = None,
    version: int = 0,
    start_step: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """RL on the task family for ``cfg.steps`` steps (resuming from ``state_dir`` when it has a state)."""
    opt = make_optimizer(model, cfg)
    baseline = RunningBaseline()
    step = start_step
    if state_dir is not None and (state_dir / STATE_FILE).exists():
        step, extra = load_state(state_dir, model, opt)
        baseline = RunningBaseline.from_state(extra.get("baseline", {"alpha": 0.1, "default": 0.0, "values": {}}))
        log.info("trainer.resumed", step=step)
    end = start_step + cfg.steps
    history: list[dict[str, float]] = []
    started = time.monotonic()
    while step < end:
        tasks = step_tasks(cfg.seed, step, cfg.tasks_per_step)
        batch = rollouts_from_tasks(
            model,
            tokenizer,
            tasks,
            group_size=cfg.group_size,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            seed=cfg.seed * 1_000_003 + step,
            version=version,
        )
        metrics = update_step(model, opt, batch, cfg, baseline=baseline)
        metrics["reward/kept_rate"] = float(np.mean([r.info["kept"] for r in batch])) if batch else 0.0
        step += 1
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
        log.info("trainer.step", step=step, reward=round(metrics["reward/mean"], 3), kept=metrics["reward/kept_rate"])
        if state_dir is not None and (step % cfg.save_every == 0 or step == end) and _world()[0] == 0:
            save_state(state_dir, model, opt, step, {"baseline": baseline.state_dict(), "config": _jsonable(cfg)})
    summary = {k: float(np.mean([h[k] for h in history if k in h])) for k in (history[0] if history else {})}
    summary["train/steps"] = float(len(history))
    summary["train/seconds"] = time.monotonic() - started
    summary["train/step"] = float(step)
    return summary


def train_on_rollouts(
    model: PreTrainedModel,
    rollouts: list[Rollout],
    cfg: TrainConfig,
    *,
    current_version: int,
    batch_rollouts: int = 48,
    baseline: RunningBaseline | None = None,
) -> tuple[dict[str, float], StalenessStats]:
    """Online path: drop stale rollouts (counted), then one step per batch of whole groups.

    Rollouts of one candidate group always land in the same batch (group advantages need all
    members). Returns mean metrics over the steps and the staleness statistics for the version row.
    """
    kept, stats = filter_stale(rollouts, current_version, cfg.max_staleness)
    by_group: dict[str, list[Rollout]] = {}
    for i, r in enumerate(kept):
        by_group.setdefault(r.group_id or f"_single{i}", []).append(r)
    batches: list[list[Rollout]] = [[]]
    for members in by_group.values():
        if batches[-1] and len(batches[-1]) + len(members) > batch_rollouts:
            batches.append([])
        batches[-1].extend(members)
    opt = make_optimizer(model, cfg)
    baseline = baseline if baseline is not None else RunningBaseline()
    history = [update_step(model, opt, b, cfg, baseline=baseline) for b in batches if b]
    metrics = {k: float(np.mean([h[k] for h in history])) for k in (history[0] if history else {})}
    metrics["train/steps"] = float(len(history))
    metrics["staleness/dropped"] = float(stats.dropped)
    return metrics, stats


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    out = asdict(cfg)
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}
