"""Supervised warm-up: policy v0 from a corpus of concise, verbose and wrong solutions.

The corpus mirrors what a coding assistant's early model writes: per training task one
solution drawn from a tier-dependent mix of correct-and-concise, correct-but-verbose and
plausibly wrong bodies (:data:`MIXES`). A model fit to that mix is competent (it writes valid
code of the right shape) but clearly improvable: on held-out tasks it is concise and correct
only part of the time, and RL has a visible target. Harder tiers get fewer concise examples,
so their pass-and-keep rate starts lower and climbs over more versions.

Training is next-token cross-entropy on the completion (body and EOS) only, padded batches,
AdamW with a linear warm-up and cosine decay; deterministic for a seed on CPU.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policy.model import build_model
from policy.tasks import Task, train_tasks
from policy.tokenizer import default_tokenizer

log = structlog.get_logger(__name__)

MIXES: dict[int, tuple[float, float, float]] = {1: (0.35, 0.35, 0.30), 2: (0.25, 0.45, 0.30), 3: (0.2, 0.5, 0.3)}
"""Per tier: probability of a concise, verbose and wrong solution in the warm-up corpus (and in the
transcripts the presets' tokenizer is trained on)."""

Mixes = Mapping[int, tuple[float, float, float]]


@dataclass(frozen=True)
class SFTConfig:
    """Warm-up hyperparameters."""

    preset: str = "tiny"
    seed: int = 0
    steps: int = 400
    batch_size: int = 32
    lr: float = 5e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    max_seconds: float | None = None
    """Stop early after this much wall time (the schedule still assumes ``steps``)."""
    agent_every: int = 0
    """Every ``agent_every``-th step trains on agent transcripts (:mod:`policy.agent_sft`) instead of
    completions; 0: completions only."""
    agent_tasks: int = 600
    """Training tasks given a scripted agent session (a fixed, seeded sample)."""
    agent_batch_size: int = 8
    mixes: Mixes | None = None
    """The corpus's mix of concise, verbose and wrong solutions per tier (None: :data:`MIXES`)."""


def encode_example(tokenizer: PreTrainedTokenizerBase, task: Task, body: str) -> tuple[list[int], int]:
    """``[EOS] + prompt + body + [EOS]`` token ids and the prompt length (BOS included)."""
    eos = int(tokenizer.eos_token_id)
    prompt = [eos, *tokenizer.encode(task.prompt, add_special_tokens=False)]
    completion = [*tokenizer.encode(body, add_special_tokens=False), eos]
    return prompt + completion, len(prompt)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, task: Task) -> list[int]:
    """The token ids a task's completion is sampled after (BOS + prompt)."""
    return [int(tokenizer.eos_token_id), *tokenizer.encode(task.prompt, add_special_tokens=False)]


def build_corpus(tasks: list[Task], seed: int, mixes: Mixes = MIXES) -> list[tuple[Task, str, str]]:
    """One ``(task, body, kind)`` per task, ``kind`` in concise/verbose/wrong, per ``mixes``."""
    rng = random.Random(seed)
    out = []
    for task in tasks:
        concise, verbose, _ = mixes[task.tier]
        u = rng.random()
        if u < concise:
            out.append((task, task.concise, "concise"))
        elif u < concise + verbose or not task.wrong:
            out.append((task, task.verbose, "verbose"))
        else:
            out.append((task, rng.choice(task.wrong), "wrong"))
    return out


def lm_batch(
    examples: Sequence[tuple[list[int], int | list[bool]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 where not trained): an
    example's second item is its prompt length (the rest trained) or a mask of the trained tokens."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (seq, trained) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        keep = [k >= trained for k in range(len(seq))] if isinstance(trained, int) else trained
        labels[i, : len(seq)] = torch.where(torch.tensor(keep), torch.tensor(seq), torch.tensor(-100))
    return ids, mask, labels


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up then cosine decay to 10%."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _take(order: list[int], size: int, count: int, rng: random.Random) -> list[int]:
    """The next ``count`` indices of a shuffled epoch order over ``size`` examples (refilled when short)."""
    if len(order) < count:
        fresh = list(range(size))
        rng.shuffle(fresh)
        order += fresh
    out = order[:count]
    del order[:count]
    return out


def warmup(cfg: SFTConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, float]]:
    """Train v0 from scratch; returns the model, its tokenizer and summary metrics."""
    tokenizer = default_tokenizer()
    model = build_model(cfg.preset, len(tokenizer), cfg.seed)
    mixes = MIXES if cfg.mixes is None else cfg.mixes
    corpus = build_corpus(train_tasks(), cfg.seed, mixes)
    examples = [encode_example(tokenizer, task, body) for task, body, _ in corpus]
    rng = random.Random(cfg.seed + 1)
    agent: list[tuple[list[int], list[bool]]] = []
    if cfg.agent_every > 0:
        from policy.agent_sft import agent_examples

        chosen = random.Random(cfg.seed + 2).sample(train_tasks(), min(cfg.agent_tasks, len(train_tasks())))
        agent = agent_examples(tokenizer, chosen, cfg.seed + 3, mixes)
    agent_order: list[int] = []
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    pad = int(tokenizer.pad_token_id)
    start = time.monotonic()
    order: list[int] = []
    loss_value = float("nan")
    step = 0
    for step in range(cfg.steps):
        batch: list[tuple[list[int], int | list[bool]]]
        if agent and step % cfg.agent_every == cfg.agent_every - 1:
            batch = [agent[i] for i in _take(agent_order, len(agent), cfg.agent_batch_size, rng)]
        else:
            batch = [examples[i] for i in _take(order, len(examples), cfg.batch_size, rng)]
        ids, mask, labels = lm_batch(batch, pad)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(loss.detach())
        if step % 50 == 0:
            log.info("sft.step", step=step, loss=round(loss_value, 4))
        if cfg.max_seconds is not None and time.monotonic() - start > cfg.max_seconds:
            break
    model.eval()
    kinds = [k for _, _, k in corpus]
    metrics = {
        "sft/loss": loss_value,
        "sft/steps": float(step + 1),
        "sft/seconds": time.monotonic() - start,
        "sft/frac_concise": kinds.count("concise") / len(kinds),
        "sft/frac_verbose": kinds.count("verbose") / len(kinds),
        "sft/frac_wrong": kinds.count("wrong") / len(kinds),
        "sft/agent_examples": float(len(agent)),
    }
    return model, tokenizer, metrics
