"""Verdict reports in a stored conversation (:mod:`reward_models.verdicts`): what counts as one, which
is the newest, and hostile tool output that must not."""

from __future__ import annotations

import json

from reward_models.verdicts import MAX_REPORT_CHARS, Verdict, last_report, parse_report, tool_reports


def _report(**fields: object) -> str:
    return json.dumps(fields)


def test_a_report_is_a_json_object_with_a_boolean_passed() -> None:
    assert parse_report(_report(passed=True, kept=True, tests=6)) == Verdict(True, True)
    assert parse_report(_report(passed=True, kept=False)) == Verdict(True, False)
    assert parse_report(_report(passed=True)) == Verdict(True, True)  # kept defaults to passed
    assert parse_report("  " + _report(passed=False) + "\n") == Verdict(False, False)
    # A body that fails is never kept, whatever the report claims.
    assert parse_report(_report(passed=False, kept=True)) == Verdict(False, False)


def test_anything_else_is_not_a_verdict() -> None:
    for text in [
        "",
        "passed",
        "error: nothing to submit",
        "{not json",
        "[true]",
        _report(passed="yes"),
        _report(passed=1),
        _report(ok=True),
        _report(passed=True, kept="no"),
        _report(passed=True, log="x" * MAX_REPORT_CHARS),  # a log, not a verdict
        json.dumps([{"passed": True}]),
        "\x00\ufffd{",
    ]:
        assert parse_report(text) is None, text


def test_the_newest_report_of_a_conversation_and_only_tool_lines() -> None:
    conversation = "\n".join(
        [
            "system: Coding agent.",
            "user: " + _report(passed=True),  # a user pasting JSON is not a tool's verdict
            "assistant calls run_tests(...)",
            "tool: " + _report(passed=False),
            "assistant calls run_tests(...)",
            "tool: " + _report(passed=True, kept=False),
            "assistant calls run_tests(...)",
            "tool: error: the sandbox timed out",  # the newest tool line, not a verdict
            "user: Call run_tests(code) or submit().",
        ]
    )
    assert [v for _, v in tool_reports(conversation)] == [Verdict(False, False), Verdict(True, False)]
    assert [i for i, _ in tool_reports(conversation)] == [3, 5]
    assert last_report(conversation) == Verdict(True, False)
    for empty in [None, "", "user: hello", "tool: plain text"]:
        assert last_report(empty) is None
        assert tool_reports(empty) == []
