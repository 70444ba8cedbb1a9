"""Agent sessions as training trajectories: the stored turns of one session joined into windows.

The gateway stores each chat request of an agent session as its own row (``S.t{n}``, with
``extra.turn = {session_id: S, index: n, group?}``): the prompt ids the engine rendered, the
tokens it generated with their logprobs, and the experts it routed. Turn ``n + 1``'s prompt is
turn ``n``'s prompt and generation followed by the tool results and user messages in between,
so the session is one token sequence, and :func:`session_trajectories` rebuilds it:

- **one trajectory per session**: turns in index order are appended while the next turn's prompt
  extends the sequence so far token for token; the new prompt tokens (the ``<|im_end|>`` framing,
  tool outputs, user nudges) go in as context and the turn's generated tokens as trained tokens;
- **masks**: only generated tokens are trained (``loss_mask``); system, user and tool tokens are
  masked, and their served logprob is NaN;
- **per-turn logprobs**: each generated token keeps the logprob its own turn was served with, so
  the importance ratio of every token is against the policy that sampled it;
- **routing replay across turns**: the window's experts are those of its last turn (which routed
  the whole prefix), with each turn's own generated positions overwritten by the experts that
  turn was served with; a window where a turn has no experts, or a shape that does not fit,
  trains without replay;
- **windows**: when a turn does not extend the sequence (a self-summary replaced the history, or
  the client or the template re-rendered it as other tokens), a new window starts at that turn's
  own prompt; a turn longer than ``max_tokens`` (a joined window is as long as its last turn) is
  dropped and counted;
- **reward**: every window of a session is credited with the session's final reward (the reward
  of its last rewarded turn), so a summary is trained by the outcome it led to;
- **turns**: each token records the turn that generated it (``token_turns``), and each turn the
  execution feedback its tools reported (``turn_feedback``, read from the next turn's conversation
  by :func:`policy.feedback.tool_feedback`), for the trainer's turn-level credit;
- **groups**: the session's ``turn.group`` (sessions run on one task and compared) is the
  rollouts' ``group_id``, so GRPO normalises over whole sessions; a session without one is a
  single sample, trained against a running baseline keyed by ``context``.

Rows that are not turns of an agent session (single requests, or sessions sent whole) go through
:func:`policy.rollouts.rollouts_from_sessions` unchanged.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policy.feedback import tool_feedback
from policy.rollouts import Rollout, rollouts_from_sessions, version_number


@dataclass
class _Turn:
    index: int
    row_id: str
    prompt: list[int]
    generated: list[int]
    mask: list[bool]
    logprobs: list[float]
    experts: np.ndarray | None
    reward: float | None
    version: int | None
    occurred_at: Any
    text: str | None = None
    """The conversation text the turn was prompted with (where the previous turn's tool results are)."""


@dataclass
class _Window:
    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[_Turn] = field(default_factory=list)
    token_turns: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


@dataclass
class TrajectoryStats:
    """What :func:`session_trajectories` built and left out."""

    sessions: int = 0
    turns: int = 0
    windows: int = 0
    windows_dropped: int = 0
    """Turns longer than ``max_tokens``."""
    windows_without_replay: int = 0


def turn_of(row: object) -> dict[str, Any] | None:
    """``extra.turn`` of a stored row (None for a row that is not an agent-session turn)."""
    turn = (getattr(row, "extra", None) or {}).get("turn")
    if isinstance(turn, dict) and turn.get("session_id") is not None and isinstance(turn.get("index"), int):
        return turn
    return None


def _turn(row: object, reward: float | None) -> _Turn:
    from ingest.arrays import npy_load, unpack_floats, unpack_ids

    generated: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    for seg in getattr(row, "segments", []):
        ids = [int(t) for t in unpack_ids(seg.token_ids)]
        trained = seg.role == "assistant"
        lps = unpack_floats(seg.logprobs).tolist() if trained and seg.logprobs else []
        generated += ids
        mask += [trained] * len(ids)
        logprobs += lps if len(lps) == len(ids) else [float("nan")] * len(ids)
    raw = getattr(row, "routed_experts", None)
    experts = npy_load(raw) if raw else None
    return _Turn(
        index=int((turn_of(row) or {}).get("index", 0)),
        row_id=str(getattr(row, "session_id", "")),
        prompt=[int(t) for t in unpack_ids(getattr(row, "prompt_token_ids", None))],
        generated=generated,
        mask=mask,
        logprobs=logprobs,
        experts=experts if experts is not None and experts.ndim == 3 else None,
        reward=reward,
        version=version_number(getattr(row, "policy_version", None)),
        occurred_at=getattr(row, "occurred_at", None),
        text=getattr(row, "prompt_text", None),
    )


def _replay(window: _Window) -> np.ndarray | None:
    """Experts for the window's sequence: the last turn's, each turn's generated span its own."""
    total = len(window.tokens) - 1
    last = window.turns[-1]
    if last.experts is None or last.experts.shape[0] != len(last.prompt) + len(last.generated) - 1:
        return None
    if len(last.prompt) + len(last.generated) != len(window.tokens):
        return None
    out = last.experts.copy()
    for turn in window.turns[:-1]:
        span = len(turn.prompt) + len(turn.generated) - 1
        if turn.experts is None or turn.experts.shape != (span, *out.shape[1:]):
            return None
        start = max(0, len(turn.prompt) - 1)
        out[start:span] = turn.experts[start:span]
    return out if out.shape[0] == total else None


def join_turns(turns: Sequence[_Turn], max_tokens: int) -> tuple[list[_Window], int]:
    """Windows of one session's turns (in index order) and the number of turns dropped as too long."""
    windows: list[_Window] = []
    dropped = 0
    current: _Window | None = None
    for turn in turns:
        if not turn.prompt or not turn.generated:
            continue
        sequence = current.tokens if current is not None else []
        size = len(turn.prompt) + len(turn.generated)
        if size > max_tokens:
            dropped += 1
            current = None
            continue
        if current is not None and turn.prompt[: len(sequence)] == sequence:
            context = turn.prompt[len(sequence) :]
            current.completion += context + turn.generated
            current.mask += [False] * len(context) + turn.mask
            current.logprobs += [float("nan")] * len(context) + turn.logprobs
            current.turns.append(turn)
            current.token_turns += [-1] * len(context) + [turn.index] * len(turn.generated)
            continue
        current = _Window(
            list(turn.prompt),
            list(turn.generated),
            list(turn.mask),
            list(turn.logprobs),
            [turn],
            [turn.index] * len(turn.generated),
        )
        windows.append(current)
    return [w for w in windows if any(w.mask)], dropped


def session_trajectories(
    rows: Sequence[object],
    reward_fn: Callable[[object], float | None],
    *,
    max_tokens: int,
    summary_token_id: int | None = None,
) -> tuple[list[Rollout], TrajectoryStats]:
    """Rollouts of stored rows (segments loaded): agent sessions joined into trajectories (see the
    module docs), every other row through :func:`policy.rollouts.rollouts_from_sessions`.

    A session whose turns have no reward yet is skipped. Every rollout's ``session_id`` is the
    agent session's id (several windows of one session share it)."""
    stats = TrajectoryStats()
    sessions: dict[str, list[object]] = defaultdict(list)
    plain: list[object] = []
    for row in rows:
        turn = turn_of(row)
        if turn is None:
            plain.append(row)
        else:
            sessions[str(turn["session_id"])].append(row)
    out, lost = rollouts_from_sessions(plain, reward_fn, max_tokens=max_tokens, summary_token_id=summary_token_id)
    stats.windows_dropped += lost
    for session_id in sorted(sessions):
        members = sessions[session_id]
        turns = sorted((_turn(r, reward_fn(r)) for r in members), key=lambda t: (t.index, t.row_id))
        rewarded = [t for t in turns if t.reward is not None and np.isfinite(t.reward)]
        if not rewarded:
            continue
        reward = float(rewarded[-1].reward)  # type: ignore[arg-type]
        feedback = {
            t.index: score for t, nxt in itertools.pairwise(turns) if (score := tool_feedback(nxt.text)) is not None
        }
        windows, dropped = join_turns(turns, max_tokens)
        stats.windows_dropped += dropped
        if not windows:
            continue
        stats.sessions += 1
        stats.turns += sum(len(w.turns) for w in windows)
        group = next((str(t["group"]) for r in members if (t := turn_of(r)) and t.get("group")), None)
        first = members[0]
        versions = [t.version for w in windows for t in w.turns if t.version is not None]
        for w in windows:
            replay = _replay(w)
            stats.windows += 1
            stats.windows_without_replay += replay is None
            out.append(
                Rollout(
                    prompt_ids=w.prompt,
                    completion_ids=w.completion,
                    reward=reward,
                    served_logprobs=np.asarray(w.logprobs, dtype=np.float64),
                    routed_experts=replay,
                    loss_mask=w.mask,
                    group_id=group,
                    context=group or str(getattr(first, "model", "")),
                    policy_version=min(versions) if versions else None,
                    session_id=session_id,
                    occurred_at=w.turns[0].occurred_at,
                    info={"turns": float(len(w.turns))},
                    token_turns=np.asarray(w.token_turns, dtype=np.int64),
                    turn_feedback=feedback,
                )
            )
    return out, stats
