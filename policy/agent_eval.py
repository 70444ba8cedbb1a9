"""The agent's held-out task success: multi-turn sessions with tools, run in process and in batches.

The same protocol as the harness (:class:`policy.agent.AgentSession`: tools, the context budget,
self-summaries, the turn limit), driven without HTTP: every round, the next request of each
session still running is rendered with the checkpoint's chat template (what the serving engine
renders), all are sampled in one batch (:func:`policy.forward.sample_batch`, stopping at
``<|im_end|>``), each reply is read as the ``hermes`` parser reads it
(:func:`policy.chat_template.read_tool_calls`), and the round's ``run_tests``/``submit`` bodies are
checked in one sandbox batch (:func:`policy.checker.check_many`) before the sessions take their
replies. A session succeeds when it submits a body that is kept (passes every test and is concise).

Reported (:func:`evaluate_agent`): ``agent/success`` (kept at submit), ``agent/pass`` (passed at
submit), ``agent/submitted``, ``agent/mean_turns`` (policy turns), ``agent/mean_requests`` (turns
plus summary turns: the turns telemetry stores), ``agent/summaries`` (sessions with one), and
``agent/sessions``, over the first ``tasks_per_tier`` tasks of each tier of the held-out set (tasks
of templates never trained on), ``samples_per_task`` sessions each.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policy.agent import AgentSession, tool_codes
from policy.chat_template import IM_END, read_tool_calls
from policy.checker import CheckResult, check_many
from policy.forward import sample_batch
from policy.tasks import Task, heldout_eval_set

AGENT_SYSTEM_PROMPT = "Coding agent. run_tests(code) checks a body; submit() ends with the last body tested."
"""The short system prompt the tiny presets' agent is trained and evaluated with (512-token context)."""
AGENT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("run_tests", "submit")
]
"""Tool specs cut to their names (each spec is rendered into every prompt)."""


@dataclass(frozen=True)
class AgentEvalConfig:
    """How the held-out agent sessions run."""

    tasks_per_tier: int = 16
    samples_per_task: int = 1
    max_turns: int = 4
    context_budget_chars: int = 520
    max_tokens: int = 64
    summary_max_tokens: int = 24
    temperature: float = 1.0
    seed: int = 4321
    batch_size: int = 64


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[int]:
    """Prompt ids of a conversation with an open assistant turn, as the serving engine renders it."""
    rendered: Any = tokenizer.apply_chat_template(
        messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(t) for t in rendered["input_ids"]]


def _reply(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: set[int], summary: bool) -> dict[str, Any]:
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    text = str(tokenizer.decode(tokens[:cut], skip_special_tokens=False))
    if summary:  # tool_choice "none": the text is the content
        return {"role": "assistant", "content": text}
    content, calls = read_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"call-{uuid.uuid4().hex[:12]}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in calls
        ]
    return message


def drive(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sessions: list[AgentSession],
    *,
    tools: Sequence[dict[str, Any]] = AGENT_TOOLS,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> None:
    """Run ``sessions`` to their end in lockstep rounds (see the module docs)."""
    im_end: Any = tokenizer.convert_tokens_to_ids(IM_END)
    stops = {int(tokenizer.eos_token_id), int(im_end)}
    pad = int(tokenizer.pad_token_id)
    verdicts: dict[tuple[str, str], CheckResult] = {}

    def checker(task: Task, code: str) -> CheckResult:
        return verdicts[(task.task_id, code)]

    for session in sessions:
        session.checker = checker
    round_no = 0
    while True:
        asks = [(s, ask) for s in sessions if (ask := s.request()) is not None]
        if not asks:
            return
        replies: list[dict[str, Any]] = []
        for start in range(0, len(asks), batch_size):
            chunk = asks[start : start + batch_size]
            prompts = [render(tokenizer, ask["messages"], tools) for _, ask in chunk]
            sampled = sample_batch(
                model,
                prompts,
                max_tokens=max(int(ask["max_tokens"]) for _, ask in chunk),
                temperature=temperature,
                seed=seed * 1_000_003 + round_no * 7919 + start,
                stop_token_ids=sorted(stops),
                pad_token_id=pad,
            )
            for (session, ask), (tokens, _) in zip(chunk, sampled, strict=True):
                tokens = tokens[: int(ask["max_tokens"])]
                replies.append(_reply(tokenizer, tokens, stops, summary=session.pending == "summary"))
        pairs = [(s.task, code) for (s, _), reply in zip(asks, replies, strict=True) for code in tool_codes(reply)]
        unique = [key for key in dict.fromkeys((t.task_id, code) for t, code in pairs) if key not in verdicts]
        if unique:
            tasks = {t.task_id: t for t, _ in pairs}
            verdicts.update(zip(unique, check_many([(tasks[tid], code) for tid, code in unique]), strict=True))
        for (session, _), reply in zip(asks, replies, strict=True):
            session.observe(reply)
        round_no += 1


def evaluate_agent(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: AgentEvalConfig | None = None
) -> dict[str, float]:
    """Held-out task success of the agent (see the module docs); deterministic for a seed on CPU."""
    cfg = cfg or AgentEvalConfig()
    tasks: list[Task] = heldout_eval_set(cfg.tasks_per_tier)
    sessions = [
        AgentSession(
            task,
            session_id=f"eval-{i}-{k}",
            max_turns=cfg.max_turns,
            context_budget_chars=cfg.context_budget_chars,
            max_tokens=cfg.max_tokens,
            summary_max_tokens=cfg.summary_max_tokens,
            system_prompt=AGENT_SYSTEM_PROMPT,
        )
        for i, task in enumerate(tasks)
        for k in range(cfg.samples_per_task)
    ]
    was_training = model.training
    model.eval()
    try:
        drive(
            model,
            tokenizer,
            sessions,
            temperature=cfg.temperature,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
        )
    finally:
        model.train(was_training)
    results = [s.result for s in sessions]
    verdicts = [r.verdict for r in results]
    return {
        "agent/sessions": float(len(results)),
        "agent/success": float(np.mean([bool(v and v.kept) for v in verdicts])),
        "agent/pass": float(np.mean([bool(v and v.passed) for v in verdicts])),
        "agent/submitted": float(np.mean([r.ended == "submitted" for r in results])),
        "agent/mean_turns": float(np.mean([r.turns for r in results])),
        "agent/mean_requests": float(np.mean([r.requests for r in results])),
        "agent/summaries": float(np.mean([r.summaries > 0 for r in results])),
    }
