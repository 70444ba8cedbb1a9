"""Turn-level credit from execution feedback (:mod:`policy.feedback`): reading verdicts back from a
stored conversation, hostile tool output, and the advantages each turn's tokens get."""

from __future__ import annotations

import json

import numpy as np
import pytest

from policy.agent import verdict_report
from policy.checker import CheckResult
from policy.feedback import tool_feedback, turn_advantages, verdict_score
from policy.rollouts import Rollout
from reward_models.verdicts import MAX_REPORT_CHARS

KEPT = verdict_report(CheckResult(passed=True, tests_passed=6, size=20, kept=True, reason="passed", tests=6))
PASSED = verdict_report(CheckResult(passed=True, tests_passed=6, size=90, kept=False, reason="body too long", tests=6))
FAILED = verdict_report(CheckResult(passed=False, tests_passed=1, size=20, kept=False, reason="failed 5 of 6", tests=6))


def _conversation(*tool_results: str, after: str = "") -> str:
    lines = [
        "system: Coding agent.",
        "user: Write the body of this function.",
        "# return x plus 1",
        "def f(x):",
        "assistant: ",
        'assistant calls run_tests({"code": "    return x\\n"})',
        f"tool: {FAILED}",  # an earlier turn's result: not the last turn's
        "assistant: ",
        'assistant calls run_tests({"code": "    return x + 1\\n"})',
        *(f"tool: {t}" for t in tool_results),
    ]
    return "\n".join(lines + ([after] if after else []))


def test_the_verdicts_answering_the_last_turn_are_its_feedback() -> None:
    assert tool_feedback(_conversation(KEPT)) == 1.0
    assert tool_feedback(_conversation(PASSED)) == pytest.approx(0.2)
    assert tool_feedback(_conversation(FAILED)) == 0.0
    assert tool_feedback(_conversation(FAILED, KEPT)) == 1.0  # several calls in one turn: the best
    # a summary request after the results does not hide them
    assert tool_feedback(_conversation(KEPT, after="user: Context full: summarise")) == 1.0
    # after a compaction the prompt ends with the summary: no tool answers it
    assert tool_feedback(_conversation(KEPT, after="assistant: <|summary|> tried 2")) is None
    assert tool_feedback(None) is None and tool_feedback("") is None
    assert tool_feedback("user: hello") is None


@pytest.mark.parametrize(
    "hostile",
    [
        "not json",
        "{broken",
        '{"passed": "yes", "kept": true}',  # not a boolean
        '{"passed": true, "kept": "no"}',
        '["passed", true]',
        '{"kept": true}',  # no verdict without "passed"
        json.dumps({"passed": True, "pad": "x" * MAX_REPORT_CHARS}),  # oversized: a log, not a verdict
        "error: arguments are not valid JSON",
        '{"passed": true' + "}" * 10,
    ],
)
def test_tool_output_that_is_not_a_verdict_is_no_feedback(hostile: str) -> None:
    assert verdict_score(hostile) is None
    assert tool_feedback(_conversation(hostile)) is None


def test_a_verdict_without_kept_counts_a_pass_as_kept() -> None:
    assert verdict_score('{"passed": true}') == 1.0 and verdict_score('{"passed": false}') == 0.0


def _window(session: str, group: str | None, reward: float, turns: list[int], feedback: dict[int, float]) -> Rollout:
    # two tokens per turn, one context token between turns
    token_turns: list[int] = []
    for k, t in enumerate(turns):
        token_turns += ([-1] if k else []) + [t, t]
    mask = [t >= 0 for t in token_turns]
    return Rollout(
        [1, 2],
        list(range(len(token_turns))),
        reward,
        loss_mask=mask,
        group_id=group,
        session_id=session,
        token_turns=np.asarray(token_turns),
        turn_feedback=feedback,
    )


def test_a_kept_attempt_is_credited_above_the_failed_ones_of_the_same_session() -> None:
    # session a: fails, fails, then a kept body submitted (reward 1); session b never gets there
    a = _window("a", "g", 1.0, [0, 1, 2, 3], {0: 0.0, 1: 0.0, 2: 1.0})
    b = _window("b", "g", 0.0, [0, 1, 2, 3], {0: 0.0, 1: 0.0, 2: 0.0})
    session_level = [0.7, -0.7]
    adv = turn_advantages([a, b], session_level, "grpo", 1.0)
    per_turn_a = {int(t): float(v) for t, v in zip(a.token_turns, adv[0], strict=True) if t >= 0}  # type: ignore[arg-type]
    per_turn_b = {int(t): float(v) for t, v in zip(b.token_turns, adv[1], strict=True) if t >= 0}  # type: ignore[arg-type]
    assert per_turn_a[2] > per_turn_a[0] == per_turn_a[1] == per_turn_a[3] > 0 > per_turn_b[0]
    assert len(set(per_turn_b.values())) == 1
    # context tokens carry nothing
    assert all(v == 0.0 for t, v in zip(a.token_turns, adv[0], strict=True) if t < 0)  # type: ignore[arg-type]
    # weight 0: the session-level advantages as they were
    assert turn_advantages([a, b], session_level, "grpo", 0.0) == session_level


def test_sessions_alone_and_plain_rollouts_keep_their_session_advantage() -> None:
    alone = _window("a", None, 1.0, [0, 1], {0: 1.0})
    lone_group = _window("c", "h", 1.0, [0, 1], {0: 1.0})  # the only session of its group in the batch
    plain = Rollout([1], [2, 3], 0.5, group_id="k", session_id="p")
    out = turn_advantages([alone, lone_group, plain], [0.3, 0.2, -0.1], "grpo", 1.0)
    assert out == [0.3, 0.2, -0.1]
