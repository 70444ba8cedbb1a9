"""What tells a right answer from a wrong one on a task family the reward model never saw? The served
confidence, the answer's length, a head on the policy's hidden states, and the project's text model,
side by side on the same candidates.

The reward model scores sessions nobody labeled yet; within a candidate group it can only help RL if
it orders the candidates of a task it has no label for. This benchmark asks which inputs can do that:

- **candidates**: v0 (the ablation's cached warm-up, :func:`benchmarks.ablation.v0_checkpoint`) samples
  ``--k`` candidates for a seeded sample of ``--train-tasks`` training tasks and ``--heldout-tasks``
  held-out ones (:func:`policy.rollouts.rollouts_from_tasks`: temperature 1, the served logprobs kept),
  each checked by the sandboxed checker. The label is *passed* (every hidden test); the reward
  (:func:`policy.rollouts.task_reward`: kept 1, passed 0.2, else 0) orders a group's pairs.
- **inputs**, fitted on the training-task candidates only, scored on the held-out ones (whole task
  templates never trained on, :mod:`policy.tasks`):

  - ``logprob``: the served mean token logprob as it is (no fit), the policy's own confidence;
  - ``logprob_length``: logistic regression on the mean logprob and the log token count;
  - ``hidden_state``: a linear head on the policy's hidden states (the final layer and the middle one,
    mean-pooled over the answer's positions) plus the two numbers above: logistic regression, ``C``
    chosen by cross-validation grouped by template on the training candidates (no held-out peeking);
  - ``text_model``: the project's text reward model (:class:`reward_models.text_model.TextRewardModel`:
    TF-IDF of the answer and the request, lengths and the logprob summaries, calibrated).

- **metrics** on the held-out candidates: ROC AUC for *passed*, and within-group pairwise accuracy over
  the pairs of one group whose rewards differ (what GRPO uses: the order inside a group).

Prints one JSON object (per input: ``auc``, ``pairwise``; the pass and keep rates, the counts, the
conditions, the wall time). Run: ``python benchmarks/rm_features.py`` (``--quick``: a smoke run).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "2")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

C_GRID = (0.01, 0.1, 1.0, 10.0)


def pairwise_accuracy(groups: Sequence[str], rewards: Sequence[float], scores: Sequence[float]) -> tuple[float, int]:
    """Share of same-group pairs with different rewards that ``scores`` order like the rewards (a tie
    counts half), and how many such pairs there were (``nan``, 0 when none)."""
    members: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for group, reward, score in zip(groups, rewards, scores, strict=True):
        members[group].append((float(reward), float(score)))
    right = 0.0
    pairs = 0
    for items in members.values():
        for i, (ri, si) in enumerate(items):
            for rj, sj in items[i + 1 :]:
                if ri == rj:
                    continue
                pairs += 1
                right += 0.5 if si == sj else float((ri > rj) == (si > sj))
    return (right / pairs if pairs else float("nan")), pairs


def candidates(model: Any, tokenizer: Any, tasks: list[Any], k: int, seed: int) -> list[dict[str, Any]]:
    """``k`` checked samples per task with the features every input needs (hidden states pooled here)."""
    import torch

    from ingest.arrays import pack_floats
    from policy.rollouts import rollouts_from_tasks
    from reward_models.data import logprob_stats

    by_id = {t.task_id: t for t in tasks}
    rollouts = rollouts_from_tasks(
        model, tokenizer, tasks, group_size=k, temperature=1.0, max_tokens=48, seed=seed, version=0
    )
    out = []
    for r in rollouts:
        with torch.no_grad():
            hidden = model(torch.tensor([r.prompt_ids + r.completion_ids]), output_hidden_states=True).hidden_states
        start = len(r.prompt_ids) - 1  # the positions that predict the answer's tokens
        middle, last = hidden[len(hidden) // 2][0, start:], hidden[-1][0, start:]
        lp_mean, lp_min, lp_std = logprob_stats([pack_floats(r.served_logprobs)])  # as the reward model reads them
        task = by_id[str(r.context)]
        out.append(
            {
                "group": r.group_id,
                "template": task.template,
                "reward": r.reward,
                "passed": int(r.info["passed"]),
                "kept": int(r.info["kept"]),
                "hidden": torch.cat([middle.mean(0), last.mean(0)]).numpy().astype(np.float64),
                "mean_logprob": lp_mean,
                "logprob_min": lp_min,
                "logprob_std": lp_std,
                "tokens": len(r.completion_ids),
                "prompt_text": task.prompt,
                "completion_text": tokenizer.decode(r.completion_ids, skip_special_tokens=True),
            }
        )
    return out


def _numbers(rows: list[dict[str, Any]]) -> np.ndarray:
    return np.array([[r["mean_logprob"], np.log1p(r["tokens"])] for r in rows])


def _hidden(rows: list[dict[str, Any]]) -> np.ndarray:
    return np.column_stack([np.stack([r["hidden"] for r in rows]), _numbers(rows)])


def _linear(train_x: np.ndarray, y: np.ndarray, groups: list[str], test_x: np.ndarray) -> tuple[np.ndarray, float]:
    """Standardized logistic regression, ``C`` by grouped cross-validation (AUC); held-out scores and ``C``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def fit(c: float, x: np.ndarray, target: np.ndarray) -> Any:
        return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=5000)).fit(x, target)

    folds = min(4, len(set(groups)))
    best_c, best_auc = C_GRID[0], -1.0
    for c in C_GRID:
        scores = np.zeros(len(y))
        for tr, te in GroupKFold(folds).split(train_x, y, groups):
            scores[te] = fit(c, train_x[tr], y[tr]).decision_function(train_x[te]) if len(set(y[tr])) > 1 else 0.0
        auc = roc_auc_score(y, scores) if len(set(y)) > 1 else 0.5
        if auc > best_auc:
            best_c, best_auc = c, auc
    return fit(best_c, train_x, y).decision_function(test_x), best_c


def _frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    keys = ("prompt_text", "completion_text", "mean_logprob", "logprob_min", "logprob_std")
    frame = pd.DataFrame({key: [r[key] for r in rows] for key in keys})
    frame["num_completion_tokens"] = [r["tokens"] for r in rows]
    return frame


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Sample, fit every input on the training candidates, score the held-out ones."""
    import torch
    from sklearn.metrics import roc_auc_score

    from benchmarks.ablation import v0_checkpoint
    from policy.model import load_checkpoint
    from policy.tasks import heldout_tasks, train_tasks
    from reward_models.text_model import TextRewardModel

    started = time.monotonic()
    torch.manual_seed(args.seed)
    model, tokenizer = load_checkpoint(v0_checkpoint(args.home, args.sft_steps))
    model.eval()
    rng = random.Random(args.seed)
    train_sample = rng.sample(train_tasks(), min(args.train_tasks, len(train_tasks())))
    held_sample = rng.sample(heldout_tasks(), min(args.heldout_tasks, len(heldout_tasks())))
    train = candidates(model, tokenizer, train_sample, args.k, args.seed)
    held = candidates(model, tokenizer, held_sample, args.k, args.seed + 1)
    y = np.array([r["passed"] for r in train])
    if len(set(y.tolist())) < 2:
        raise SystemExit(
            f"v0 passed {int(y.sum())} of {len(y)} training candidates: nothing to learn from one class; "
            "train a stronger v0 (--sft-steps) or sample more tasks (--train-tasks)"
        )
    templates = [r["template"] for r in train]
    scores: dict[str, np.ndarray] = {"logprob": np.array([r["mean_logprob"] for r in held])}
    chosen_c: dict[str, float] = {}
    scores["logprob_length"], chosen_c["logprob_length"] = _linear(_numbers(train), y, templates, _numbers(held))
    scores["hidden_state"], chosen_c["hidden_state"] = _linear(_hidden(train), y, templates, _hidden(held))
    text = TextRewardModel(seed=args.seed).fit(_frame(train), y)
    scores["text_model"] = np.asarray(text.score(_frame(held)), dtype=np.float64)

    y_held = np.array([r["passed"] for r in held])
    groups, rewards = [r["group"] for r in held], [r["reward"] for r in held]
    inputs = {}
    for name, s in scores.items():
        pairwise, _ = pairwise_accuracy(groups, rewards, s.tolist())
        auc = float(roc_auc_score(y_held, s)) if len(set(y_held)) > 1 else float("nan")
        inputs[name] = {"auc": round(auc, 4), "pairwise": round(pairwise, 4)}
    return {
        "inputs": inputs,
        "chosen_c": chosen_c,
        "held_out": {
            "candidates": len(held),
            "pairs": pairwise_accuracy(groups, rewards, [0.0] * len(held))[1],
            "pass_rate": round(float(y_held.mean()), 4),
            "keep_rate": round(float(np.mean([r["kept"] for r in held])), 4),
        },
        "train": {"candidates": len(train), "pass_rate": round(float(y.mean()), 4), "templates": len(set(templates))},
        "conditions": {
            "v0": f"tiny preset, {args.sft_steps} warm-up steps (the ablation's cached v0)",
            "sampling": f"{args.k} candidates per task, temperature 1, at most 48 tokens, seed {args.seed}",
            "tasks": f"{len(train_sample)} training tasks; {len(held_sample)} held-out tasks "
            "(templates never trained on)",
            "label": "passed (every hidden test); pairs ordered by the task reward (kept 1, passed 0.2, else 0)",
            "hidden_state": "final and middle layer, mean over the answer's positions, plus logprob and length; "
            "logistic regression, C by 4-fold CV grouped by template on the training candidates",
            "torch_threads": torch.get_num_threads(),
        },
        "wall_s": round(time.monotonic() - started, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--home", type=Path, default=Path(".undertow"), help="Undertow home (the v0 cache)")
    p.add_argument("--sft-steps", type=int, default=300, help="warm-up steps of v0 (cached)")
    p.add_argument("--train-tasks", type=int, default=400)
    p.add_argument("--heldout-tasks", type=int, default=160)
    p.add_argument("--k", type=int, default=4, help="candidates per task")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="a smoke run (120-step v0, few tasks)")
    p.add_argument("--json", action="store_true", help="print one JSON object (always printed; `make bench` passes it)")
    args = p.parse_args(argv)
    if args.quick:
        args.sft_steps, args.train_tasks, args.heldout_tasks = 120, 60, 24
    return args


def main(argv: list[str] | None = None) -> None:
    from scheduler.runtime.logs import configure_logging

    configure_logging("WARNING")  # stdout carries the one JSON object
    print(json.dumps(run(parse_args(argv))))


if __name__ == "__main__":
    main()
