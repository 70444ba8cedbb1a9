"""The RL trainer: scored rollouts in, a new policy version (checkpoint + row) out.

One optimizer step (:func:`update_step`): advantages for the batch (GRPO groups, or REINFORCE
against a running per-context baseline), then for each rollout one full-sequence forward,
batch of one, through :func:`policy.forward.forward_tokens` (the serving engine's code path,
with routing replay of the served experts), the clipped and importance-corrected loss of
:mod:`policy.losses`, and backward. Gradients accumulate over the batch.

Packed mode (``TrainConfig.pack_tokens > 0``): the rollouts are packed into rows of at most that
many tokens (:mod:`policy.packing`: first-fit decreasing, positions restarting per sequence, a
block-diagonal causal mask, each sequence's served experts replayed at its own tokens) and each
row is one forward and backward; the loss is the same sum (per-sequence advantages and
``seq_index``, KL, per-sequence load balance) with the same normaliser, so loss and gradients
equal the one-at-a-time path to float rounding (not bit for bit: the logprobs differ from the
served ones by ~1e-7, which is why 0, the exact path, stays the default). Ranks take every
``world``-th row, padded with zero-weight passes under FSDP like rollouts.

Several processes (``torchrun``, gloo on CPU; :mod:`policy.distributed`): every rank gets the
same global batch and takes every ``world``-th rollout that carries a gradient. With FSDP (``parallel = "fsdp"``, the
default) the model is sharded per decoder layer; a rank with one rollout fewer adds a zero-weight
pass so all run the same number of forward/backward passes (each gathers layers), gradients
are accumulated locally and summed by FSDP's reduce-scatter at the last backward, and the clip
and the optimizer work on the shards. With ``ddp`` each rank holds the whole model and the
gradients are all-reduced. Either way the loss is normalised by the *global* token count, so
2 processes compute the same loss and update as 1 (to float rounding: the sum order differs).

Rollouts with zero advantage are skipped when no KL or entropy term needs them (they carry no
policy gradient; DAPO's dynamic sampling drops such groups for the same reason).

Online mode (:func:`train_on_rollouts`) takes scored production rollouts (see
:func:`policy.rollouts.rollouts_from_sessions`), drops and counts stale ones, and steps once
per batch of whole candidate groups. Offline mode (:func:`train_offline`) samples its own
rollouts on the task family, seeded by ``(seed, step)`` only (rank 0 samples, with a gathered
copy of the weights under FSDP, and shares the batch), and saves a resumable state (whole
weights and optimizer keyed by parameter name, baseline, step; rank 0 writes) every
``save_every`` steps; a run killed and resumed ends with bit-identical weights to an
uninterrupted run, and two runs with one seed produce bit-identical weights (CPU, same thread
count and world size).

Devices (:func:`policy.distributed.train_device`): one GPU per process when CUDA is present
(``cuda:<LOCAL_RANK>``, NCCL between processes), else the CPU (gloo). The training forward runs
under bf16 autocast on CUDA (``TrainConfig.autocast``; weights, gradients, optimizer state and the
loss stay float32) and in float32 on CPU, where the trainer's logprobs equal the served ones bit
for bit. Packed rows can go several to a forward (``pack_rows``: a batch ``[rows, pack_tokens]``,
:func:`policy.packing.forward_packed_rows`).

Left out: PPO multi-epoch minibatching over one batch (each batch is used for one step, so the
proximal policy equals the served one and the ratio starts at 1; the clip and truncated IS
matter for stale production data), and sharded checkpoints (states are gathered whole on rank 0,
which is right for the shipped presets and not for models that do not fit one host). The CUDA
path (placement, autocast, NCCL) runs here only as far as a CPU can take it: bf16 autocast is
tested on the CPU, the device and backend choice by unit tests.
"""

from __future__ import annotations

import contextlib
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
from policy.distributed import (
    all_reduce_grads,
    barrier,
    broadcast,
    is_main,
    is_sharded,
    load_model_and_optim_state,
    model_and_optim_state,
    set_gradient_sync,
    to_float,
    unsharded_copy,
    world,
)
from policy.feedback import turn_advantages
from policy.forward import ForwardOutput, forward_tokens, routers
from policy.losses import LossConfig, LossInputs, load_balancing_loss, policy_loss
from policy.packing import PackedRow, forward_packed_rows, model_device, pack_sequences
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
    pack_tokens: int = 0
    """0: one forward per rollout (batch of one, logprobs bit-equal to the served ones on CPU).
    N > 0: rollouts packed into rows of at most N tokens, one forward per row (:mod:`policy.packing`);
    the same loss and gradients to float rounding, several times the throughput on CPU."""
    pack_rows: int = 1
    """Packed rows per forward (a batch ``[pack_rows, pack_tokens]``): one forward and backward then
    covers that many rows, so the per-forward overhead is paid once per group of rows."""
    feedback_weight: float = 0.0
    """Turn-level credit from execution feedback (:mod:`policy.feedback`): each turn of a grouped agent
    session is credited with the session's reward plus this times what its tools reported; 0: every
    turn carries the session's reward alone."""
    normalize: str = "token"
    """How the policy loss averages over the batch: ``token`` (every trained token of the batch weighs
    the same: a long trajectory weighs more) or ``session`` (each session's tokens are averaged, then
    the sessions: every session weighs the same, however many turns and tokens it took; see
    :func:`session_weights`)."""
    autocast: str = "auto"
    """Mixed precision of the training forward: ``auto`` (bf16 autocast on CUDA, none on CPU, where
    float32 keeps the logprobs equal to the served ones), ``bf16`` (on any device) or ``off``.
    Weights, gradients and the optimizer stay float32; the loss is computed in float32."""


def autocast(device: torch.device, cfg: TrainConfig) -> contextlib.AbstractContextManager[Any]:
    """The training forward's precision context for ``device`` (see :attr:`TrainConfig.autocast`)."""
    if cfg.autocast not in ("auto", "bf16", "off"):
        raise ValueError(f"autocast must be auto, bf16 or off (got {cfg.autocast!r})")
    if cfg.autocast == "bf16" or (cfg.autocast == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _merge(sums: dict[str, float]) -> dict[str, float]:
    """Diagnostics summed over the ranks (``gap/max_abs`` takes the maximum)."""
    if world()[1] == 1:
        return sums
    parts: list[dict[str, float]] = [{} for _ in range(world()[1])]
    dist.all_gather_object(parts, sums)
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = max(out.get(k, 0.0), v) if k == "gap/max_abs" else out.get(k, 0.0) + v
    return out


Advantage = float | np.ndarray
"""A rollout's advantage: one for all its tokens, or one per completion token (turn-level credit)."""


def _carries(advantage: Advantage) -> bool:
    """Whether an advantage moves anything (a nonzero value on some token)."""
    return bool(np.any(np.asarray(advantage) != 0.0))


def _per_token(advantage: Advantage, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The advantage of each trained token (``mask`` over the completion)."""
    if isinstance(advantage, np.ndarray):
        return torch.as_tensor(advantage, dtype=dtype, device=mask.device)[mask]
    return torch.full((int(mask.sum()),), float(advantage), dtype=dtype, device=mask.device)


def _microbatches(batch: list[Rollout], advantages: list[Advantage], needs_all: bool, *, pad: bool) -> list[int | None]:
    """This rank's rollout indices: every ``world``-th of those that carry a gradient.

    Under FSDP every rank must run the same number of forward/backward passes (each one gathers
    layers across ranks), so with ``pad`` a rank with one rollout fewer gets a ``None``: a pass
    whose loss is scaled by zero. Unsharded ranks need no padding.
    """
    rank, size = world()
    active = [i for i in range(len(batch)) if needs_all or _carries(advantages[i])]
    mine: list[int | None] = list(active[rank::size])
    if pad and size > 1:  # every rank holds the same list: rank 0's share is the largest
        mine += [None] * (len(active[0::size]) - len(mine))
    return mine


def _packed_rows(
    batch: list[Rollout], advantages: list[Advantage], needs_all: bool, pack_tokens: int, *, pad: bool
) -> tuple[list[int], list[PackedRow | None]]:
    """The rollouts that carry a gradient and this rank's packed rows of them (indices into that list).

    Every rank packs the same list the same way and takes every ``world``-th row; under FSDP a rank
    with a row fewer gets a ``None`` (a zero-weight pass), as in :func:`_microbatches`.
    """
    rank, size = world()
    active = [i for i in range(len(batch)) if needs_all or _carries(advantages[i])]
    rows = pack_sequences([len(batch[i].prompt_ids) + len(batch[i].completion_ids) for i in active], pack_tokens)
    mine: list[PackedRow | None] = list(rows[rank::size])
    if pad and size > 1:  # every rank packs the same rows: rank 0's share is the largest
        mine += [None] * (len(rows[0::size]) - len(mine))
    return active, mine


def _packed_passes(
    model: PreTrainedModel,
    batch: list[Rollout],
    advantages: list[Advantage],
    cfg: TrainConfig,
    normalizer: float,
    needs_all: bool,
    top_k: int,
    sharded: bool,
    ref_model: PreTrainedModel | None,
    sums: dict[str, float],
    total_loss: torch.Tensor,
) -> None:
    """Forward and backward this rank's packed rows (``pack_tokens > 0``), ``pack_rows`` rows per
    forward, accumulating into ``sums`` and ``total_loss``: per forward, the loss of
    :func:`policy_loss` over its sequences' concatenated masked tokens (per-sequence advantages,
    ``seq_index`` per sequence) plus each sequence's load-balance term weighted as in the
    one-at-a-time path, so the sum over forwards is the same loss."""
    device = model_device(model)
    active, work = _packed_rows(batch, advantages, needs_all, cfg.pack_tokens, pad=sharded)
    if not work:  # nothing carries a gradient (every advantage 0, no KL or entropy term)
        return
    first = next((row for row in work if row is not None), None)
    if first is None:  # this rank has no row at all: pad with the batch's first rollout alone
        first = PackedRow((0,), (len(batch[active[0]].prompt_ids) + len(batch[active[0]].completion_ids),))
    per_forward = max(1, cfg.pack_rows)
    chunks = [work[i : i + per_forward] for i in range(0, len(work), per_forward)]  # equal counts on every rank
    for n, chunk in enumerate(chunks):
        set_gradient_sync(model, n == len(chunks) - 1)
        rows = [row if row is not None else first for row in chunk]
        members = [[batch[active[j]] for j in row.members] for row in rows]
        seqs = [[r.prompt_ids + r.completion_ids for r in ms] for ms in members]
        prompt_lens = [[len(r.prompt_ids) for r in ms] for ms in members]
        replay = [[r.routed_experts for r in ms] for ms in members] if cfg.replay else None
        with autocast(device, cfg):
            outs_rows = forward_packed_rows(model, seqs, prompt_lens, routed_experts=replay)
            refs_rows = None
            if ref_model is not None and cfg.loss.kl_coef > 0:
                with torch.no_grad():
                    refs_rows = forward_packed_rows(ref_model, seqs, prompt_lens)
        real = [(packed, ms, outs) for packed, ms, outs in zip(chunk, members, outs_rows, strict=True) if packed]
        refs_real = [refs_rows[b] for b, packed in enumerate(chunk) if packed] if refs_rows is not None else []
        if real:
            loss = _rows_loss(
                [j for packed, _, _ in real for j in packed.members],
                [r for _, ms, _ in real for r in ms],
                [o for _, _, outs in real for o in outs],
                [o for refs in refs_real for o in refs] if refs_rows is not None else None,
                advantages,
                active,
                cfg,
                normalizer,
                top_k,
                device,
                sums,
            )
            total_loss += float(loss.detach())
        else:
            loss = torch.zeros((), device=device)
        for packed, outs in zip(chunk, outs_rows, strict=True):
            if packed is None:  # a pad row: keeps FSDP's collectives in step, contributes nothing
                loss = loss + 0.0 * sum(o.logprobs.sum() for o in outs)
        loss.backward()


def _rows_loss(
    indices: list[int],
    members: list[Rollout],
    outs: list[ForwardOutput],
    refs: list[ForwardOutput] | None,
    advantages: list[Advantage],
    active: list[int],
    cfg: TrainConfig,
    normalizer: float,
    top_k: int,
    device: torch.device,
    sums: dict[str, float],
) -> torch.Tensor:
    """The loss of the sequences of some packed rows (their masked tokens in one :func:`policy_loss`,
    each its own ``seq_index``, plus each sequence's load-balance term), diagnostics added to ``sums``."""
    # the sequences' tensors are laid end to end and masked once (not one small op per sequence)
    mask = torch.tensor([m for r in members for m in r.mask], dtype=torch.bool, device=device)
    counts = torch.tensor([sum(r.mask) for r in members], dtype=torch.int64, device=device)
    logp_all = torch.cat([o.logprobs for o in outs])[mask].float()
    served_np = [
        np.asarray(r.served_logprobs, dtype=np.float64)
        if r.served_logprobs is not None
        else np.full(len(r.mask), np.nan)  # no served logprobs: the trainer's own (ratio 1)
        for r in members
    ]
    served_all = torch.as_tensor(np.concatenate(served_np), device=device)[mask]
    served_all = torch.where(torch.isnan(served_all), logp_all.detach().to(served_all.dtype), served_all)
    per_token = torch.cat(
        [
            _per_token(advantages[active[j]], torch.tensor(r.mask, dtype=torch.bool, device=device), logp_all.dtype)
            for j, r in zip(indices, members, strict=True)
        ]
    )
    lb_terms: list[tuple[torch.Tensor, int]] = []
    if cfg.loss.load_balance_coef > 0:
        lb_terms = [
            (load_balancing_loss(o.router_logits, top_k), sum(r.mask)) for r, o in zip(members, outs, strict=True)
        ]
    inputs = LossInputs(
        logprobs=logp_all,
        served_logprobs=served_all,
        advantages=per_token,
        seq_index=torch.repeat_interleave(torch.arange(len(members), device=device), counts),
        normalizer=normalizer,
        ref_logprobs=torch.cat([o.logprobs for o in refs])[mask].float() if refs is not None else None,
        entropy=torch.cat([o.entropy for o in outs])[mask].float(),
    )
    result = policy_loss(inputs, cfg.loss)
    loss = result.loss
    for lb, count in lb_terms:
        loss = loss + cfg.loss.load_balance_coef * lb * (count / normalizer)
        sums["moe/load_balance_sum"] = sums.get("moe/load_balance_sum", 0.0) + float(lb.detach()) * count
    if logp_all.numel():
        gap = float((logp_all.detach() - served_all).abs().max())
        sums["gap/max_abs"] = max(sums.get("gap/max_abs", 0.0), gap)
    for key, v in result.metrics.items():
        sums[key] = sums.get(key, 0.0) + v
    return loss


def session_advantages(batch: list[Rollout], method: str, baseline: RunningBaseline | None) -> list[float]:
    """Advantages per rollout, computed once per session: the windows of one agent session share
    its reward and count once in their group's mean and spread (and in the running baseline)."""
    first: dict[str, int] = {}
    keys = [r.session_id if r.session_id else f"#{i}" for i, r in enumerate(batch)]
    unique = [i for i, key in enumerate(keys) if first.setdefault(key, i) == i]
    values = compute_advantages(
        [batch[i].reward for i in unique],
        [batch[i].group_id for i in unique],
        [batch[i].context for i in unique],
        method=method,
        baseline=baseline,
    )
    by_key = {keys[i]: v for i, v in zip(unique, values, strict=True)}
    return [by_key[key] for key in keys]


def session_weights(batch: list[Rollout], normalize: str) -> list[float]:
    """Per-rollout factors on the advantage that turn the token mean of the loss into ``normalize``.

    The policy loss is a sum over trained tokens divided by the batch's token count ``T`` (the token
    mean). With ``session``, rollout ``i`` of session ``s`` gets ``T / (S * T_s)`` (``S`` sessions in the
    batch, ``T_s`` trained tokens of all windows of ``s``), so the loss is the mean over sessions of each
    session's token mean. The clipped surrogate is positively homogeneous in the advantage, so scaling
    the advantage scales that rollout's share of the loss and nothing else.

    Why it matters for agent sessions: a session that fails keeps trying until its turn limit, so it
    has more turns, and more tokens, than one that succeeds early. Under the token mean its negative
    advantage then outweighs the positive one of the session it is compared with on exactly the
    tokens both share (the tool-call framing, ``submit``), and those are pushed down until the policy
    stops calling its tools. Averaging per session cancels that bias."""
    if normalize == "token":
        return [1.0] * len(batch)
    if normalize != "session":
        raise ValueError(f"normalize must be token or session (got {normalize!r})")
    keys = [r.session_id if r.session_id else f"#{i}" for i, r in enumerate(batch)]
    tokens: dict[str, int] = {}
    for key, r in zip(keys, batch, strict=True):
        tokens[key] = tokens.get(key, 0) + sum(r.mask)
    total = sum(tokens.values())
    return [total / (len(tokens) * tokens[key]) if tokens[key] else 0.0 for key in keys]


def update_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: list[Rollout],
    cfg: TrainConfig,
    *,
    baseline: RunningBaseline | None = None,
    ref_model: PreTrainedModel | None = None,
) -> dict[str, float]:
    """One optimizer step on ``batch`` (the global batch: every rank passes the same list).

    ``model`` may be plain (one process, or ``ddp``: gradients all-reduced here) or FSDP-sharded
    (:func:`policy.distributed.shard`: gradients reduce-scattered by FSDP at the last backward).
    """
    _, size = world()
    sharded = is_sharded(model)
    advantages = turn_advantages(
        batch, session_advantages(batch, cfg.advantage, baseline), cfg.advantage, cfg.feedback_weight
    )
    advantages = [a * w for a, w in zip(advantages, session_weights(batch, cfg.normalize), strict=True)]
    normalizer = float(max(1, sum(sum(r.mask) for r in batch)))
    needs_all = cfg.loss.kl_coef > 0 or cfg.loss.entropy_coef > 0 or cfg.loss.load_balance_coef > 0
    top_k = int(routers(model)[0].top_k)
    sums: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    device = model_device(model)
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    if cfg.pack_tokens < 0:
        raise ValueError(f"pack_tokens must be >= 0 (got {cfg.pack_tokens})")
    work: list[int | None] = []
    if cfg.pack_tokens > 0:
        _packed_passes(
            model, batch, advantages, cfg, normalizer, needs_all, top_k, sharded, ref_model, sums, total_loss
        )
    else:
        work = _microbatches(batch, advantages, needs_all, pad=sharded)
    for n, index in enumerate(work):
        set_gradient_sync(model, n == len(work) - 1)
        pad = index is None
        i = 0 if index is None else index
        r, adv = batch[i], advantages[i]
        mask = torch.tensor(r.mask, dtype=torch.bool, device=device)
        with autocast(device, cfg):
            out = forward_tokens(
                model,
                r.prompt_ids + r.completion_ids,
                prompt_len=len(r.prompt_ids),
                routed_experts=r.routed_experts if cfg.replay else None,
            )
            ref = None
            if ref_model is not None and cfg.loss.kl_coef > 0:
                with torch.no_grad():
                    seq = r.prompt_ids + r.completion_ids
                    ref = forward_tokens(ref_model, seq, prompt_len=len(r.prompt_ids)).logprobs[mask].float()
        logp = out.logprobs[mask].float()
        served = torch.as_tensor(r.served_logprobs, device=device) if r.served_logprobs is not None else None
        served_t = served[mask] if served is not None else logp.detach()
        served_t = torch.where(torch.isnan(served_t), logp.detach().to(served_t.dtype), served_t)
        inputs = LossInputs(
            logprobs=logp,
            served_logprobs=served_t,
            advantages=_per_token(adv, mask, logp.dtype),
            seq_index=torch.zeros(logp.shape[0], dtype=torch.int64, device=device),
            normalizer=normalizer,
            ref_logprobs=ref,
            entropy=out.entropy[mask].float(),
        )
        result = policy_loss(inputs, cfg.loss)
        loss = result.loss
        lb = None
        if cfg.loss.load_balance_coef > 0:
            lb = load_balancing_loss(out.router_logits, top_k)
            loss = loss + cfg.loss.load_balance_coef * lb * (logp.shape[0] / normalizer)
        if pad:
            (loss * 0.0).backward()  # keeps FSDP's collectives in step; contributes nothing
            continue
        loss.backward()
        total_loss += float(loss.detach())
        if lb is not None:
            sums["moe/load_balance_sum"] = sums.get("moe/load_balance_sum", 0.0) + float(lb.detach()) * logp.shape[0]
        sums["gap/max_abs"] = max(sums.get("gap/max_abs", 0.0), float((logp.detach() - served_t).abs().max()))
        for k, v in result.metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    set_gradient_sync(model, True)
    if size > 1:
        if not sharded:
            all_reduce_grads(model)
        dist.all_reduce(total_loss, op=dist.ReduceOp.SUM)
        sums = _merge(sums)
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
        "optim/grad_norm": to_float(grad_norm),
        "reward/mean": float(np.mean(rewards)) if rewards else 0.0,
        "batch/rollouts": float(len(batch)),
        "batch/trained_tokens": tokens,
    }
    if "moe/load_balance_sum" in sums:
        metrics["moe/load_balance"] = sums["moe/load_balance_sum"] / tokens
    if "loss/kl" in sums:
        metrics["loss/kl"] = sums["loss/kl"]  # the k3 KL to the reference, per trained token
    return metrics


def make_optimizer(model: PreTrainedModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over all parameters (foreach off: the same summation order on every run)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)


def save_state(
    path: Path, model: PreTrainedModel, opt: torch.optim.Optimizer, step: int, extra: dict[str, Any]
) -> None:
    """Write the resumable trainer state atomically (temporary file, then rename).

    Full tensors keyed by parameter name, whatever the world size (so a state saved by N
    processes resumes in one and back). Every rank calls it (gathering shards is collective);
    only rank 0 writes.
    """
    model_state, optim_state = model_and_optim_state(model, opt)
    if is_main():
        from ingest.private import private_dir

        private_dir(path)  # 0700: the state was trained on users' data
        tmp = path / (STATE_FILE + ".tmp")
        torch.save({"model": model_state, "optim": optim_state, "step": step, "extra": extra}, tmp)
        os.replace(tmp, path / STATE_FILE)
    barrier()


def load_state(path: Path, model: PreTrainedModel, opt: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
    """Restore weights and optimizer from :func:`save_state` (every rank reads the file); returns (step, extra)."""
    state = torch.load(path / STATE_FILE, weights_only=False)
    load_model_and_optim_state(model, opt, state["model"], state["optim"])
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
    sampler: PreTrainedModel | None = None
    while step < end:
        tasks = step_tasks(cfg.seed, step, cfg.tasks_per_step)
        # rank 0 samples (with the policy itself, or under FSDP a gathered copy) and shares the batch
        sampler = unsharded_copy(model, into=sampler)
        batch: list[Rollout] = []
        if sampler is not None:
            batch = rollouts_from_tasks(
                sampler,
                tokenizer,
                tasks,
                group_size=cfg.group_size,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                seed=cfg.seed * 1_000_003 + step,
                version=version,
            )
        batch = broadcast(batch)
        metrics = update_step(model, opt, batch, cfg, baseline=baseline)
        metrics["reward/kept_rate"] = float(np.mean([r.info["kept"] for r in batch])) if batch else 0.0
        step += 1
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
        log.info("trainer.step", step=step, reward=round(metrics["reward/mean"], 3), kept=metrics["reward/kept_rate"])
        if state_dir is not None and (step % cfg.save_every == 0 or step == end):
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
