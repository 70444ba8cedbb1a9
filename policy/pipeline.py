"""Version pipeline: warm-up to v0, then offline RL versions on the task family, each evaluated.

Each version is a checkpoint directory ``<root>/vNNNN`` (Hugging Face format) plus a
``policy_versions`` row written after it (the row is the completion marker). The trainer's
resumable state lives in ``<root>/state/vNNNN``: a run killed mid-version resumes there and
produces bit-identical weights. The scheduler drives these functions; they know nothing of it.

Under ``torchrun`` (a process group initialised by the caller) every rank calls
:func:`run_rl_versions`: the model is sharded (``PolicyConfig.parallel``, FSDP by default) or
replicated, rank 0 samples each step's rollouts and shares them, and rank 0 alone evaluates,
writes the checkpoint and the version row; every rank returns the same rows. The warm-up stays
one process (it is a few minutes of supervised training on the tiny presets).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
import torch
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from policy.config import PolicyConfig
from policy.distributed import broadcast, on_cpu, place, shard, train_device, unsharded_copy, world
from policy.evaluate import EvalConfig, evaluate
from policy.losses import LossConfig
from policy.model import load_checkpoint, save_checkpoint
from policy.rollouts import version_number
from policy.sft import SFTConfig, warmup
from policy.tables import PolicyVersionRow
from policy.trainer import TrainConfig, train_offline
from policy.versions import latest_version, record_version, version_id

log = structlog.get_logger(__name__)


def train_config(cfg: PolicyConfig, steps: int | None = None) -> TrainConfig:
    """The trainer's configuration from the policy settings section."""
    return TrainConfig(
        seed=cfg.seed,
        steps=steps or cfg.rl_steps_per_version,
        lr=cfg.rl_lr,
        advantage=cfg.advantage,
        replay=cfg.routing_replay,
        max_staleness=cfg.max_staleness,
        loss=LossConfig(level=cfg.loss_level, kl_coef=cfg.kl_coef),
        normalize=cfg.loss_normalize,
        feedback_weight=cfg.tool_feedback_weight,
        pack_tokens=cfg.pack_tokens,
        pack_rows=cfg.pack_rows,
        autocast=cfg.autocast,
    )


def _row_dict(row: PolicyVersionRow) -> dict[str, Any]:
    return {
        "version": row.version_id,
        "parent": row.parent_id,
        "step": row.step,
        "checkpoint": row.checkpoint_path,
        "metrics": row.metrics,
        "num_samples": row.num_samples,
        "created_at": row.created_at.isoformat(),
    }


def run_warmup(
    cfg: PolicyConfig, root: Path, engine: Engine, *, steps: int | None = None, eval_cfg: EvalConfig | None = None
) -> dict[str, Any]:
    """Train v0 by supervised warm-up, evaluate it, save and record it."""
    torch.set_num_threads(cfg.threads)
    if cfg.preset not in ("tiny", "small"):
        raise ValueError(f"warm-up trains a preset (tiny or small), not {cfg.preset!r}; load checkpoints directly")
    model, tokenizer, metrics = warmup(SFTConfig(preset=cfg.preset, seed=cfg.seed, steps=steps or cfg.sft_steps))
    metrics.update(evaluate(model, tokenizer, eval_cfg))
    path = save_checkpoint(model, tokenizer, root / version_id(0))
    row = record_version(engine, version=version_id(0), parent=None, step=0, checkpoint_path=path, metrics=metrics)
    log.info("policy.version", version=row.version_id, keep_rate=metrics.get("eval/keep_rate"))
    return _row_dict(row)


def run_rl_versions(
    cfg: PolicyConfig,
    root: Path,
    engine: Engine,
    *,
    versions: int = 1,
    steps: int | None = None,
    eval_cfg: EvalConfig | None = None,
) -> list[dict[str, Any]]:
    """Train ``versions`` successive versions by offline RL from the latest one."""
    torch.set_num_threads(cfg.threads)
    parent = latest_version(engine)
    if parent is None:
        raise RuntimeError("no policy version yet; run `undertow policy warmup` first")
    out: list[dict[str, Any]] = []
    for _ in range(versions):
        number = (version_number(parent.version_id) or 0) + 1
        model, tokenizer = load_checkpoint(parent.checkpoint_path)
        place(model, train_device(cfg.device))
        if world()[1] > 1 and cfg.parallel == "fsdp":
            shard(model)
        tcfg = train_config(cfg, steps)
        tcfg = replace(tcfg, seed=cfg.seed * 7919 + number)
        state_dir = root / "state" / version_id(number)
        summary = train_offline(model, tokenizer, tcfg, state_dir=state_dir, version=number, start_step=0)
        whole = unsharded_copy(model)  # rank 0 only: evaluation and the checkpoint need whole tensors
        row_dict: dict[str, Any] | None = None
        if whole is not None:
            whole = on_cpu(whole)
            summary.update(evaluate(whole, tokenizer, eval_cfg))
            path = save_checkpoint(whole, tokenizer, root / version_id(number))
            row = record_version(
                engine,
                version=version_id(number),
                parent=parent.version_id,
                step=parent.step + int(summary["train/steps"]),
                checkpoint_path=path,
                metrics=summary,
                num_samples=int(summary.get("batch/rollouts", 0) * summary["train/steps"]),
                staleness_mean=0.0,
                staleness_max=0,
            )
            shutil.rmtree(state_dir, ignore_errors=True)
            log.info("policy.version", version=row.version_id, keep_rate=summary.get("eval/keep_rate"))
            row_dict = _row_dict(row)
        row_dict = broadcast(row_dict)  # also the barrier: the next version loads rank 0's checkpoint
        assert row_dict is not None
        out.append(row_dict)
        parent = _version_row(engine, row_dict["version"])
    return out


def _version_row(engine: Engine, version: str) -> PolicyVersionRow:
    with Session(engine) as db:
        row = db.get(PolicyVersionRow, version)
        if row is None:
            raise RuntimeError(f"policy version {version} was recorded but is not in the database")
        db.expunge(row)
        return row
