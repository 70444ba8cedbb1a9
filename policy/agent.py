"""The agent harness: one coding task solved as a multi-turn tool-calling session through the gateway.

The protocol, one session:

- The conversation opens with :data:`SYSTEM_PROMPT` and the task (:func:`task_message`); every
  request carries the two tools of :data:`TOOLS` in OpenAI's format. ``run_tests(code)`` runs a
  body under the task's signature against its hidden tests in the checker's sandbox
  (:func:`policy.checker.check`, the path the reward uses) and answers with the verdict;
  ``submit(code)`` checks it the same way and ends the session with the reward the task family
  defines (:func:`policy.rollouts.task_reward`: 1 kept, 0.2 only passed, else 0).
- Each policy turn is one ``POST /v1/chat/completions`` with the ``x-session-id`` header, so the
  gateway links the turns of the session in telemetry. Tool calls are run in order and answered
  as ``tool`` messages. Malformed arguments (not a JSON object with a string ``code``) and
  unknown tools are answered with an error as the tool's result, counted, and the session goes
  on; a reply without tool calls gets a short user nudge (:data:`NUDGE`).
- Context budget: before a policy turn, when the conversation's text exceeds
  ``context_budget_chars`` (and the model has taken a turn since the last compaction), the
  harness asks for a self-summary (:data:`SUMMARY_REQUEST`, a user message, no tools) and
  restarts from system prompt + task + the summary as an assistant message opening with
  ``<|summary|>`` (:data:`policy.windows.SUMMARY_TEXT`, the marker the trainer's windows split
  at; the harness adds it when the model did not write it).
- The session ends on ``submit`` (``ended="submitted"``), after ``max_turns`` policy turns
  (``"turn_limit"``, reward 0), or on a gateway error (``"error"``, reward 0).

The gateway numbers a turn by the assistant messages already in the conversation, so after a
compaction the numbers start again and would collide with the earlier window's turn ids (ingest
keeps the first event per id). Window ``k > 0`` is therefore sent as session ``{id}.w{k}``
(:attr:`AgentResult.window_ids`); ``distinct_window_ids=False`` sends one id throughout.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from policy.checker import CheckResult, Limits, check
from policy.tasks import Task
from policy.windows import SUMMARY_TEXT

SESSION_HEADER = "x-session-id"
SYSTEM_PROMPT = (
    "You are a coding agent. Write the body of the function the user asks for. "
    "run_tests(code) runs it on hidden tests; submit(code) ends the session."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
    for name, description in (
        ("run_tests", "Run the function body on the hidden tests."),
        ("submit", "Submit the function body; ends the session."),
    )
]
NUDGE = "Call run_tests(code) or submit(code)."
SUMMARY_REQUEST = f"Context full: summarise the task and your progress, starting with {SUMMARY_TEXT}"
Ended = Literal["submitted", "turn_limit", "error"]


def task_message(task: Task) -> str:
    """The user message that states the task: its spec and signature."""
    return f"Write the body of this function.\n{task.prompt}"


@dataclass
class ToolOutcome:
    """One tool call and its answer."""

    call_id: str
    name: str
    ok: bool
    """False for malformed arguments or an unknown tool (the error is the ``content``)."""
    content: str
    """What goes back to the model as the ``tool`` message."""
    verdict: CheckResult | None = None
    submitted: bool = False
    code: str | None = None


@dataclass
class AgentResult:
    """How one session went."""

    session_id: str
    turns: int = 0
    """Policy turns (chat requests that were not summary requests)."""
    requests: int = 0
    """Chat requests sent: policy turns plus summary turns."""
    tool_calls_ok: int = 0
    tool_calls_malformed: int = 0
    """Calls with malformed arguments or to an unknown tool."""
    plain_replies: int = 0
    """Replies without a tool call (answered with :data:`NUDGE`)."""
    summaries: int = 0
    submitted_code: str | None = None
    verdict: CheckResult | None = None
    reward: float = 0.0
    ended: Ended = "turn_limit"
    error: str | None = None
    window_ids: list[str] = field(default_factory=list)
    """The session id each context window was sent under (the first is :attr:`session_id`)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation of the last window, as last sent or answered."""


def reward_of(verdict: CheckResult) -> float:
    """The task family's reward for a verdict (the reward code's own function)."""
    from policy.rollouts import task_reward  # the trainer's module is heavy; only a submit needs it

    return task_reward(verdict)


def _plain(message: Any) -> dict[str, Any]:
    """An assistant message as a plain dict (a dict as is, or an SDK object's dump)."""
    if isinstance(message, Mapping):
        return dict(message)
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return dict(dump(exclude_none=True))
    raise TypeError(f"not an assistant message: {type(message).__name__}")


def _code_of(arguments: Any) -> str:
    """The ``code`` argument, or ValueError saying what is wrong with the arguments."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"arguments are not valid JSON ({exc})") from None
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be a JSON object")
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ValueError('arguments need a string "code"')
    return code


def _report(verdict: CheckResult) -> str:
    return json.dumps(
        {
            "passed": verdict.passed,
            "kept": verdict.kept,
            "tests_passed": verdict.tests_passed,
            "tests": verdict.tests,
            "size": verdict.size,
            "reason": verdict.reason,
        }
    )


def dispatch(message: Any, task: Task, *, limits: Limits | None = None) -> list[ToolOutcome]:
    """Run the tool calls of one assistant message, in order, up to and including a ``submit``.

    Never raises for what the model wrote (bad JSON, a missing ``code``, an unknown tool: an error
    outcome); :class:`policy.checker.SandboxUnavailable` does propagate (no reward without it).
    """
    calls = _plain(message).get("tool_calls") or []
    out: list[ToolOutcome] = []
    for raw in calls:
        call = _plain(raw)
        fn = _plain(call.get("function") or {})
        call_id, name = str(call.get("id") or f"call-{uuid.uuid4().hex[:12]}"), str(fn.get("name") or "")
        if name not in ("run_tests", "submit"):
            known = ", ".join(t["function"]["name"] for t in TOOLS)
            out.append(ToolOutcome(call_id, name, False, f"error: unknown tool {name!r}; the tools are {known}"))
            continue
        try:
            code = _code_of(fn.get("arguments", "{}"))
        except ValueError as exc:
            out.append(ToolOutcome(call_id, name, False, f"error: {exc}"))
            continue
        verdict = check(task, code, limits)
        if name == "submit":
            content = f"submitted: {_report(verdict)}"
            out.append(ToolOutcome(call_id, name, True, content, verdict, submitted=True, code=code))
            break
        out.append(ToolOutcome(call_id, name, True, _report(verdict), verdict, code=code))
    return out


def context_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """The conversation's size as the budget measures it: contents plus tool-call arguments."""
    total = 0
    for message in messages:
        total += len(str(message.get("content") or ""))
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            total += len(str(fn.get("name", ""))) + len(str(fn.get("arguments", "")))
    return total


def gateway_client(url: str, api_key: str | None = None, timeout_s: float = 120.0) -> httpx.Client:
    """An HTTP client for :func:`run_session`: the gateway's root URL and its key, if it has keys."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)


class GatewayError(RuntimeError):
    """The gateway refused a request (its OpenAI-shaped error is the message)."""


def _chat(client: httpx.Client, session: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/v1/chat/completions", json=body, headers={SESSION_HEADER: session})
    if resp.status_code != 200:
        raise GatewayError(f"{resp.status_code}: {resp.text[:500]}")
    data = resp.json()
    return dict(data["choices"][0]["message"])


def run_session(
    client: httpx.Client,
    task: Task,
    *,
    model: str,
    session_id: str | None = None,
    user: str | None = None,
    max_turns: int = 8,
    context_budget_chars: int = 6000,
    max_tokens: int = 256,
    summary_max_tokens: int = 128,
    temperature: float | None = None,
    seed: int | None = None,
    limits: Limits | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    tools: Sequence[Mapping[str, Any]] = TOOLS,
    distinct_window_ids: bool = True,
) -> AgentResult:
    """Run one agent session on ``task`` through the gateway ``client`` points at (see the module docs).

    ``client`` is an :class:`httpx.Client` on the gateway's root URL (:func:`gateway_client`).
    ``tools`` replaces the tool specs sent (shorter ones for a small context); the harness runs
    ``run_tests`` and ``submit`` whatever they say. ``seed`` is offset by the request's number.
    """
    session = session_id or f"agent-{uuid.uuid4().hex[:12]}"
    result = AgentResult(session_id=session, window_ids=[session])
    base: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": task_message(task)},
    ]
    history = list(base)
    turns_in_window = 0
    common: dict[str, Any] = {"model": model, "tools": [dict(t) for t in tools]}
    if user is not None:
        common["user"] = user
    if temperature is not None:
        common["temperature"] = temperature

    def ask(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {**common, "messages": messages, **extra}
        if seed is not None:
            body["seed"] = seed + result.requests
        result.requests += 1
        return _chat(client, result.window_ids[-1], body)

    try:
        while result.turns < max_turns:
            if turns_in_window and context_chars(history) > context_budget_chars:
                reply = ask(
                    [*history, {"role": "user", "content": SUMMARY_REQUEST}],
                    tool_choice="none",
                    max_tokens=summary_max_tokens,
                )
                text = str(reply.get("content") or "")
                marked = text if text.lstrip().startswith(SUMMARY_TEXT) else SUMMARY_TEXT + text
                result.summaries += 1
                history = [*base, {"role": "assistant", "content": marked}]
                turns_in_window = 0
                if distinct_window_ids:
                    result.window_ids.append(f"{session}.w{result.summaries}")
            reply = ask(history, tool_choice="auto", max_tokens=max_tokens)
            result.turns += 1
            turns_in_window += 1
            assistant: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
            if reply.get("tool_calls"):
                assistant["tool_calls"] = reply["tool_calls"]
            history.append(assistant)
            if not reply.get("tool_calls"):
                result.plain_replies += 1
                history.append({"role": "user", "content": NUDGE})
                continue
            for outcome in dispatch(assistant, task, limits=limits):
                history.append({"role": "tool", "tool_call_id": outcome.call_id, "content": outcome.content})
                if outcome.ok:
                    result.tool_calls_ok += 1
                else:
                    result.tool_calls_malformed += 1
                if outcome.submitted and outcome.verdict is not None:
                    result.submitted_code, result.verdict = outcome.code, outcome.verdict
                    result.reward, result.ended = reward_of(outcome.verdict), "submitted"
            if result.ended == "submitted":
                break
    except (GatewayError, httpx.HTTPError) as exc:
        result.ended, result.error, result.reward = "error", str(exc), 0.0
    result.messages = history
    return result
