"""The demo's held-out evaluation after the traffic phase: every version that can serve is evaluated
in worker processes, exactly as an evaluation inside the update would have; the drill and the
warm-up are left alone, metrics already recorded are never rewritten, and a second pass does nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policy.evaluate import EvalConfig, evaluate
from policy.model import build_model, load_checkpoint, save_checkpoint
from policy.tokenizer import default_tokenizer
from policy.versions import add_metrics, list_versions, record_version
from scheduler.demo.heldout import DRILL_LABEL, evaluate_versions, pending_versions

CFG = EvalConfig(per_tier=1, samples_per_task=2, max_tokens=8, agent_per_tier=1, agent_samples=1)


@pytest.fixture
def lineage(engine, tmp_path: Path):  # type: ignore[no-untyped-def]
    tok = default_tokenizer()
    rows = [
        ("v0000", None, {"eval/keep_rate": 0.25}),
        ("v0001", "v0000", {}),
        ("v0002", "v0001", {"label": DRILL_LABEL}),
    ]
    rows.append(("v0003", "v0001", {"reward/mean": 0.4}))
    for seed, (vid, parent, metrics) in enumerate(rows):
        path = save_checkpoint(build_model("tiny", len(tok), seed=seed), tok, tmp_path / vid)
        record_version(engine, version=vid, parent=parent, step=seed, checkpoint_path=path, metrics=metrics)
    return engine


def test_pending_versions_put_the_serving_one_first_and_skip_the_drill_and_the_warm_up(lineage) -> None:  # type: ignore[no-untyped-def]
    assert [v for v, _ in pending_versions(lineage)] == ["v0003", "v0001"]  # newest first
    assert [v for v, _ in pending_versions(lineage, first="v0001")] == ["v0001", "v0003"]


def test_versions_get_the_metrics_an_evaluation_in_the_update_would_have_given(lineage) -> None:  # type: ignore[no-untyped-def]
    seen: list[str] = []
    out = evaluate_versions(lineage, CFG, first="v0001", workers=2, on_done=lambda v, _m: seen.append(v))
    assert sorted(out) == sorted(seen) == ["v0001", "v0003"]
    rows = {r.version_id: dict(r.metrics or {}) for r in list_versions(lineage)}
    assert "eval/keep_rate" not in rows["v0002"]  # the drill is not meant to serve
    assert rows["v0000"] == {"eval/keep_rate": 0.25}  # the warm-up keeps its own
    assert rows["v0003"]["reward/mean"] == 0.4  # training metrics stay
    torch.set_num_threads(1)
    model, tok = load_checkpoint(next(r.checkpoint_path for r in list_versions(lineage) if r.version_id == "v0003"))
    in_process = evaluate(model, tok, CFG)
    for key in ("eval/keep_rate", "eval/pass_rate", "eval/agent/success"):
        assert rows["v0003"][key] == pytest.approx(in_process[key])
    assert evaluate_versions(lineage, CFG) == {}  # nothing left to evaluate


def test_added_metrics_never_overwrite_recorded_ones(lineage) -> None:  # type: ignore[no-untyped-def]
    merged = add_metrics(lineage, "v0000", {"eval/keep_rate": 0.9, "eval/pass_rate": 0.5})
    assert merged["eval/keep_rate"] == 0.25 and merged["eval/pass_rate"] == 0.5
    with pytest.raises(ValueError, match="not recorded"):
        add_metrics(lineage, "v9999", {"eval/keep_rate": 0.1})
