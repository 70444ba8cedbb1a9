"""Scored rollouts for the trainer: from the task family (offline) or from production sessions.

A :class:`Rollout` is what one RL sample needs: the context, the tokens to train with their
loss mask, the serving-time logprobs and routed experts (for off-policy correction and routing
replay), the reward, its candidate group (if any), a context key for the running baseline and
the policy version that produced it (for staleness).

- :func:`rollouts_from_tasks` samples groups on the task family with the current policy,
  scores them with :func:`policy.forward.score_tokens` (exactly what a CPU serving engine
  reports) and rewards them with the sandboxed checker.
- :func:`rollouts_from_sessions` turns stored ``session.completed`` rows into rollouts (split at
  self-summaries, see :mod:`policy.windows`) with a reward mapping passed in by the caller
  (the scheduler wires the reward models' scoring API here).
- :func:`filter_stale` drops rollouts older than the maximum staleness and counts them, and, given
  the trained version's lineage, those served by a version off it (one the fleet rolled back).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policy.checker import CheckResult, check_many
from policy.evaluate import decode_body
from policy.forward import sample_batch, score_tokens
from policy.sft import prompt_ids
from policy.tasks import Task
from policy.windows import Segment, split_windows

REWARD_KEPT = 1.0
REWARD_PASSED = 0.2


@dataclass
class Rollout:
    """One scored sample ready for the update."""

    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    served_logprobs: np.ndarray | None = None
    """float per completion token (NaN where unknown); None: treat as on-policy."""
    routed_experts: np.ndarray | None = None
    """``[len(prompt) + len(completion) - 1, layers, top_k]`` as served, for routing replay."""
    loss_mask: list[bool] | None = None
    """Which completion tokens are trained (None: all)."""
    group_id: str | None = None
    context: str = ""
    policy_version: int | None = None
    session_id: str | None = None
    occurred_at: datetime | None = None
    info: dict[str, float] = field(default_factory=dict)
    token_turns: np.ndarray | None = None
    """Per completion token, the index of the agent turn that generated it (-1 for context tokens);
    None for a rollout that is not an agent session's window."""
    turn_feedback: dict[int, float] | None = None
    """Execution feedback of the session's turns, by turn index (see :mod:`policy.feedback`): what
    the tools a turn called reported about it, for turn-level credit."""

    @property
    def mask(self) -> list[bool]:
        """The loss mask with the default applied."""
        return self.loss_mask if self.loss_mask is not None else [True] * len(self.completion_ids)


def task_reward(result: CheckResult) -> float:
    """Reward on the task family: 1 when kept (passes, concise), 0.2 when it only passes, else 0."""
    if result.kept:
        return REWARD_KEPT
    return REWARD_PASSED if result.passed else 0.0


def rollouts_from_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    *,
    group_size: int,
    temperature: float,
    max_tokens: int,
    seed: int,
    version: int,
) -> list[Rollout]:
    """Sample ``group_size`` completions per task, score them, reward them with the checker."""
    eos = int(tokenizer.eos_token_id)
    prompts = [prompt_ids(tokenizer, t) for t in tasks for _ in range(group_size)]
    sampled = sample_batch(
        model,
        prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop_token_ids=[eos],
        pad_token_id=int(tokenizer.pad_token_id),
    )
    owners = [t for t in tasks for _ in range(group_size)]
    bodies = [decode_body(tokenizer, tokens) for tokens, _ in sampled]
    results = check_many(list(zip(owners, bodies, strict=True)))
    out = []
    for i, (task, prompt, (tokens, _), result) in enumerate(zip(owners, prompts, sampled, results, strict=True)):
        scored = score_tokens(model, prompt + tokens, prompt_len=len(prompt)) if tokens else None
        out.append(
            Rollout(
                prompt_ids=prompt,
                completion_ids=tokens,
                reward=task_reward(result),
                served_logprobs=None if scored is None else scored.logprobs.astype(np.float64),
                routed_experts=None if scored is None else scored.routed_experts,
                group_id=f"{task.task_id}/{seed}/{i // group_size}",
                context=task.task_id,
                policy_version=version,
                info={"kept": float(result.kept), "passed": float(result.passed), "size": float(result.size)},
            )
        )
    return [r for r in out if r.completion_ids]


def version_number(version_id: str | None) -> int | None:
    """The integer of a version id like ``v0007`` or ``7`` (None when it has none)."""
    if version_id is None:
        return None
    match = re.search(r"(\d+)$", version_id)
    return int(match.group(1)) if match else None


@dataclass
class StalenessStats:
    """What :func:`filter_stale` kept and dropped."""

    kept: int = 0
    dropped: int = 0
    unknown: int = 0
    off_lineage: int = 0
    """Of ``dropped``: rollouts served by a version that is not the trained one or an ancestor of it."""
    mean: float | None = None
    max: int | None = None


def filter_stale(
    rollouts: Sequence[Rollout], current: int, max_staleness: int, *, lineage: set[int] | None = None
) -> tuple[list[Rollout], StalenessStats]:
    """Keep rollouts at most ``max_staleness`` versions behind ``current``; unknown versions drop too.

    With ``lineage`` (the version numbers of ``current`` and its ancestors), rollouts of any other
    version drop as well: a sibling the fleet rolled back (a failed canary, the demo's gate drill)
    served a policy the trained one does not descend from, so its samples are far off-policy however
    recent they are."""
    kept, ages = [], []
    stats = StalenessStats()
    for r in rollouts:
        if r.policy_version is None:
            stats.unknown += 1
            stats.dropped += 1
            continue
        age = current - r.policy_version
        if age < 0 or age > max_staleness:
            stats.dropped += 1
            continue
        if lineage is not None and r.policy_version not in lineage:
            stats.off_lineage += 1
            stats.dropped += 1
            continue
        kept.append(r)
        ages.append(age)
    stats.kept = len(kept)
    if ages:
        stats.mean = float(np.mean(ages))
        stats.max = int(max(ages))
    return kept, stats


def rollouts_from_sessions(
    sessions: Sequence[object],
    reward_fn: Callable[[object], float | None],
    *,
    max_tokens: int,
    summary_token_id: int | None,
) -> tuple[list[Rollout], int]:
    """Rollouts from ``ingest.tables.SessionRow`` objects (segments loaded); returns (rollouts, windows dropped).

    Sessions whose reward is not known yet (``reward_fn`` returns None) or that carry no token
    ids are skipped. Routed experts are kept only when the session is a single window (they
    index the whole served sequence).
    """
    from ingest.arrays import npy_load, unpack_floats, unpack_ids

    out: list[Rollout] = []
    dropped = 0
    for s in sessions:
        reward = reward_fn(s)
        if reward is None:
            continue
        prompt = [int(t) for t in unpack_ids(getattr(s, "prompt_token_ids", None))]
        segments = []
        for seg in getattr(s, "segments", []):
            ids = [int(t) for t in unpack_ids(seg.token_ids)]
            lps = unpack_floats(seg.logprobs).tolist() if seg.logprobs else None
            segments.append(Segment(role=seg.role, token_ids=ids, logprobs=lps, text=seg.text))
        if not prompt or not any(seg.role == "assistant" and seg.token_ids for seg in segments):
            continue
        windows, lost = split_windows(prompt, segments, max_tokens=max_tokens, summary_token_id=summary_token_id)
        dropped += lost
        raw_experts = getattr(s, "routed_experts", None)
        experts = npy_load(raw_experts) if raw_experts and len(windows) == 1 and lost == 0 else None
        for w in windows:
            total = len(w.prompt_ids) + len(w.completion_ids)
            replay = experts if experts is not None and experts.ndim == 3 and experts.shape[0] == total - 1 else None
            out.append(
                Rollout(
                    prompt_ids=w.prompt_ids,
                    completion_ids=w.completion_ids,
                    reward=float(reward),
                    served_logprobs=np.asarray(w.served_logprobs, dtype=np.float64),
                    routed_experts=replay,
                    loss_mask=w.loss_mask,
                    group_id=getattr(s, "group_id", None),
                    context=str(getattr(s, "model", "")),
                    policy_version=version_number(getattr(s, "policy_version", None)),
                    session_id=str(getattr(s, "session_id", "")),
                    occurred_at=getattr(s, "occurred_at", None),
                )
            )
    return out, dropped
