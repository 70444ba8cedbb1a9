"""The agent in process: scripted transcripts for the warm-up (:mod:`policy.agent_sft`) and the
batched held-out evaluation (:mod:`policy.agent_eval`), both on the harness's own protocol."""

from __future__ import annotations

import json

import pytest
import torch

from policy.agent import SUMMARY_REQUEST, AgentSession
from policy.agent_eval import AGENT_TOOLS, AgentEvalConfig, drive, evaluate_agent, render
from policy.agent_sft import agent_examples
from policy.model import build_model
from policy.sft import MIXES, SFTConfig, warmup
from policy.tasks import heldout_tasks, train_tasks
from policy.tokenizer import default_tokenizer
from policy.windows import SUMMARY_TEXT


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return default_tokenizer()


def test_scripted_transcripts_are_what_the_engine_renders_and_train_only_the_replies(sandbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    tasks = train_tasks()[::97][:12]
    cfg = AgentEvalConfig(context_budget_chars=200)  # small: every session compacts
    examples = agent_examples(tokenizer, tasks, 0, MIXES, cfg=cfg, max_tokens=1024)
    assert len(examples) > len(tasks)  # several requests per session
    texts = []
    for ids, mask in examples:
        assert len(ids) == len(mask) and any(mask) and not mask[0]
        first = mask.index(True)
        assert all(mask[first:])  # the reply, through <|im_end|>, is the trained tail
        trained = tokenizer.decode(ids[first:])
        assert trained.endswith("<|im_end|>")
        texts.append((tokenizer.decode(ids[:first]), trained))
    calls = [t for _, t in texts if t.startswith("<tool_call>")]
    summaries = [t for p, t in texts if SUMMARY_REQUEST in p]
    assert calls and summaries and all(t.startswith(SUMMARY_TEXT) for t in summaries)
    parsed = [json.loads(c.removeprefix("<tool_call>").split("</tool_call>")[0]) for c in calls]
    tests = [p for p in parsed if p["name"] == "run_tests"]
    submits = [p for p in parsed if p["name"] == "submit"]
    assert tests and all(isinstance(p["arguments"]["code"], str) for p in tests)
    assert submits and all(p["arguments"] == {} for p in submits)  # the workspace: the body last tested
    # the prompt of an example is the conversation as the serving engine renders it
    session = AgentSession(tasks[0], context_budget_chars=200, system_prompt="Coding agent.")
    ask = session.request()
    assert ask is not None
    assert (
        render(tokenizer, ask["messages"], AGENT_TOOLS)[-3:] == tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]
    )


def test_in_process_sessions_follow_the_protocol_and_are_deterministic(sandbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = build_model("tiny", len(tokenizer), 0)
    model.eval()
    tasks = heldout_tasks()[:3]

    def run() -> list[tuple[int, int, str]]:
        sessions = [AgentSession(t, max_turns=2, max_tokens=12, system_prompt="x") for t in tasks]
        drive(model, tokenizer, sessions, seed=5)
        return [(s.result.turns, s.result.requests, s.result.ended) for s in sessions]

    first = run()
    assert first == run()  # same seed, same sessions
    assert all(turns == 2 and ended == "turn_limit" for turns, _, ended in first)  # an untrained model never submits


def test_a_warm_up_with_agent_transcripts_and_its_evaluation(sandbox) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, metrics = warmup(SFTConfig(steps=6, agent_every=2, agent_tasks=20, batch_size=8))
    assert metrics["sft/agent_examples"] > 20
    result = evaluate_agent(model, tokenizer, AgentEvalConfig(tasks_per_tier=2, max_turns=2, max_tokens=16))
    assert result["agent/sessions"] == 6
    assert 0.0 <= result["agent/success"] <= result["agent/pass"] <= result["agent/submitted"] <= 1.0
    assert 1.0 <= result["agent/mean_turns"] <= 2.0
    # the held-out evaluation of a version carries the agent's figures next to the completions'
    from policy.evaluate import EvalConfig, evaluate

    both = evaluate(model, tokenizer, EvalConfig(per_tier=1, samples_per_task=1, agent_per_tier=1, agent_samples=2))
    assert "eval/keep_rate" in both and both["eval/agent/sessions"] == 6
    assert 0.0 <= both["eval/agent/success"] <= 1.0


def test_an_evaluation_of_nothing_samples_nothing(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The demo's gate drill is not meant to serve: with no tasks asked for, no model is even run."""
    from policy.evaluate import EvalConfig, evaluate

    class Untouchable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the model was used ({name})")

    assert evaluate(Untouchable(), tokenizer, EvalConfig(per_tier=0, agent_per_tier=0)) == {}  # type: ignore[arg-type]
    small = evaluate(build_model("tiny", len(tokenizer), seed=0), tokenizer, EvalConfig(per_tier=1, samples_per_task=1))
    assert 0.0 <= small["eval/keep_rate"] <= 1.0
