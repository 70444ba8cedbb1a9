"""Context windows: split a long agent session at its self-summary segments.

Agents compact their own context: when the conversation nears the window, the model writes a
self-summary (an assistant segment opening with ``<|summary|>``) and continues from the original
prompt plus that summary. The trainer mirrors it: a session becomes windows, each starting from
``prompt + previous summary`` and running up to and including the next summary, so every window
holds exactly what the model saw and wrote at that time. Each window is credited with the
session's outcome, so summaries are trained by the same reward as the code they led to.

Only assistant tokens are trained (``loss_mask``); user and tool tokens are context. A window
longer than ``max_tokens`` is dropped and counted (truncating it would train on a context the
model never saw). Windows are never merged across a summary: after compaction the model saw
only ``prompt + summary``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUMMARY_TEXT = "<|summary|>"


@dataclass
class Segment:
    """One session segment with its tokens (and serving logprobs for assistant segments)."""

    role: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    text: str | None = None


@dataclass
class Window:
    """A trainable slice: context ``prompt_ids``, then ``completion_ids`` with a loss mask."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    served_logprobs: list[float] = field(default_factory=list)
    """Serving logprob per completion token (NaN where unknown or not trained)."""


def is_summary(segment: Segment, summary_token_id: int | None) -> bool:
    """An assistant segment that opens with the summary token (by id or by text)."""
    if segment.role != "assistant":
        return False
    if summary_token_id is not None and segment.token_ids[:1] == [summary_token_id]:
        return True
    return bool(segment.text and segment.text.lstrip().startswith(SUMMARY_TEXT))


def _append(window: Window, segment: Segment) -> None:
    n = len(segment.token_ids)
    trained = segment.role == "assistant"
    lps = segment.logprobs if trained and segment.logprobs is not None and len(segment.logprobs) == n else None
    window.completion_ids += segment.token_ids
    window.loss_mask += [trained] * n
    window.served_logprobs += list(lps) if lps is not None else [float("nan")] * n


def split_windows(
    prompt_ids: list[int], segments: list[Segment], *, max_tokens: int, summary_token_id: int | None
) -> tuple[list[Window], int]:
    """Windows of a session and the number dropped for not fitting ``max_tokens``."""
    pieces: list[list[Segment]] = [[]]
    for seg in segments:
        pieces[-1].append(seg)
        if is_summary(seg, summary_token_id):
            pieces.append([])
    if not pieces[-1]:
        pieces.pop()
    windows: list[Window] = []
    dropped = 0
    context = list(prompt_ids)
    for piece in pieces:
        size = len(context) + sum(len(s.token_ids) for s in piece)
        if size <= max_tokens:
            window = Window(prompt_ids=list(context))
            for seg in piece:
                _append(window, seg)
            windows.append(window)
        else:
            dropped += 1
        if is_summary(piece[-1], summary_token_id):
            context = list(prompt_ids) + list(piece[-1].token_ids)
    return [w for w in windows if any(w.loss_mask)], dropped
