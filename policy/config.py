"""Configuration sections owned by the policy layer."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field


class WeightsConfig(BaseModel):
    """The versioned weight store: snapshots, deltas, retention."""

    snapshot_every: int = Field(default=8, ge=1)
    """Write a full snapshot every N versions (bounds delta chains); the others are deltas only."""
    zstd_level: int = Field(default=16, ge=1, le=22)
    """zstd level of the delta streams (16, btopt parsing: within ~7% of the order-0 bound; 9 is ~15% off)."""
    serving_dtype: str | None = "bfloat16"
    """fp32/fp64 tensors are stored in this dtype (the bits the fleet serves); None keeps the checkpoint's."""
    magnitude_classes: bool = False
    """Code changes of small-magnitude base elements apart: ~15% smaller deltas, ~3x slower decode."""
    retain_last: int = Field(default=4, ge=1)
    """Garbage collection keeps the newest N versions besides those replicas hold."""
    stale_write_s: float = Field(default=3600.0, gt=0)
    """An incomplete version directory (no manifest) older than this is a crashed write that GC removes."""
    signing_key: str = "keys/weights-signing.pem"
    """The trainer's Ed25519 key that signs every version's manifest (PEM; relative: under the home), created
    with mode 0600 on the first put or by ``undertow weights keygen``. Keep it off the store and the replicas."""
    public_key: str = "keys/weights-signing.pub"
    """Public keys (PEM blocks; relative: under the home) a replica verifies manifests with: it applies only
    versions signed by one of them. Creating the signing key appends its public key here; during a key
    rotation the file holds the old and the new key."""


class PolicyConfig(BaseModel):
    """The policy model, RL trainer and weight store (filled in by the policy package)."""

    preset: str = "tiny"
    """Model preset: ``tiny``, ``small`` or a local Hugging Face MoE checkpoint directory."""
    weights_url: str = "weights"
    """Weight store location: a path under the Undertow home, or any fsspec URL."""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    """Snapshots, deltas and retention of the weight store."""
    checkpoints_dir: str = "policy"
    """Where the trainer writes version checkpoints and its resumable state (relative: under the home)."""
    seed: int = 0
    """Seed of the warm-up and of offline RL (same seed, same weights, bit for bit on CPU)."""
    sft_steps: int = Field(default=400, ge=1)
    """Optimizer steps of the supervised warm-up that produces v0."""
    rl_steps_per_version: int = Field(default=4, ge=1)
    """Optimizer steps between two policy versions."""
    rl_max_epochs: float = Field(default=0.0, ge=0)
    """Production updates take at most this many passes over their rewarded groups (fewer steps when data
    is short); 0: always ``rl_steps_per_version`` steps, cycling over the data as often as that needs."""
    rl_lr: float = Field(default=3e-4, gt=0)
    """AdamW learning rate of the RL update."""
    advantage: str = "grpo"
    """Advantage estimator: ``grpo``, ``grpo_batch`` (group mean, the batch's std), ``reinforce`` (group mean
    or running baseline) or ``rloo``."""
    loss_level: str = "token"
    """Policy-gradient ratio level: ``token`` (PPO/GRPO) or ``sequence`` (GSPO)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL to the reference policy in production updates (0: off; each step then also runs
    the reference forward)."""
    kl_reference: Literal["base", "parent"] = "base"
    """The KL's reference: ``base``, the first recorded version (v0: it bounds the drift over many
    updates); ``parent``, the version the update starts from (a trust region within one update)."""
    tool_feedback_weight: float = Field(default=1.0, ge=0)
    """Turn-level credit for grouped agent sessions (:mod:`policy.feedback`): a turn is credited with the
    session's reward plus this times the verdict its tools reported (1 kept, 0.2 only passed); 0: off."""
    loss_normalize: Literal["token", "session"] = "session"
    """How the loss averages over a batch: ``session`` (each session's token mean, then the mean over
    sessions: an agent session that failed through many turns weighs no more than one that succeeded
    in one) or ``token`` (every token the same)."""
    routing_replay: bool = True
    """Replay the served routed experts in the training forward."""
    max_staleness: int = Field(default=4, ge=0)
    """Rollouts more than this many versions behind the trained policy are dropped and counted."""
    rl_lineage_only: bool = True
    """A production update trains only on sessions served by the version it starts from and that
    version's ancestors: a version the fleet rolled back (a failed canary, the demo's gate drill)
    served a policy off that line, and its answers are far off-policy (in a demo, the update that
    trained on the drill's answers measured a KL to v0 of 6.5, against at most 0.13 for the others).
    False: any version within ``max_staleness``."""
    threads: int = Field(default=1, ge=1)
    """torch CPU threads of the trainer (fixed, so runs are bit-reproducible)."""
    parallel: Literal["fsdp", "ddp"] = "fsdp"
    """Several trainer processes (torchrun): ``fsdp`` shards weights, grads and optimizer; ``ddp`` replicates."""
    pack_tokens: int = Field(default=0, ge=0)
    """Pack RL rollouts into rows of at most N tokens, one forward per row (faster); 0: one per forward, bit-exact."""
    pack_rows: int = Field(default=1, ge=1)
    """Packed rows per forward (with ``pack_tokens``): a batch of rows, one forward and backward for all."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs: ``auto`` is one GPU per process when CUDA is present (NCCL between
    processes), else the CPU (gloo)."""
    autocast: Literal["auto", "bf16", "off"] = "auto"
    """Mixed precision of the training forward: ``auto`` is bf16 autocast on CUDA and none on CPU."""


def resolve_store_url(url: str, home: Path) -> str:
    """The weight store location ``url`` (``PolicyConfig.weights_url``) as a URL or path: as it is when
    it has a scheme (``http://``, ``s3://``, ...) or is an absolute path, else relative to ``home`` (the
    Undertow home). The one place a configured store location is resolved; it imports no torch."""
    if "://" in url or Path(url).is_absolute():
        return url
    return str(home / url)
