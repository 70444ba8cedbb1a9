"""``benchmarks/rm_features.py``: the within-group pairwise accuracy it reports counts exactly the pairs
GRPO can use, and a smoke run scores every input on held-out candidates only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import rm_features


def test_pairwise_accuracy_counts_only_pairs_of_one_group_with_different_rewards() -> None:
    groups = ["a", "a", "a", "b", "b", "c"]
    rewards = [1.0, 0.2, 0.0, 0.2, 0.2, 1.0]  # b's pair ties in reward: not a pair; c is alone
    right, pairs = rm_features.pairwise_accuracy(groups, rewards, [3.0, 2.0, 1.0, 0.0, 9.0, -5.0])
    assert (right, pairs) == (1.0, 3)
    assert rm_features.pairwise_accuracy(groups, rewards, [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]) == (0.0, 3)
    tied = rm_features.pairwise_accuracy(groups, rewards, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # one tie: half right
    assert tied == (pytest.approx(0.5 / 3 + 2 / 3), 3)
    value, none = rm_features.pairwise_accuracy(["a", "b"], [1.0, 0.0], [0.0, 1.0])  # across groups: no pair
    assert math.isnan(value) and none == 0


def test_quick_run_scores_every_input_on_held_out_templates(tmp_path: Path) -> None:
    out = rm_features.run(rm_features.parse_args(["--quick", "--home", str(tmp_path)]))
    assert set(out["inputs"]) == {"logprob", "logprob_length", "hidden_state", "text_model"}
    assert out["held_out"]["candidates"] > 0 and out["train"]["candidates"] > out["held_out"]["candidates"]
    for metrics in out["inputs"].values():
        for value in metrics.values():
            assert math.isnan(value) or 0.0 <= value <= 1.0
    assert set(out["chosen_c"].values()) <= set(rm_features.C_GRID)
    assert "never trained on" in out["conditions"]["tasks"]


def test_a_v0_that_passes_nothing_is_a_clear_error(tmp_path: Path) -> None:
    args = rm_features.parse_args(["--home", str(tmp_path), "--sft-steps", "2", "--train-tasks", "3"])
    args.heldout_tasks = 2
    with pytest.raises(SystemExit, match="stronger v0"):
        rm_features.run(args)
