"""The MoE policy: Hugging Face Qwen3-MoE presets, checkpoints that transformers and vLLM load.

Contract (other layers rely on it):

- :data:`PRESETS`: ``tiny`` (about 1M parameters, trains on a laptop CPU in minutes),
  ``small`` (about 10M) and ``medium`` (about 110M, 8 experts of 1024x1024: a size where moving
  weights costs more than the round trips around it, for the deployment benchmark). All are
  ``Qwen3MoeForCausalLM`` (all layers sparse, top-2 routing).
- :func:`build_model` ``(preset, vocab_size, seed) -> Qwen3MoeForCausalLM``: fresh weights,
  deterministic for a seed, float32, eval mode (no dropout anywhere).
- :func:`save_checkpoint` ``(model, tokenizer, path)``: a Hugging Face directory
  (``model.safetensors``, ``config.json``, ``generation_config.json``, ``tokenizer.json``) that
  ``AutoModelForCausalLM.from_pretrained`` and ``vllm serve`` load without conversion. The write
  goes to a temporary sibling directory that is renamed into place, so a reader never sees half
  a checkpoint.
- :func:`load_checkpoint` ``(path) -> (model, tokenizer)``: any local Hugging Face MoE directory
  (Qwen3-MoE, Mixtral-style, ...) in float32 eval mode.

Attention runs in the ``eager`` implementation and the experts in transformers' ``eager`` loop:
both are batch-of-one deterministic on CPU, which :mod:`policy.forward` relies on.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

PRESETS_REVISION = 2
"""Bumped whenever a preset changes (2: ``tiny`` takes 1024 positions, room for agent sessions); caches key on it."""

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        intermediate_size=256,
        max_position_embeddings=1024,
    ),
    "small": dict(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        intermediate_size=512,
        max_position_embeddings=1024,
    ),
    "medium": dict(
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=1024,
        intermediate_size=2048,
        max_position_embeddings=1024,
    ),
}
"""Architecture presets (keyword arguments of ``Qwen3MoeConfig``)."""

COMMON: dict[str, Any] = dict(
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    output_router_logits=False,
    router_aux_loss_coef=0.0,
    use_cache=True,
)


def preset_config(preset: str, vocab_size: int, **overrides: Any) -> Qwen3MoeConfig:
    """The ``Qwen3MoeConfig`` of a preset (special token ids follow :mod:`policy.tokenizer`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)} or pass a checkpoint directory")
    kwargs = {**COMMON, **PRESETS[preset], **overrides}
    config = Qwen3MoeConfig(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=1, **kwargs)
    config._attn_implementation = "eager"
    return config


def build_model(preset: str, vocab_size: int, seed: int) -> Qwen3MoeForCausalLM:
    """A freshly initialised policy of ``preset``; the same seed gives bit-identical weights."""
    config = preset_config(preset, vocab_size)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    model.float().eval()
    return model


def num_parameters(model: torch.nn.Module) -> int:
    """Total parameter count."""
    return sum(p.numel() for p in model.parameters())


def active_parameters(model: PreTrainedModel) -> int:
    """Parameters used per token: everything except the experts a token is not routed to."""
    cfg = model.config
    total = num_parameters(model)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
    top_k = getattr(cfg, "num_experts_per_tok", 0)
    if not experts:
        return total
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total - expert_params + expert_params * top_k // experts


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write a Hugging Face checkpoint directory atomically (temporary sibling, then rename)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if isinstance(end_of_turn, int) and model.generation_config is not None:
        # vLLM stops at every id in generation_config.json's eos_token_id: the end of a text and of a chat turn
        model.generation_config.eos_token_id = [int(tokenizer.eos_token_id), end_of_turn]
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def load_checkpoint(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any local Hugging Face MoE checkpoint directory as float32, eval mode, eager kernels, in
    memory of its own (not a mapping of the checkpoint's files)."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} is not a Hugging Face checkpoint (no config.json); train or download one first")
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation="eager")
    # Loaded tensors may map the safetensors file copy-on-write: the first in-place write (an
    # optimizer step, a serving engine's weight update) would then fault in every page it touches,
    # inside the engine's pause. Own the memory now, at load.
    model._apply(torch.clone)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(p)
    return model, tokenizer
