"""Learning: from the warm-up policy v0, offline RL on the task family raises held-out pass-and-keep.

The margin asserted is 10 points of held-out pass-and-keep rate (tier-balanced held-out tasks,
4 samples each at temperature 1), reached within a few CPU minutes over several versions.
"""

from __future__ import annotations

import time

import pytest
import torch

from policy.evaluate import EvalConfig, evaluate
from policy.sft import SFTConfig, warmup
from policy.trainer import TrainConfig, train_offline

MARGIN = 0.10
VERSIONS = 3
STEPS_PER_VERSION = 4


@pytest.mark.slow
def test_rl_raises_heldout_pass_and_keep_over_versions() -> None:
    torch.set_num_threads(2)
    model, tokenizer, _ = warmup(SFTConfig(seed=0))
    cfg = EvalConfig(samples_per_task=4, per_tier=16)
    rates = [evaluate(model, tokenizer, cfg)["eval/keep_rate"]]
    assert 0.05 < rates[0] < 0.8, f"v0 should be competent but improvable, got {rates[0]:.3f}"
    start = time.monotonic()
    for version in range(1, VERSIONS + 1):
        train_offline(model, tokenizer, TrainConfig(steps=STEPS_PER_VERSION, seed=100 + version))
        rates.append(evaluate(model, tokenizer, cfg)["eval/keep_rate"])
    minutes = (time.monotonic() - start) / 60
    assert rates[-1] - rates[0] >= MARGIN, f"held-out keep rates by version: {rates} ({minutes:.1f} min of RL)"
