"""Policy fixtures: one thread, the presets' tokenizer and a fresh tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen3_moe import Qwen3MoeForCausalLM

from policy.model import build_model
from policy.tokenizer import default_tokenizer


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return default_tokenizer()


@pytest.fixture
def tiny(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeForCausalLM:
    return build_model("tiny", len(tokenizer), seed=0)
