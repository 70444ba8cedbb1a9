"""The warm-up corpus follows the mix it is given, per tier; the warm-up passes its configured mix on."""

from __future__ import annotations

import math

import pytest

from policy.sft import MIXES, SFTConfig, build_corpus, warmup
from policy.tasks import train_tasks

LESS_WRONG = {1: (0.45, 0.40, 0.15), 2: (0.35, 0.50, 0.15), 3: (0.30, 0.55, 0.15)}


@pytest.mark.parametrize("mixes", [MIXES, LESS_WRONG], ids=["default", "less-wrong"])
def test_the_corpus_follows_its_mix_in_every_tier(mixes: dict[int, tuple[float, float, float]]) -> None:
    tasks = train_tasks()
    corpus = build_corpus(tasks, seed=0, mixes=mixes)
    assert [t.task_id for t, _, _ in corpus] == [t.task_id for t in tasks]
    for tier, shares in mixes.items():
        kinds = [kind for task, _, kind in corpus if task.tier == tier]
        for kind, share in zip(("concise", "verbose", "wrong"), shares, strict=True):
            seen = kinds.count(kind) / len(kinds)
            tolerance = 4 * math.sqrt(share * (1 - share) / len(kinds))  # four binomial standard errors
            assert abs(seen - share) < tolerance, f"tier {tier}: {kind} {seen:.3f}, mix {share}"


def test_the_default_mix_is_policy_mixes() -> None:
    tasks = train_tasks()
    assert build_corpus(tasks, seed=3) == build_corpus(tasks, seed=3, mixes=MIXES)
    assert build_corpus(tasks, seed=3) != build_corpus(tasks, seed=3, mixes=LESS_WRONG)


def test_the_warmup_trains_on_the_mix_it_is_configured_with() -> None:
    _, _, default = warmup(SFTConfig(steps=1))
    _, _, less = warmup(SFTConfig(steps=1, mixes=LESS_WRONG))
    assert default["sft/frac_wrong"] > 0.25
    assert less["sft/frac_wrong"] < 0.2
    assert less["sft/frac_concise"] > default["sft/frac_concise"]
