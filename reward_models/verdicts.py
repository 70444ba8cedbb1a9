"""Execution feedback in a stored conversation: the verdict reports an agent's tools answered with.

An agent's tools (``run_tests`` in the demo's harness; a CI job or a test runner elsewhere) answer
with a report of how the code they ran did, and that answer is in the next turn's prompt, so the
gateway stores it with the turn (``prompt_text``: one ``role: content`` line per message). A
**verdict report** is a tool result that is a JSON object of at most :data:`MAX_REPORT_CHARS`
characters with a boolean ``passed``; ``kept`` (the stricter bar: passes and is what a user keeps)
is optional and defaults to ``passed`` (a body that fails is never kept, whatever the report says);
a report whose ``kept`` is not a boolean is not read. Anything else (a test log, an error line, a
file) is not a verdict.

- :func:`parse_report` reads one tool result.
- :func:`tool_reports` lists the reports of a conversation, in order, each with its line.
- :func:`last_report` is the newest one: for an agent whose ``submit()`` submits the last body it
  tested, the verdict of what the session is about to submit.

The reward models read :func:`last_report` as features (:mod:`reward_models.text_model`); the
trainer's turn-level credit reads the reports that answer each turn (:mod:`policy.feedback`).
"""

from __future__ import annotations

import json
from typing import NamedTuple

MAX_REPORT_CHARS = 4096
"""A tool result longer than this is not read as a verdict (a test log, a file)."""
TOOL_PREFIX = "tool: "
"""How a tool result starts in the stored conversation text."""


class Verdict(NamedTuple):
    """One verdict report: whether the code passed, and whether it met the stricter bar."""

    passed: bool
    kept: bool


def parse_report(text: str) -> Verdict | None:
    """The verdict of one tool result, or None when it is not a verdict report."""
    text = text.strip()
    if not text.startswith("{") or len(text) > MAX_REPORT_CHARS:
        return None
    try:
        report = json.loads(text)
    except ValueError:
        return None
    if not isinstance(report, dict) or not isinstance(report.get("passed"), bool):
        return None
    passed = report["passed"]
    kept = report.get("kept", passed)
    if not isinstance(kept, bool):
        return None
    return Verdict(passed, passed and kept)


def _line_verdict(line: str) -> Verdict | None:
    """The verdict of one line of a stored conversation when it is a tool result that is a verdict report."""
    return parse_report(line[len(TOOL_PREFIX) :]) if line.startswith(TOOL_PREFIX) else None


def tool_reports(prompt_text: str | None) -> list[tuple[int, Verdict]]:
    """Every verdict report of a stored conversation text with its line number, oldest first."""
    if not prompt_text or TOOL_PREFIX not in prompt_text:
        return []
    lines = enumerate(prompt_text.split("\n"))
    return [(i, verdict) for i, line in lines if (verdict := _line_verdict(line)) is not None]


def last_report(prompt_text: str | None) -> Verdict | None:
    """The newest verdict report of a stored conversation text, if any (read from the end)."""
    if not prompt_text or TOOL_PREFIX not in prompt_text:
        return None
    return next((v for line in reversed(prompt_text.split("\n")) if (v := _line_verdict(line)) is not None), None)
