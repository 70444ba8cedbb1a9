"""Held-out evaluation: the pass-and-keep rate of the policy on tasks it never trained on.

For each task of the fixed held-out evaluation set (:func:`policy.tasks.heldout_eval_set`) the
policy samples ``samples_per_task`` completions at the serving temperature with a fixed seed;
each body is checked in the sandbox. Reported per tier and overall: ``pass_rate`` (all tests
pass), ``keep_rate`` (pass-and-keep: passes and is concise enough to keep) and mean size.
With ``agent_per_tier > 0``, the agent's held-out task success over multi-turn sessions with tools
(:func:`policy.agent_eval.evaluate_agent`) is added under ``eval/agent/...``.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policy.checker import CheckResult, check_many
from policy.forward import sample_batch
from policy.sft import prompt_ids
from policy.tasks import Task, heldout_eval_set


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation settings."""

    samples_per_task: int = 4
    temperature: float = 1.0
    max_tokens: int = 48
    seed: int = 1234
    per_tier: int = 32
    """Held-out tasks per tier given single completions; 0: none (with ``agent_per_tier`` 0 too, nothing is
    evaluated: a version that is not meant to serve, such as the demo's gate drill)."""
    batch_size: int = 64
    agent_per_tier: int = 0
    """Held-out tasks per tier given agent sessions (:mod:`policy.agent_eval`); 0: none."""
    agent_samples: int = 1
    """Agent sessions per held-out task."""


def decode_body(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """Text of a completion up to (not including) the first EOS."""
    eos = int(tokenizer.eos_token_id)
    cut = token_ids.index(eos) if eos in token_ids else len(token_ids)
    return str(tokenizer.decode(token_ids[:cut], skip_special_tokens=False))


def sample_bodies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[Task],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int,
    batch_size: int = 64,
) -> list[list[tuple[list[int], str]]]:
    """``n`` sampled ``(token_ids, body)`` per task, in task order."""
    flat = [(i, prompt_ids(tokenizer, t)) for i, t in enumerate(tasks) for _ in range(n)]
    out: list[list[tuple[list[int], str]]] = [[] for _ in tasks]
    eos = int(tokenizer.eos_token_id)
    for b in range(0, len(flat), batch_size):
        chunk = flat[b : b + batch_size]
        sampled = sample_batch(
            model,
            [p for _, p in chunk],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed + b,
            stop_token_ids=[eos],
            pad_token_id=int(tokenizer.pad_token_id),
        )
        for (i, _), (tokens, _) in zip(chunk, sampled, strict=True):
            out[i].append((tokens, decode_body(tokenizer, tokens)))
    return out


def summarize(tasks: list[Task], results: list[list[CheckResult]]) -> dict[str, float]:
    """Namespaced metrics: ``eval/keep_rate``, ``eval/pass_rate``, per tier, mean size."""
    metrics: dict[str, float] = {}
    for tier in (0, 1, 2, 3):
        rows = [r for t, rs in zip(tasks, results, strict=True) if tier in (0, t.tier) for r in rs]
        if not rows:
            continue
        suffix = "" if tier == 0 else f"_tier{tier}"
        metrics[f"eval/keep_rate{suffix}"] = sum(r.kept for r in rows) / len(rows)
        metrics[f"eval/pass_rate{suffix}"] = sum(r.passed for r in rows) / len(rows)
        if tier == 0:
            metrics["eval/mean_size"] = sum(r.size for r in rows) / len(rows)
            metrics["eval/samples"] = float(len(rows))
    return metrics


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: EvalConfig | None = None
) -> dict[str, float]:
    """Pass-and-keep rate of ``model`` on the held-out evaluation set; with ``agent_per_tier``, also the
    agent's held-out task success (``eval/agent/success``, ``eval/agent/mean_turns``, ...)."""
    cfg = cfg or EvalConfig()
    metrics: dict[str, float] = {}
    if cfg.per_tier > 0:
        tasks = heldout_eval_set(cfg.per_tier)
        samples = sample_bodies(
            model,
            tokenizer,
            tasks,
            n=cfg.samples_per_task,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
        )
        flat = [(t, body) for t, rows in zip(tasks, samples, strict=True) for _, body in rows]
        checked = check_many(flat)
        per_task = [checked[i * cfg.samples_per_task : (i + 1) * cfg.samples_per_task] for i in range(len(tasks))]
        metrics.update(summarize(tasks, per_task))
    if cfg.agent_per_tier > 0:
        from policy.agent_eval import AgentEvalConfig, evaluate_agent

        agent_cfg = AgentEvalConfig(
            tasks_per_tier=cfg.agent_per_tier,
            samples_per_task=cfg.agent_samples,
            temperature=cfg.temperature,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
        )
        metrics.update({f"eval/{k}": v for k, v in evaluate_agent(model, tokenizer, agent_cfg).items()})
    return metrics
