"""The agent harness: one coding task solved as a multi-turn tool-calling session through the gateway.

The protocol, one session:

- The conversation opens with :data:`SYSTEM_PROMPT` and the task (:func:`task_message`); every
  request carries the two tools of :data:`TOOLS` in OpenAI's format. ``run_tests(code)`` runs a
  body under the task's signature against its hidden tests in the checker's sandbox
  (:func:`policy.checker.check`, the path the reward uses) and answers with the verdict; the body
  becomes the session's workspace. ``submit(code)`` checks a body the same way and ends the
  session with the reward the task family defines (:func:`policy.rollouts.task_reward`: 1 kept,
  0.2 only passed, else 0); ``submit()`` without ``code`` submits the workspace (the last body
  ``run_tests`` checked), as an agent in a repository submits its working tree.
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

:class:`AgentSession` is the protocol without a transport (next request, observe the reply);
:func:`run_session` drives it through the gateway, :mod:`policy.agent_eval` in process, in batches.

Every request carries its number in the session as the turn index (``x-turn-index``), so the
turns of all windows are stored under one session id with distinct turn ids (the gateway's own
count, the assistant messages in the conversation, starts again after a compaction). ``group``
names the group of sessions run on the same task (``x-session-group``), which the trainer
compares with each other (GRPO over sessions).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from policy.checker import CheckResult, Limits, check
from policy.tasks import Task
from policy.windows import SUMMARY_TEXT

# The gateway's headers (serving.turns defines them; the policy layer does not import serving).
SESSION_HEADER = "x-session-id"
TURN_HEADER = "x-turn-index"
GROUP_HEADER = "x-session-group"
SYSTEM_PROMPT = (
    "You are a coding agent. Write the body of the function the user asks for. "
    "run_tests(code) runs it on hidden tests; submit() submits the last body tested "
    "(or submit(code) that body) and ends the session."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": required},
        },
    }
    for name, description, required in (
        ("run_tests", "Run the function body on the hidden tests.", ["code"]),
        ("submit", "Submit the function body (default: the last one tested); ends the session.", []),
    )
]
NUDGE = "Call run_tests(code) or submit()."
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
    workspace: str | None = None
    """The last body ``run_tests`` checked (what ``submit()`` submits)."""
    submitted_code: str | None = None
    verdict: CheckResult | None = None
    reward: float = 0.0
    ended: Ended = "turn_limit"
    error: str | None = None
    group: str | None = None
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


def _code_of(arguments: Any, *, required: bool = True) -> str | None:
    """The ``code`` argument (None when absent and not ``required``), or ValueError saying what is
    wrong with the arguments."""
    if arguments in (None, "") and not required:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"arguments are not valid JSON ({exc})") from None
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be a JSON object")
    code = arguments.get("code")
    if code is None and not required:
        return None
    if not isinstance(code, str):
        raise ValueError('arguments need a string "code"')
    return code


def verdict_report(verdict: CheckResult) -> str:
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


Checker = Callable[[Task, str], CheckResult]
"""Checks one body for a task (default: :func:`policy.checker.check`, the reward's sandbox)."""


def tool_codes(message: Any) -> list[str]:
    """The ``code`` of every well-formed ``run_tests``/``submit`` call of a message (to check them in
    one batch; a ``submit()`` of the workspace names no code: it was checked when tested)."""
    out = []
    for raw in _plain(message).get("tool_calls") or []:
        fn = _plain(_plain(raw).get("function") or {})
        if fn.get("name") in ("run_tests", "submit"):
            try:
                code = _code_of(fn.get("arguments", "{}"), required=fn.get("name") == "run_tests")
            except ValueError:
                continue
            if code is not None:
                out.append(code)
    return out


def dispatch(
    message: Any,
    task: Task,
    *,
    limits: Limits | None = None,
    checker: Checker | None = None,
    workspace: str | None = None,
) -> list[ToolOutcome]:
    """Run the tool calls of one assistant message, in order, up to and including a ``submit``.

    ``workspace`` is the last body ``run_tests`` checked before this message (what ``submit()``
    without code submits); each ``run_tests`` of the message replaces it. Never raises for what the
    model wrote (bad JSON, a missing ``code``, ``submit()`` with nothing tested, an unknown tool: an
    error outcome); :class:`policy.checker.SandboxUnavailable` does propagate (no reward without it).
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
            given = _code_of(fn.get("arguments", "{}"), required=name == "run_tests")
        except ValueError as exc:
            out.append(ToolOutcome(call_id, name, False, f"error: {exc}"))
            continue
        code = given if given is not None else workspace
        if code is None:
            out.append(ToolOutcome(call_id, name, False, "error: nothing to submit; call run_tests(code) first"))
            continue
        workspace = code if name == "run_tests" else workspace
        verdict = checker(task, code) if checker is not None else check(task, code, limits)
        if name == "submit":
            content = f"submitted: {verdict_report(verdict)}"
            out.append(ToolOutcome(call_id, name, True, content, verdict, submitted=True, code=code))
            break
        out.append(ToolOutcome(call_id, name, True, verdict_report(verdict), verdict, code=code))
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


def _chat(client: httpx.Client, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/v1/chat/completions", json=body, headers=headers)
    if resp.status_code != 200:
        raise GatewayError(f"{resp.status_code}: {resp.text[:500]}")
    data = resp.json()
    return dict(data["choices"][0]["message"])


class AgentSession:
    """One session's protocol without a transport (see the module docs).

    :meth:`request` gives the next chat request (``messages``, ``tool_choice``, ``max_tokens``; None
    once the session has ended), the caller sends it however it likes (through the gateway:
    :func:`run_session`; in process: :mod:`policy.agent_eval`) and hands the reply's assistant
    message (a dict with ``content`` and ``tool_calls``, or an SDK object) to :meth:`observe`.
    """

    def __init__(
        self,
        task: Task,
        *,
        session_id: str | None = None,
        max_turns: int = 8,
        context_budget_chars: int = 6000,
        max_tokens: int = 256,
        summary_max_tokens: int = 128,
        limits: Limits | None = None,
        system_prompt: str = SYSTEM_PROMPT,
        tool_choice: str = "auto",
        group: str | None = None,
        checker: Checker | None = None,
    ) -> None:
        self.task = task
        self.max_turns, self.budget = max_turns, context_budget_chars
        self.max_tokens, self.summary_max_tokens = max_tokens, summary_max_tokens
        self.limits, self.tool_choice, self.checker = limits, tool_choice, checker
        self.result = AgentResult(session_id=session_id or f"agent-{uuid.uuid4().hex[:12]}", group=group)
        self.base: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": task_message(task)},
        ]
        self.history = list(self.base)
        self.result.messages = self.history
        self.turns_in_window = 0
        self.pending: Literal["turn", "summary"] | None = None
        self.finished = False

    @property
    def turn_index(self) -> int:
        """The index of the request :meth:`request` gave last (its turn in telemetry)."""
        return self.result.requests - 1

    def request(self) -> dict[str, Any] | None:
        """The next request's ``messages``, ``tool_choice`` and ``max_tokens``; None when the session is over."""
        if self.finished or self.result.turns >= self.max_turns:
            self.finished = True
            return None
        self.result.requests += 1
        if self.turns_in_window and context_chars(self.history) > self.budget:
            self.pending = "summary"
            messages = [*self.history, {"role": "user", "content": SUMMARY_REQUEST}]
            return {"messages": messages, "tool_choice": "none", "max_tokens": self.summary_max_tokens}
        self.pending = "turn"
        return {"messages": list(self.history), "tool_choice": self.tool_choice, "max_tokens": self.max_tokens}

    def observe(self, message: Any) -> None:
        """Take the assistant's reply to the last request: compact on a summary, else run its tools."""
        reply = _plain(message)
        if self.pending is None:
            raise RuntimeError("observe() without a request() before it")
        pending, self.pending = self.pending, None
        if pending == "summary":
            text = str(reply.get("content") or "")
            marked = text if text.lstrip().startswith(SUMMARY_TEXT) else SUMMARY_TEXT + text
            self.result.summaries += 1
            self.history = [*self.base, {"role": "assistant", "content": marked}]
            self.result.messages = self.history
            self.turns_in_window = 0
            return
        self.result.turns += 1
        self.turns_in_window += 1
        assistant: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
        if reply.get("tool_calls"):
            assistant["tool_calls"] = [_plain(c) for c in reply["tool_calls"]]
        self.history.append(assistant)
        if not reply.get("tool_calls"):
            self.result.plain_replies += 1
            self.history.append({"role": "user", "content": NUDGE})
            return
        outcomes = dispatch(
            assistant, self.task, limits=self.limits, checker=self.checker, workspace=self.result.workspace
        )
        for outcome in outcomes:
            if outcome.name == "run_tests" and outcome.code is not None:
                self.result.workspace = outcome.code
            self.history.append({"role": "tool", "tool_call_id": outcome.call_id, "content": outcome.content})
            if outcome.ok:
                self.result.tool_calls_ok += 1
            else:
                self.result.tool_calls_malformed += 1
            if outcome.submitted and outcome.verdict is not None:
                self.result.submitted_code, self.result.verdict = outcome.code, outcome.verdict
                self.result.reward, self.result.ended = reward_of(outcome.verdict), "submitted"
                self.finished = True

    def fail(self, error: str) -> None:
        """End the session on a transport error (reward 0)."""
        self.result.ended, self.result.error, self.result.reward = "error", error, 0.0
        self.finished, self.pending = True, None


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
    group: str | None = None,
    tool_choice: str = "auto",
) -> AgentResult:
    """Run one agent session on ``task`` through the gateway ``client`` points at (see the module docs).

    ``client`` is an :class:`httpx.Client` on the gateway's root URL (:func:`gateway_client`).
    ``tools`` replaces the tool specs sent (shorter ones for a small context); the harness runs
    ``run_tests`` and ``submit`` whatever they say. ``seed`` is offset by the request's number.
    ``tool_choice`` is sent with every policy turn (``required``: the model must call a tool).
    """
    session = AgentSession(
        task,
        session_id=session_id,
        max_turns=max_turns,
        context_budget_chars=context_budget_chars,
        max_tokens=max_tokens,
        summary_max_tokens=summary_max_tokens,
        limits=limits,
        system_prompt=system_prompt,
        tool_choice=tool_choice,
        group=group,
    )
    common: dict[str, Any] = {"model": model, "tools": [dict(t) for t in tools]}
    if user is not None:
        common["user"] = user
    if temperature is not None:
        common["temperature"] = temperature
    try:
        while (ask := session.request()) is not None:
            body = {**common, **ask}
            if seed is not None:
                body["seed"] = seed + session.turn_index
            headers = {SESSION_HEADER: session.result.session_id, TURN_HEADER: str(session.turn_index)}
            if group is not None:
                headers[GROUP_HEADER] = group
            session.observe(_chat(client, headers, body))
    except (GatewayError, httpx.HTTPError) as exc:
        session.fail(str(exc))
    return session.result
