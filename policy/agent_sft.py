"""Agent transcripts for the warm-up: v0 learns the harness's protocol before RL improves it.

Each transcript is a real :class:`policy.agent.AgentSession` (the harness's own protocol: system
prompt and task, tool results from the checker, nudges, the context budget and self-summaries)
driven by a scripted writer instead of a model: it tries bodies drawn from the warm-up's mix
(concise, verbose, wrong, :data:`policy.sft.MIXES`), calls ``run_tests`` on each, submits the
first that is kept, and after ``max_attempts`` submits the best it saw; asked for a summary, it
writes ``<|summary|>`` and what it last tried and how that went. Every request of the session is
one example: the prompt the engine would render, then the scripted reply as the chat template
renders an assistant turn, trained on the reply only (through ``<|im_end|>``).

So v0 speaks the protocol and writes plausible bodies with the warm-up's mix of quality, which RL
then shifts, as it does for single completions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from policy.agent import AgentSession
from policy.agent_eval import AGENT_SYSTEM_PROMPT, AGENT_TOOLS, AgentEvalConfig
from policy.chat_template import IM_END
from policy.checker import CheckResult, check_many
from policy.tasks import Task
from policy.windows import SUMMARY_TEXT

Example = tuple[list[int], list[bool]]
"""Token ids and the loss mask (True on the tokens trained)."""


def _call(name: str, code: str, n: int) -> dict[str, Any]:
    arguments = json.dumps({"code": code})
    return {"id": f"call-{n}", "type": "function", "function": {"name": name, "arguments": arguments}}


class _Writer:
    """The scripted agent of one transcript."""

    def __init__(self, task: Task, rng: random.Random, mix: tuple[float, float, float], max_attempts: int) -> None:
        self.task, self.rng, self.mix, self.max_attempts = task, rng, mix, max_attempts
        self.tried: list[tuple[str, CheckResult | None]] = []
        self.calls = 0

    def body(self) -> str:
        concise, verbose, _ = self.mix
        u = self.rng.random()
        if u < concise:
            return self.task.concise
        if u < concise + verbose or not self.task.wrong:
            return self.task.verbose
        return self.rng.choice(self.task.wrong)

    def reply(self, session: AgentSession, verdicts: dict[str, CheckResult]) -> dict[str, Any]:
        if session.pending == "summary":
            if not self.tried:
                return {"role": "assistant", "content": f"{SUMMARY_TEXT} nothing tried yet"}
            code, verdict = self.tried[-1]
            state = "kept" if verdict and verdict.kept else "passed" if verdict and verdict.passed else "failed"
            return {"role": "assistant", "content": f"{SUMMARY_TEXT} tried {json.dumps(code)}: {state}"}
        self.calls += 1
        last = self.tried[-1] if self.tried else None
        if last is not None and last[1] is not None and last[1].kept:
            return {"role": "assistant", "content": "", "tool_calls": [_call("submit", last[0], self.calls)]}
        if len(self.tried) >= self.max_attempts:
            best = max(self.tried, key=lambda t: (bool(t[1] and t[1].passed), -len(t[0])))
            return {"role": "assistant", "content": "", "tool_calls": [_call("submit", best[0], self.calls)]}
        code = self.body()
        verdict = verdicts.get(code)
        self.tried.append((code, verdict))
        return {"role": "assistant", "content": "", "tool_calls": [_call("run_tests", code, self.calls)]}


def _example(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], reply: dict[str, Any]
) -> Example | None:
    """The request's prompt ids and the reply's tokens (trained), as the engine would see them."""
    tools: Any = list(AGENT_TOOLS)
    prompt = str(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))
    full = str(tokenizer.apply_chat_template([*messages, reply], tools=tools, tokenize=False))
    if not full.startswith(prompt):
        return None
    reply_text = full[len(prompt) :]
    end = reply_text.find(IM_END)
    if end < 0:
        return None
    prompt_ids = [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    reply_ids = [int(t) for t in tokenizer(reply_text[: end + len(IM_END)], add_special_tokens=False)["input_ids"]]
    return prompt_ids + reply_ids, [False] * len(prompt_ids) + [True] * len(reply_ids)


def agent_examples(
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    seed: int,
    mixes: dict[int, tuple[float, float, float]],
    *,
    cfg: AgentEvalConfig | None = None,
    max_attempts: int = 3,
    max_tokens: int = 1024,
) -> list[Example]:
    """One scripted session per task, every request of it an example (longer than ``max_tokens``: left out)."""
    cfg = cfg or AgentEvalConfig()
    rng = random.Random(seed)
    items = [(t, b) for t in tasks for b in dict.fromkeys([t.concise, t.verbose, *t.wrong])]
    checked = dict(zip(((t.task_id, b) for t, b in items), check_many(items), strict=True))
    out: list[Example] = []
    for task in tasks:
        verdicts = {b: checked[(task.task_id, b)] for b in dict.fromkeys([task.concise, task.verbose, *task.wrong])}

        def checker(_task: Task, code: str, known: dict[str, CheckResult] = verdicts) -> CheckResult:
            return known[code]

        session = AgentSession(
            task,
            max_turns=cfg.max_turns,
            context_budget_chars=cfg.context_budget_chars,
            max_tokens=cfg.max_tokens,
            summary_max_tokens=cfg.summary_max_tokens,
            system_prompt=AGENT_SYSTEM_PROMPT,
            checker=checker,
        )
        writer = _Writer(task, rng, mixes[task.tier], max_attempts)
        while (ask := session.request()) is not None:
            reply = writer.reply(session, verdicts)
            example = _example(tokenizer, ask["messages"], reply)
            if example is not None and len(example[0]) <= max_tokens:
                out.append(example)
            session.observe(reply)
    return out
