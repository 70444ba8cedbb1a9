"""The demo's held-out evaluation, run once the traffic phase is over instead of inside each update.

Evaluating a version on the held-out set (single completions and agent sessions on tasks no update
trains on) costs more CPU than its RL steps. Inside the update it sat on the loop's critical path:
the next update could not start, and a 6-minute traffic phase fitted two updates. Here the updates
skip it, and :func:`evaluate_versions` evaluates every version afterwards in worker processes (one
torch thread each, ``workers`` at once), with the same :class:`policy.evaluate.EvalConfig` as v0's,
so every version is measured on the same tasks with the same sampling seeds. The results are added
to the versions' rows (:func:`policy.versions.add_metrics`), where the report and the dashboards
read them. The gate drill's version is not evaluated: it is not meant to serve.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from policy.evaluate import EvalConfig

log = structlog.get_logger(__name__)

DRILL_LABEL = "gate drill"


def _evaluate_checkpoint(path: str, cfg: dict[str, Any], threads: int) -> dict[str, float]:
    """One version's held-out metrics (runs in a worker process)."""
    import torch

    from policy.evaluate import EvalConfig, evaluate
    from policy.model import load_checkpoint

    torch.set_num_threads(threads)
    model, tokenizer = load_checkpoint(path)
    return evaluate(model, tokenizer, EvalConfig(**cfg))


def pending_versions(engine: Engine, first: str | None = None) -> list[tuple[str, str]]:
    """``(version, checkpoint)`` of the versions without held-out metrics, ``first`` (the one serving)
    first and then newest first; the warm-up and the gate drill are left out."""
    from policy.rollouts import version_number
    from policy.versions import list_versions

    rows = [
        r
        for r in list_versions(engine)
        if r.parent_id is not None
        and (r.metrics or {}).get("label") != DRILL_LABEL
        and "eval/keep_rate" not in (r.metrics or {})
        and "eval/agent/success" not in (r.metrics or {})
    ]
    rows.sort(key=lambda r: (r.version_id != first, -(version_number(r.version_id) or 0)))
    return [(r.version_id, r.checkpoint_path) for r in rows]


def evaluate_versions(
    engine: Engine,
    cfg: EvalConfig,
    *,
    first: str | None = None,
    workers: int = 2,
    threads: int = 1,
    on_done: Callable[[str, dict[str, float]], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Evaluate every pending version (:func:`pending_versions`) in ``workers`` processes and add the
    metrics to their rows; returns them by version. A version whose evaluation fails is logged and
    left without metrics (the report shows it as not measured)."""
    from policy.versions import add_metrics

    todo = pending_versions(engine, first)
    out: dict[str, dict[str, float]] = {}
    if not todo:
        return out
    started = time.monotonic()
    # spawn: the caller runs threads (the stack's clients), which a forked child must not inherit
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo))), mp_context=ctx) as pool:
        futures = {pool.submit(_evaluate_checkpoint, path, asdict(cfg), threads): vid for vid, path in todo}
        for fut in as_completed(futures):
            vid = futures[fut]
            try:
                metrics = fut.result()
            except Exception as exc:  # one failed evaluation must not lose the others
                log.warning("demo.heldout_failed", version=vid, error=str(exc))
                continue
            add_metrics(engine, vid, metrics)
            out[vid] = metrics
            if on_done is not None:
                on_done(vid, metrics)
    log.info("demo.heldout_done", versions=len(out), seconds=round(time.monotonic() - started, 1))
    return out
