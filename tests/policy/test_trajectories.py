"""Stored agent-session turns joined into trajectories (:mod:`policy.trajectories`): masks, served
logprobs, windows where the history was replaced or would not fit, replay across turns, the final
reward for every window, groups, and rows that are not turns."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from ingest.arrays import npy_bytes, pack_floats, pack_ids
from policy.trainer import session_advantages
from policy.trajectories import session_trajectories

LAYERS, TOP_K = 2, 2


def _experts(n: int, fill: int) -> np.ndarray:
    return np.full((n, LAYERS, TOP_K), fill, dtype=np.int16)


def _row(
    session: str | None,
    index: int,
    prompt: list[int],
    generated: list[int],
    *,
    group: str | None = None,
    experts: np.ndarray | None = None,
    version: str = "v3",
    row_id: str | None = None,
) -> Any:
    turn = None if session is None else {"session_id": session, "index": index}
    if turn is not None and group is not None:
        turn["group"] = group
    lps = [-0.1 * (index + 1) - 0.001 * k for k in range(len(generated))]
    segment = SimpleNamespace(role="assistant", token_ids=pack_ids(generated), logprobs=pack_floats(lps), text="x")
    return SimpleNamespace(
        session_id=row_id or f"{session}.t{index}",
        extra={"turn": turn} if turn else {},
        prompt_token_ids=pack_ids(prompt),
        segments=[segment],
        routed_experts=npy_bytes(experts) if experts is not None else None,
        policy_version=version,
        model="m",
        group_id=None,
        occurred_at=index,
    )


def test_turns_that_extend_each_other_are_one_window_with_only_generated_tokens_trained() -> None:
    p0, g0 = [1, 2, 3], [10, 11]
    p1 = p0 + g0 + [4, 5]  # the tool's result and the next assistant opener
    g1 = [12, 13, 14]
    p2 = p1 + g1 + [6]
    g2 = [15]
    rows = [_row("S", 2, p2, g2), _row("S", 0, p0, g0), _row("S", 1, p1, g1)]  # stored in any order
    rollouts, stats = session_trajectories(rows, lambda r: 0.5, max_tokens=100)
    assert len(rollouts) == 1 and stats.turns == 3 and stats.windows == 1
    r = rollouts[0]
    assert r.prompt_ids == p0 and r.completion_ids == [*g0, 4, 5, *g1, 6, *g2]
    assert r.mask == [True, True, False, False, True, True, True, False, True]
    lps = r.served_logprobs
    assert lps is not None
    assert [round(x, 3) for x, m in zip(lps, r.mask, strict=True) if m] == [-0.1, -0.101, -0.2, -0.201, -0.202, -0.3]
    assert all(math.isnan(x) for x, m in zip(lps, r.mask, strict=True) if not m)
    assert r.session_id == "S" and r.reward == 0.5 and r.policy_version == 3 and r.info["turns"] == 3


def test_a_summary_or_a_re_rendered_history_starts_a_window_and_every_window_gets_the_final_reward() -> None:
    p0, g0 = [1, 2, 3], [10, 11]
    p1, g1 = [1, 2, 3, 99, 11, 4], [12]  # the history re-rendered with other tokens: not an extension
    p2, g2 = [1, 2, 3, 7, 8], [13]  # after a self-summary: system + task + the summary
    rewards = {"S.t0": 0.0, "S.t1": 0.1, "S.t2": 1.0}
    rows = [_row("S", 0, p0, g0), _row("S", 1, p1, g1), _row("S", 2, p2, g2)]
    rollouts, stats = session_trajectories(rows, lambda r: rewards[r.session_id], max_tokens=100)
    assert [r.prompt_ids for r in rollouts] == [p0, p1, p2] and stats.windows == 3
    assert {r.reward for r in rollouts} == {1.0}  # the session's last rewarded turn


def test_a_turn_longer_than_the_budget_is_dropped_and_counted() -> None:
    p0, g0 = [1] * 5, [2] * 3
    p1, g1 = p0 + g0 + [3], [4] * 3  # the joined window is as long as its last turn: 12 tokens
    rows = [_row("S", 0, p0, g0), _row("S", 1, p1, g1)]
    rollouts, stats = session_trajectories(rows, lambda r: 1.0, max_tokens=12)
    assert len(rollouts) == 1 and rollouts[0].info["turns"] == 2 and stats.windows_dropped == 0
    rollouts, stats = session_trajectories(rows, lambda r: 1.0, max_tokens=10)
    assert len(rollouts) == 1 and rollouts[0].completion_ids == g0 and stats.windows_dropped == 1


def test_replay_takes_each_turns_own_experts_on_its_generated_tokens() -> None:
    p0, g0 = [1, 2, 3], [10, 11]
    p1, g1 = p0 + g0 + [4], [12, 13]
    e0 = _experts(len(p0) + len(g0) - 1, 1)
    e1 = _experts(len(p1) + len(g1) - 1, 2)
    rows = [_row("S", 0, p0, g0, experts=e0), _row("S", 1, p1, g1, experts=e1)]
    (r,), stats = session_trajectories(rows, lambda r: 1.0, max_tokens=100)
    assert r.routed_experts is not None and stats.windows_without_replay == 0
    # positions 2..3 predicted turn 0's tokens (served by turn 0); the rest as turn 1 routed them
    assert r.routed_experts[:, 0, 0].tolist() == [2, 2, 1, 1, 2, 2, 2]
    rows = [_row("S", 0, p0, g0), _row("S", 1, p1, g1, experts=e1)]  # a turn without experts
    (r,), stats = session_trajectories(rows, lambda r: 1.0, max_tokens=100)
    assert r.routed_experts is None and stats.windows_without_replay == 1


def test_groups_of_sessions_share_an_advantage_per_session_and_unrewarded_sessions_are_skipped() -> None:
    rows = []
    for s in ("A", "B"):
        p0, g0 = [1, 2], [3]
        rows += [_row(s, 0, p0, g0, group="task"), _row(s, 1, [9, 9], [4], group="task")]  # two windows each
    rows.append(_row("C", 0, [1], [2]))
    rewards = {"A": 1.0, "B": 0.0}
    rollouts, stats = session_trajectories(rows, lambda r: rewards.get(r.extra["turn"]["session_id"]), max_tokens=100)
    assert stats.sessions == 2 and len(rollouts) == 4 and {r.group_id for r in rollouts} == {"task"}
    adv = session_advantages(rollouts, "grpo", None)
    by_session = {(r.session_id, a) for r, a in zip(rollouts, adv, strict=True)}
    assert len(by_session) == 2  # the windows of a session share one advantage
    assert sorted(round(a, 3) for _, a in by_session) == [-0.707, 0.707]  # two sessions, not four windows


def test_rows_that_are_not_turns_train_as_before() -> None:
    rows = [_row(None, 0, [1, 2], [3, 4], row_id="plain")]
    rollouts, stats = session_trajectories(rows, lambda r: 0.3, max_tokens=100)
    assert [r.session_id for r in rollouts] == ["plain"] and stats.sessions == 0 and rollouts[0].reward == 0.3
