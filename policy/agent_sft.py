"""Agent transcripts for the warm-up: v0 learns the harness's protocol before RL improves it.

Each transcript is a real :class:`policy.agent.AgentSession` (the harness's own protocol: system
prompt and task, tool results from the checker, nudges, the context budget and self-summaries)
driven by a scripted writer instead of a model: it tries bodies drawn from the warm-up's mix
(concise, verbose, wrong, :data:`policy.sft.MIXES`), calls ``run_tests`` on each, and submits the
workspace (``submit()``: the body just tested) as soon as one is kept, or after ``max_attempts``;
asked for a summary, it writes ``<|summary|>``, how many bodies it tried and how the last went.
Every request of the session is one example: the prompt the engine would render, then the
scripted reply as the chat template renders an assistant turn, trained on the reply only (through
``<|im_end|>``). The same transcripts, as text, are part of the tokenizer's corpus
(:func:`transcript_texts`), so the protocol's framing is a few tokens.

So v0 speaks the protocol and writes plausible bodies with the warm-up's mix of quality, which RL
then shifts, as it does for single completions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from policy.agent import AgentSession
from policy.agent_eval import AGENT_SYSTEM_PROMPT, AGENT_TOOLS, AgentEvalConfig
from policy.chat_template import IM_END
from policy.checker import CheckResult, check_many
from policy.tasks import Task
from policy.windows import SUMMARY_TEXT

if TYPE_CHECKING:
    from policy.sft import Mixes

Example = tuple[list[int], list[bool]]
"""Token ids and the loss mask (True on the tokens trained)."""


def _call(name: str, code: str | None, n: int) -> dict[str, Any]:
    arguments = json.dumps({"code": code} if code is not None else {})
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
            verdict = self.tried[-1][1]
            state = "kept" if verdict and verdict.kept else "passed" if verdict and verdict.passed else "failed"
            return {"role": "assistant", "content": f"{SUMMARY_TEXT} tried {len(self.tried)}, last {state}"}
        self.calls += 1
        last = self.tried[-1] if self.tried else None
        if last is not None and ((last[1] is not None and last[1].kept) or len(self.tried) >= self.max_attempts):
            return {"role": "assistant", "content": "", "tool_calls": [_call("submit", None, self.calls)]}
        code = self.body()
        verdict = verdicts.get(code)
        self.tried.append((code, verdict))
        return {"role": "assistant", "content": "", "tool_calls": [_call("run_tests", code, self.calls)]}


def _nominal(task: Task, body: str) -> CheckResult:
    size = len(body.rstrip())
    if body in task.wrong:
        return CheckResult(False, 0, size, False, "failed", 1)
    kept = body == task.concise
    return CheckResult(True, 1, size, kept, "passed" if kept else "body too long", 1)


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


def transcripts(
    tasks: Sequence[Task],
    seed: int,
    mixes: Mixes,
    *,
    cfg: AgentEvalConfig | None = None,
    max_attempts: int = 3,
    sandbox: bool = True,
) -> Iterator[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Every request of one scripted session per task: ``(messages sent, scripted reply)``.

    The bodies are checked in the sandbox; with ``sandbox=False`` they get the verdicts their kind
    stands for (concise kept, verbose passed, wrong failed), which is enough for the text's shape."""
    cfg = cfg or AgentEvalConfig()
    rng = random.Random(seed)
    items = [(t, b) for t in tasks for b in dict.fromkeys([t.concise, t.verbose, *t.wrong])]
    results = check_many(items) if sandbox else [_nominal(t, b) for t, b in items]
    checked = dict(zip(((t.task_id, b) for t, b in items), results, strict=True))
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
            yield ask["messages"], reply
            session.observe(reply)


def agent_examples(
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    seed: int,
    mixes: Mixes,
    *,
    cfg: AgentEvalConfig | None = None,
    max_attempts: int = 3,
    max_tokens: int = 1024,
) -> list[Example]:
    """One scripted session per task, every request of it an example (longer than ``max_tokens``: left out)."""
    out: list[Example] = []
    for messages, reply in transcripts(tasks, seed, mixes, cfg=cfg, max_attempts=max_attempts):
        example = _example(tokenizer, messages, reply)
        if example is not None and len(example[0]) <= max_tokens:
            out.append(example)
    return out


def transcript_texts(
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    seed: int,
    mixes: Mixes,
) -> list[str]:
    """Each request of the scripted sessions with its reply, rendered by ``tokenizer``'s chat template
    as text (only the template is used: any Undertow tokenizer renders the same text)."""
    tools: Any = list(AGENT_TOOLS)
    return [
        str(tokenizer.apply_chat_template([*messages, reply], tools=tools, tokenize=False))
        for messages, reply in transcripts(tasks, seed, mixes, sandbox=False)
    ]
