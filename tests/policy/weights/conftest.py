"""Fixtures for the weight store: a store in a temporary directory (signing with a key of the session)
and real tiny MoE checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from policy.config import WeightsConfig
from policy.weights import SigningKey, WeightStore


def train_checkpoints(root: Path, steps: int, lr: float, seed: int = 0) -> list[Path]:
    """Consecutive Hugging Face checkpoints of a tiny Qwen3-MoE after real AdamW steps (fp32 master weights)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    paths = []
    for step in range(steps + 1):
        if step:
            tokens = torch.randint(0, 256, (2, 32))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        path = root / f"step{step}"
        model.save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three consecutive real checkpoints (initial weights and two AdamW steps at lr 1e-5)."""
    torch.set_num_threads(1)
    return train_checkpoints(tmp_path_factory.mktemp("ckpt"), steps=2, lr=1e-5)


@pytest.fixture(scope="session")
def signer(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    """The trainer's key of the session's stores; its public key file is ``signer.public_path``."""
    keys = tmp_path_factory.mktemp("keys")
    return SigningKey(keys / "signing.pem", keys / "signing.pub")


@pytest.fixture
def store(tmp_path: Path, signer: SigningKey) -> WeightStore:
    """An empty store (full snapshot every 3 versions)."""
    return WeightStore(tmp_path / "weights", WeightsConfig(snapshot_every=3), signer=signer)


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """CLI tests bind structlog to the runner's stderr, which closes; later logs must not write there."""
    yield
    structlog.reset_defaults()
