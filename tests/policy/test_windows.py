"""Splitting long agent sessions at self-summary segments."""

from __future__ import annotations

import math

from policy.windows import Segment, split_windows

SUM = 2


def _session() -> list[Segment]:
    return [
        Segment("user", [10, 11]),
        Segment("assistant", [20, 21, 22], [-0.1, -0.2, -0.3]),
        Segment("tool", [30, 31]),
        Segment("assistant", [SUM, 40, 41], [-0.4, -0.5, -0.6]),  # self-summary
        Segment("user", [12]),
        Segment("assistant", [50, 51], [-0.7, -0.8]),
    ]


def test_split_at_summary_with_compacted_context() -> None:
    windows, dropped = split_windows([0, 1], _session(), max_tokens=64, summary_token_id=SUM)
    assert dropped == 0 and len(windows) == 2
    first, second = windows
    assert first.prompt_ids == [0, 1]
    assert first.completion_ids == [10, 11, 20, 21, 22, 30, 31, SUM, 40, 41]
    assert first.loss_mask == [False, False, True, True, True, False, False, True, True, True]
    assert second.prompt_ids == [0, 1, SUM, 40, 41]  # prompt + the summary, not the full history
    assert second.completion_ids == [12, 50, 51]
    assert second.served_logprobs[1:] == [-0.7, -0.8] and math.isnan(second.served_logprobs[0])


def test_oversized_window_dropped_and_counted() -> None:
    windows, dropped = split_windows([0, 1], _session(), max_tokens=9, summary_token_id=SUM)
    assert dropped == 1 and len(windows) == 1 and windows[0].completion_ids == [12, 50, 51]


def test_summary_found_by_text_and_no_summary_is_one_window() -> None:
    segs = [Segment("assistant", [7, 8], None, "<|summary|> so far"), Segment("assistant", [9], [-1.0])]
    windows, _ = split_windows([0], segs, max_tokens=32, summary_token_id=None)
    assert len(windows) == 2
    windows, _ = split_windows([0], [Segment("assistant", [5, 6], [-1.0])], max_tokens=32, summary_token_id=SUM)
    assert len(windows) == 1 and windows[0].loss_mask == [True, True]


def test_mismatched_logprobs_become_unknown_and_contextless_windows_vanish() -> None:
    segs = [Segment("assistant", [5, 6], [-1.0])]  # one logprob for two tokens
    windows, _ = split_windows([0], segs, max_tokens=32, summary_token_id=SUM)
    assert all(math.isnan(x) for x in windows[0].served_logprobs)
    only_user = [Segment("user", [5, 6])]
    assert split_windows([0], only_user, max_tokens=32, summary_token_id=SUM) == ([], 0)
