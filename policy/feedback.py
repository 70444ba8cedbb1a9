"""Turn-level credit for agent sessions from execution feedback: what the tools said about each turn.

An agent session's reward comes at its end, from what the user did with what it submitted. Every
turn before it carries that one number, so a session that wrote two failing bodies and then a good
one credits the failing ones as much as the good one, and the policy learns slowly what a good body
is. But the harness already told the model, turn by turn, how each body did: ``run_tests`` answers
with the sandbox's verdict, and that answer is in the next turn's prompt, in telemetry.

- :func:`tool_feedback` reads it back from a stored turn's conversation text (``prompt_text``, the
  ``role: content`` lines the gateway stores): the ``tool`` results after the last assistant turn
  answer that turn's calls. A result that is a verdict report (a JSON object with a boolean
  ``passed``; ``kept`` and the counts optional: :func:`policy.agent.verdict_report` writes one) is
  scored by the task family's reward (:func:`policy.rollouts.task_reward`: 1 kept, 0.2 only
  passed, else 0); any other result is not feedback. A turn whose calls report several verdicts
  takes the best.
- :func:`turn_advantages` credits each turn of the sessions of a group with the session's reward
  plus ``weight`` times its feedback, and normalises over all turns of the group (GRPO over turns:
  every turn of every session on the task is one sample). The tokens of a turn get its turn's
  advantage. Turns without feedback (a summary, the final ``submit``) carry the session's reward
  alone. Sessions without a group, and rollouts that are not agent windows, keep the session-level
  advantage.

The feedback is the harness's own observation, not a user's: the session's reward still decides
which sessions win, and ``weight`` 0 turns the credit off (``policy.tool_feedback_weight``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from policy.advantages import compute_advantages
from policy.checker import CheckResult
from policy.rollouts import Rollout, task_reward
from reward_models.verdicts import Verdict, parse_report, tool_reports


def verdict_score(text: str) -> float | None:
    """The task reward of one tool result when it is a verdict report (:func:`reward_models.verdicts.parse_report`),
    else None."""
    verdict = parse_report(text)
    return None if verdict is None else _reward(verdict)


def _reward(verdict: Verdict) -> float:
    return task_reward(CheckResult(passed=verdict.passed, tests_passed=0, size=0, kept=verdict.kept))


def tool_feedback(prompt_text: str | None) -> float | None:
    """The best verdict among the tool results that answer the last assistant turn of a stored
    conversation text (None when there is none)."""
    if not prompt_text:
        return None
    lines = prompt_text.split("\n")
    last = max((i for i, line in enumerate(lines) if line.startswith("assistant")), default=None)
    if last is None:
        return None
    scores = [_reward(verdict) for i, verdict in tool_reports(prompt_text) if i > last]
    return max(scores) if scores else None


def turn_advantages(
    batch: Sequence[Rollout],
    session_level: Sequence[float],
    method: str,
    weight: float,
) -> list[float | np.ndarray]:
    """Per-token advantages for the agent windows of grouped sessions (see the module docs), the
    ``session_level`` advantage for every other rollout."""
    out: list[float | np.ndarray] = list(session_level)
    if weight == 0:
        return out
    keys = [r.session_id if r.session_id else f"#{i}" for i, r in enumerate(batch)]
    sessions_of: dict[str, set[str]] = {}
    for key, r in zip(keys, batch, strict=True):
        if r.group_id is not None:
            sessions_of.setdefault(r.group_id, set()).add(key)
    turned = [
        i
        for i, r in enumerate(batch)
        if r.token_turns is not None and r.group_id is not None and len(sessions_of[r.group_id]) >= 2
    ]
    if not turned:
        return out
    samples: dict[tuple[str, int], tuple[float, str]] = {}
    for i in turned:
        r = batch[i]
        feedback = r.turn_feedback or {}
        for turn in sorted({int(t) for t in np.asarray(r.token_turns) if t >= 0}):
            samples[(keys[i], turn)] = (r.reward + weight * feedback.get(turn, 0.0), str(r.group_id))
    order = sorted(samples)
    values = compute_advantages(
        [samples[k][0] for k in order], [samples[k][1] for k in order], ["" for _ in order], method=method
    )
    by_turn = dict(zip(order, values, strict=True))
    for i in turned:
        turns = np.asarray(batch[i].token_turns)
        out[i] = np.array([by_turn.get((keys[i], int(t)), 0.0) if t >= 0 else 0.0 for t in turns], dtype=np.float64)
    return out
