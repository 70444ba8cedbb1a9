"""``benchmarks/rewards.py``: its folds never put one user on both sides, its synthetic split shares no
user or template with training and lies later in time, and its real section goes through the import path."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from reward_models.config import RewardsConfig
from reward_models.synthetic import synthetic_frame

ROOT = Path(__file__).resolve().parents[2]
SLICE = ROOT / "tests" / "ingest" / "data" / "realhumaneval" / "chat_slice.csv"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rewards_bench", ROOT / "benchmarks" / "rewards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_groups_never_cross_folds(bench: ModuleType) -> None:
    rng = np.random.default_rng(0)
    groups = np.array([f"user-{g}" for g in rng.zipf(1.5, 700) % 90], dtype=object)
    folds = bench.grouped_folds(groups, 5)
    assert len(folds) == 5
    tested = np.concatenate([test for _, test in folds])
    assert np.array_equal(np.sort(tested), np.arange(len(groups)))  # every row tested exactly once
    for train, test in folds:
        assert not set(groups[train]) & set(groups[test])
        assert len(train) + len(test) == len(groups)
    with pytest.raises(ValueError, match="groups"):
        bench.grouped_folds(["a", "b", "a"], 5)


def test_synthetic_split_is_disjoint_by_user_and_template_and_later(bench: ModuleType) -> None:
    frame, _, _ = synthetic_frame(20_000, seed=3)
    frame["user_id"] = [f"u{i % 97}" for i in range(len(frame))]
    train, test = bench.disjoint_split(frame, seed=3)
    assert train.sum() > 0.4 * len(frame) and test.sum() > 50
    assert not (train & test).any()
    tr, te = frame[train], frame[test]
    assert not set(tr["user_id"]) & set(te["user_id"])
    assert not set(bench.templates(tr["completion_text"])) & set(bench.templates(te["completion_text"]))
    assert not set(tr["completion_text"]) & set(te["completion_text"])  # no held-out answer text was trained on
    assert tr["occurred_at"].max() < te["occurred_at"].min()


def test_real_section_reads_through_the_import_path_and_holds_programmers_out(bench: ModuleType) -> None:
    import csv

    with SLICE.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    frame, y, info = bench.real_frame(SLICE, RewardsConfig())
    assert info == {"file_rows": len(rows), "skipped_rows": 0} and len(frame) == len(rows)
    copied = {(f"rhe-{r['programmer_id']}", r["response"]): r["copy_events"] != "[]" for r in rows}
    assert [copied[(u, t)] for u, t in zip(frame["user_id"], frame["completion_text"], strict=True)] == list(y == 1)
    assert frame["mean_logprob"].notna().all() and frame["logprob_min"].notna().all()  # the served summary

    result = bench.run_real(SLICE, RewardsConfig(), k=4)
    assert result["rows"] == len(rows) and result["programmers"] == len({r["programmer_id"] for r in rows})
    for name in ("auc", "auc_tfidf_lr", "auc_logprob", "ece"):
        values = result[name]["folds"]
        assert len(values) == 4 and result[name]["mean"] == pytest.approx(np.mean(values), abs=1e-4)
    assert all(0.0 <= v <= 1.0 for v in result["ece"]["folds"])


def test_real_section_reads_any_table_by_a_column_mapping(bench: ModuleType, tmp_path: Path) -> None:
    """Another real log (here the slice exported as JSON Lines with other names) runs through the generic
    importer: the same rows, labels and user-grouped folds."""
    import ast
    import csv

    with SLICE.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    path = tmp_path / "export.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for r in rows:
            record = {
                "dev": r["programmer_id"],
                "ask": r["request"],
                "answer": r["response"],
                "took": r["copy_events"] != "[]",
                "at": float(r["timestamp"]),
                "stats": {"lp": ast.literal_eval(r["logprobs"])["mean"]},
            }
            out.write(json.dumps(record) + "\n")
    columns = ["user=dev,prompt=ask,response=answer,label=took,logprob=stats.lp"]

    frame, y, info = bench.real_frame(path, RewardsConfig(), columns)
    assert info == {"file_rows": len(rows), "skipped_rows": 0} and len(frame) == len(rows)
    copied = {(r["programmer_id"], r["response"]): r["copy_events"] != "[]" for r in rows}
    assert [copied[(u, t)] for u, t in zip(frame["user_id"], frame["completion_text"], strict=True)] == list(y == 1)
    assert frame["mean_logprob"].notna().all()

    result = bench.run_real(path, RewardsConfig(), k=4, columns=columns)
    assert result["programmers"] == len({r["programmer_id"] for r in rows}) and "label column" in result["split"]
    assert 0.0 <= result["auc"]["mean"] <= 1.0 and len(result["auc_tfidf_lr"]["folds"]) == 4


def test_missing_real_file_reports_null_with_a_reason(tmp_path: Path) -> None:
    missing = tmp_path / "absent.csv"
    proc = subprocess.run(
        [sys.executable, "benchmarks/rewards.py", "--json", "--sizes", "20000,30000", "--real", str(missing)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["real_auc"] is None and out["real_auc_tfidf_lr"] is None and out["real"] is None
    assert str(missing) in out["real_reason"]
    assert out["train_rows"]["20000"] > 0 and "held-out users" in out["split"]
    assert 0.0 <= out["auc"] <= 1.0 and out["pointwise_model"] == "text"
