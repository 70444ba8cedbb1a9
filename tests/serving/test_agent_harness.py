"""The agent harness (:mod:`policy.agent`) against the real gateway in front of a CPU engine, with
telemetry through the embedded broker, and its tools against the checker's real sandbox."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from serving_helpers import consume, telemetry_gateway

from policy.agent import (
    NUDGE,
    SUMMARY_REQUEST,
    AgentSession,
    context_chars,
    dispatch,
    gateway_client,
    reward_of,
    run_session,
    task_message,
)
from policy.tasks import Task, all_tasks
from policy.windows import SUMMARY_TEXT

MODEL = "undertow-policy"
SYSTEM = "Coding agent."
SHORT_TOOLS = [{"type": "function", "function": {"name": name}} for name in ("run_tests", "submit")]
"""Tool specs that fit the tiny test model's 512-token context (the harness runs them all the same)."""
TASK: Task = next(t for t in all_tasks() if t.tier == 1 and t.wrong)


class Stack:
    def __init__(self, url: str, bootstrap: str, topic: str) -> None:
        self.url, self.bootstrap, self.topic = url, bootstrap, topic


@pytest.fixture(scope="module")
def stack(one_engine, broker, tmp_path_factory) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    with telemetry_gateway(one_engine.url, broker.bootstrap, tmp_path_factory.mktemp("spool"), "agent") as (
        url,
        topic,
        _gateway,
    ):
        yield Stack(url, broker.bootstrap, topic)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call-{uuid.uuid4().hex[:8]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _message(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def test_a_session_runs_turns_through_the_gateway_summarises_and_hits_the_turn_limit(stack: Stack, versions) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    session = f"harness-{uuid.uuid4().hex[:8]}"
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_message(TASK)}]
    with gateway_client(stack.url, timeout_s=60) as client:
        result = run_session(
            client,
            TASK,
            model=MODEL,
            session_id=session,
            max_turns=3,
            context_budget_chars=context_chars(base) + 20,  # one turn plus its nudge is over it
            max_tokens=8,
            summary_max_tokens=8,
            seed=5,
            system_prompt=SYSTEM,
            tools=SHORT_TOOLS,
        )
    assert result.error is None, result.error
    assert (result.ended, result.reward, result.turns, result.submitted_code) == ("turn_limit", 0.0, 3, None)
    assert result.summaries >= 1 and result.requests == result.turns + result.summaries
    marked = [m for m in result.messages if m["role"] == "assistant" and m["content"].startswith(SUMMARY_TEXT)]
    assert result.messages[:2] == base and len(marked) == 1 and result.messages[2] is marked[0]

    # the gateway served every request of the session, each linked as its own turn
    events: list[dict[str, Any]] = []
    for _ in range(10):
        events = [
            e
            for e in consume(stack.bootstrap, stack.topic, 10_000, timeout_s=3)
            if (e.get("payload") or {}).get("turn", {}).get("session_id") == session
        ]
        if len(events) >= result.requests:
            break
    assert len(events) == result.requests
    ids = [e["session_id"] for e in events]
    assert len(set(ids)) == len(ids), f"every turn has its own id, so ingest stores each: {ids}"
    assert sorted(e["payload"]["turn"]["index"] for e in events) == list(range(result.requests))
    asks = [e for e in events if e["payload"]["prompt"]["messages"][-1]["content"] == SUMMARY_REQUEST]
    assert len(asks) == result.summaries

    # after a compaction the model sees system + task + the summary, opening with the summary token
    summary_id = AutoTokenizer.from_pretrained(versions.checkpoint).convert_tokens_to_ids(SUMMARY_TEXT)
    first_ask = min(e["payload"]["turn"]["index"] for e in asks)
    later = [e for e in events if e["payload"]["turn"]["index"] > first_ask]
    assert later and all(summary_id in e["payload"]["prompt"]["token_ids"] for e in later)
    for e in later:
        sent = e["payload"]["prompt"]["messages"]
        assert sent[:2] == base and sent[2]["role"] == "assistant" and sent[2]["content"].startswith(SUMMARY_TEXT)
    first = [e for e in events if e["payload"]["turn"]["index"] < first_ask]
    assert first and all(summary_id not in e["payload"]["prompt"]["token_ids"] for e in first)
    assert all(summary_id in e["payload"]["prompt"]["token_ids"] for e in asks), "the request names the marker"
    assert any(m.get("content") == NUDGE for e in events for m in e["payload"]["prompt"]["messages"])


def test_malformed_arguments_and_unknown_tools_are_answered_not_raised() -> None:
    calls = [
        _call("run_tests", '{"code": "return x'),  # cut-off JSON
        _call("run_tests", '["return x"]'),
        _call("submit", '{"body": "return x"}'),  # no code and nothing tested: nothing to submit
        _call("rm_rf", '{"code": "return x"}'),
        _call("submit", '{"code": 5}'),
        _call("run_tests", "{}"),
    ]
    outcomes = dispatch(_message(*calls), TASK)
    assert [o.call_id for o in outcomes] == [c["id"] for c in calls]
    assert [o.ok for o in outcomes] == [False] * 6
    assert all(o.content.startswith("error: ") and o.verdict is None and not o.submitted for o in outcomes)
    assert "not valid JSON" in outcomes[0].content and "JSON object" in outcomes[1].content
    assert "nothing to submit" in outcomes[2].content and "unknown tool 'rm_rf'" in outcomes[3].content
    assert all('"code"' in o.content for o in outcomes[4:])
    assert dispatch({"role": "assistant", "content": "no tools"}, TASK) == []


@pytest.mark.usefixtures("sandbox")
def test_run_tests_answers_with_the_sandbox_verdict() -> None:
    good, bad = TASK.concise, TASK.wrong[0]
    outcomes = dispatch(
        _message(_call("run_tests", json.dumps({"code": good})), _call("run_tests", json.dumps({"code": bad}))), TASK
    )
    assert [o.ok for o in outcomes] == [True, True] and not any(o.submitted for o in outcomes)
    passed, failed = (json.loads(o.content) for o in outcomes)
    assert passed["passed"] and passed["kept"] and passed["tests_passed"] == passed["tests"] == len(TASK.tests)
    assert not failed["passed"] and failed["tests_passed"] < failed["tests"] and failed["reason"].startswith("failed")


@pytest.mark.usefixtures("sandbox")
def test_submit_ends_with_the_reward_of_the_verdict() -> None:
    after = _call("run_tests", json.dumps({"code": TASK.wrong[0]}))
    outcomes = dispatch(_message(_call("submit", json.dumps({"code": TASK.concise})), after), TASK)
    assert len(outcomes) == 1, "nothing runs after a submit"
    [done] = outcomes
    assert done.ok and done.submitted and done.code == TASK.concise
    assert done.verdict is not None and done.verdict.kept and reward_of(done.verdict) == 1.0
    [wrong] = dispatch(_message(_call("submit", json.dumps({"code": TASK.wrong[0]}))), TASK)
    assert wrong.submitted and wrong.verdict is not None and reward_of(wrong.verdict) == 0.0


@pytest.mark.usefixtures("sandbox")
def test_submit_without_code_submits_the_last_body_tested() -> None:
    session = AgentSession(TASK, max_turns=4)
    session.request()
    session.observe(_message(_call("run_tests", json.dumps({"code": TASK.wrong[0]}))))
    session.request()
    session.observe(_message(_call("run_tests", json.dumps({"code": TASK.concise}))))
    assert session.result.workspace == TASK.concise and not session.finished
    session.request()
    session.observe(_message(_call("submit", "{}")))
    assert session.finished and session.result.ended == "submitted"
    assert session.result.submitted_code == TASK.concise and session.result.reward == 1.0
    # within one message, a run_tests before the submit sets what it submits
    [tested, done] = dispatch(
        _message(_call("run_tests", json.dumps({"code": TASK.wrong[0]})), _call("submit", "")),
        TASK,
        workspace=TASK.concise,
    )
    assert tested.code == done.code == TASK.wrong[0] and done.submitted and done.verdict is not None
    assert not done.verdict.passed
