"""Reward-model benchmark: training time at 100k and 1M synthetic sessions, scoring rate, memory peak,
held-out metrics next to the baselines on synthetic data, and the same model on real data held out by user.

Synthetic data (:func:`reward_models.synthetic.synthetic_frame`, known hidden preference): users are
drawn per candidate group (200 of them); the *template* of a session is the function its answer writes,
padding lines aside (signature and returned expression: 200 distinct ones). The split is disjoint three
ways: a seeded 20% of templates and a seeded 20% of users are held out, and so is the newest 20% of
time. Training rows are older than the cutoff, of training users and training templates; test rows
are at or after it, of held-out users and held-out templates (about 51% and 0.8% of the sessions);
the rest are unused. No held-out answer's code was trained on, with any padding. ``lines_added`` and
``lines_removed`` are zeroed: the generator derives them from the padding the label depends on. The
label mostly says whether an expression is right *for that function*, which n-grams of an unseen
function barely show: expect an AUC near the logprob's, and a calibration that does not carry over
(calibrated on users, not on unseen functions). The models are the project's defaults: the pointwise
head through :func:`reward_models.train.fit_pointwise_head` (the text model of
:mod:`reward_models.text_model`), Bradley-Terry on training pairs (both sessions in training rows;
pairs with both in test rows are its test). ``train_s_*`` includes featurization; threads are capped
at 2. Baselines: a constant score (AUC and pairwise accuracy 0.5) and the policy's mean logprob.

Real data (``--real``, default ``../shared/data/real/realhumaneval/chat_data.csv`` relative to the
repository root): RealHumanEval's chat log read by :func:`ingest.realhumaneval.read_events` into
wire-contract events, framed by :func:`reward_models.data.session_records` and
:func:`~reward_models.data.signal_records`, labeled by :mod:`reward_models.labels` (acceptance: the
programmer copied code from the answer). Five folds grouped by programmer (``GroupKFold``): on each,
the project's model is trained by :func:`~reward_models.train.fit_pointwise_head` on the training
folds (its ``C`` picked by its own inner cross-validation on them: nothing is tuned on a test fold)
and scored on the held-out programmers, next to character 2-4-gram TF-IDF plus logistic regression
on the response text, the served mean logprob alone, and the previous default (hashed n-grams, SGD).
Means over folds and the per-fold values are reported; a missing file reports null with the reason.
Any other real log of answers and adoption labels runs the same way through the generic importer
(:mod:`ingest.table_import`): ``--real FILE --real-map user=uid,prompt=q,response=a,label=accepted``
(CSV, TSV or JSON Lines; the roles of ``undertow import table --map``), folds grouped by its user column.

Usage: ``python benchmarks/rewards.py --json`` (``--sizes 100000,1000000``, ``--real PATH``, ``--real-map``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "2")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import contextlib  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import psutil  # noqa: E402

from reward_models import evaluation as ev  # noqa: E402
from reward_models.config import RewardsConfig  # noqa: E402
from reward_models.models import setup_pairwise  # noqa: E402
from reward_models.synthetic import PADDING, synthetic_frame  # noqa: E402
from reward_models.train import fit_pointwise_head, labeled_frame, pointwise_rows  # noqa: E402

DEFAULT_REAL = Path("..") / "shared" / "data" / "real" / "realhumaneval" / "chat_data.csv"
HELD_OUT = 0.2
USERS = 200
SPLIT = (
    "synthetic: train = older than the 80% time cutoff, training users, training templates; test = at or "
    "after it, held-out users (20%) and held-out templates (20%, template = the answer's function without "
    "padding lines); "
    "lines_added/lines_removed zeroed"
)


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def templates(completion: pd.Series) -> pd.Series:
    """A synthetic answer's template: its function (signature and returned expression), padding lines aside."""
    padding = {line.strip() for line in PADDING}
    return completion.map(lambda text: "\n".join(x for x in text.splitlines() if x.strip() not in padding))


def disjoint_split(frame: pd.DataFrame, seed: int, held_out: float = HELD_OUT) -> tuple[np.ndarray, np.ndarray]:
    """Train and test masks: test rows are newer than every training row and share no user or template with them."""
    rng = np.random.default_rng(seed)
    template = templates(frame["completion_text"])
    distinct = pd.Index(pd.unique(template))
    users = pd.Index(pd.unique(frame["user_id"]))
    test_templates = distinct[rng.random(len(distinct)) < held_out]
    test_users = users[rng.random(len(users)) < held_out]
    times = pd.to_datetime(frame["occurred_at"], utc=True).to_numpy(dtype="datetime64[ns]")
    cutoff = np.sort(times)[min(int(len(times) * (1.0 - held_out)), len(times) - 1)]
    late = times >= cutoff
    template_out = template.isin(test_templates).to_numpy()
    user_out = frame["user_id"].isin(test_users).to_numpy()
    return ~late & ~template_out & ~user_out, late & template_out & user_out


def run(n: int, config: RewardsConfig, seed: int) -> dict[str, float]:
    """Generate ``n`` sessions, split them three ways (:func:`disjoint_split`), train both heads, evaluate."""
    frame, y, pairs = synthetic_frame(n, seed=seed)
    k = 3  # synthetic_frame's group size: a group's candidates are shown to one user
    group_user = np.random.default_rng(seed + 1).integers(0, USERS, n // k + 1)
    frame["user_id"] = pd.Series(group_user[np.arange(n) // k]).map("u{}".format).to_numpy()
    frame["lines_added"] = 0
    frame["lines_removed"] = 0
    train, test = disjoint_split(frame, seed)
    train_rows = np.flatnonzero(train)
    t0 = time.perf_counter()
    head, _ = fit_pointwise_head(frame.iloc[train_rows], y[train_rows], config)
    tr = pairs[train[pairs["chosen"]] & train[pairs["rejected"]]]
    position = np.full(n, -1)
    position[train_rows] = np.arange(len(train_rows))
    pair_head = setup_pairwise(config).fit(
        frame.iloc[train_rows],
        position[tr["chosen"].to_numpy()],
        position[tr["rejected"].to_numpy()],
        np.ones(len(tr)),
    )
    train_s = time.perf_counter() - t0
    late = frame.iloc[int(n * (1 - HELD_OUT)) :]
    t1 = time.perf_counter()
    head.score(late)
    score_s = time.perf_counter() - t1
    test_rows = np.flatnonzero(test)
    logit = head.score(frame.iloc[test_rows])
    lp = frame["mean_logprob"].to_numpy()
    te = pairs[test[pairs["chosen"]] & test[pairs["rejected"]]]
    pscore = np.zeros(n)
    pscore[test_rows] = pair_head.score(frame.iloc[test_rows])
    c, r = te["chosen"].to_numpy(), te["rejected"].to_numpy()
    y_te = y[test_rows]
    return {
        "train_s": train_s,
        "train_rows": len(train_rows),
        "test_rows": len(test_rows),
        "test_pairs": len(te),
        "score_per_s": len(late) / score_s,
        "auc": ev.auc(y_te, logit) or float("nan"),
        "auc_baseline": 0.5,
        "auc_logprob": ev.auc(y_te, lp[test_rows]) or float("nan"),
        "ece": ev.expected_calibration_error(y_te, ev.sigmoid(logit)) or float("nan"),
        "pairwise_acc": ev.pairwise_accuracy(pscore[c], pscore[r]) or float("nan"),
        "pairwise_acc_baseline": 0.5,
        "pairwise_acc_logprob": ev.pairwise_accuracy(lp[c], lp[r]) or float("nan"),
        "pairwise_acc_position": ev.pairwise_accuracy(
            -te["chosen_pos"].to_numpy(float), -te["rejected_pos"].to_numpy(float)
        )
        or float("nan"),
    }


def grouped_folds(groups: Any, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` (train, test) index pairs of ``GroupKFold``: every row tested once, no group on both sides."""
    from sklearn.model_selection import GroupKFold

    groups = np.asarray(groups, dtype=object)
    if len(set(groups)) < k:
        raise ValueError(f"{len(set(groups))} groups cannot make {k} folds grouped by user")
    return list(GroupKFold(k).split(np.zeros(len(groups)), groups=groups))


def tfidf_lr_baseline() -> Any:
    """The standard baseline: character 2-4-gram TF-IDF (sublinear tf) and logistic regression on the response."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    return make_pipeline(
        TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True),
        LogisticRegression(max_iter=1000),
    )


def real_frame(
    path: Path, config: RewardsConfig, columns: list[str] | None = None, time_format: str = "iso"
) -> tuple[pd.DataFrame, np.ndarray, dict[str, Any]]:
    """Real data through the import path: events -> session and signal frames -> acceptance rows (index
    ``session_id``), their labels, and what the import read and skipped. RealHumanEval's ``chat_data.csv``
    by default; any CSV, TSV or JSON Lines table with ``columns`` (``role=column`` items, as ``undertow
    import table --map`` takes them: :mod:`ingest.table_import`), whose time column reads as ``time_format``."""
    from reward_models.data import session_records, signal_records

    if columns:
        from ingest.table_import import ColumnMap
        from ingest.table_import import read_events as read_table

        result = read_table(path, ColumnMap.parse(columns), time_format=time_format)
    else:
        from ingest.realhumaneval import read_events

        result = read_events(path)
    sessions = session_records([e for e in result.events if e["type"] == "session.completed"])
    signals = signal_records(result.events)
    now = pd.to_datetime(sessions["occurred_at"], utc=True, format="ISO8601").max() + timedelta(days=1)
    frame, _, _ = labeled_frame(sessions, signals, config, now.to_pydatetime())
    rows, y = pointwise_rows(frame, "acceptance", config)
    return rows, y, {"file_rows": result.rows, "skipped_rows": len(result.skipped)}


def _summary(values: list[float]) -> dict[str, Any]:
    arr = np.asarray(values, dtype=float)
    return {"mean": round(float(arr.mean()), 4), "std": round(float(arr.std()), 4), "folds": np.round(arr, 4).tolist()}


def run_real(
    path: Path, config: RewardsConfig, k: int = 5, columns: list[str] | None = None, time_format: str = "iso"
) -> dict[str, Any]:
    """The project's model and the baselines on ``k`` folds of the real data grouped by user (programmer)."""
    rows, y, info = real_frame(path, config, columns, time_format)
    folds = grouped_folds(rows["user_id"], k)
    hashed = config.model_copy(update={"pointwise_model": "hashed"})
    metrics: dict[str, list[float]] = {
        name: [] for name in ("auc", "ece", "auc_tfidf_lr", "ece_tfidf_lr", "auc_logprob", "auc_hashed")
    }
    t0 = time.perf_counter()
    for train, test in folds:
        tr, te, y_tr, y_te = rows.iloc[train], rows.iloc[test], y[train], y[test]
        head, _ = fit_pointwise_head(tr, y_tr, config)
        logit = head.score(te.reset_index())
        metrics["auc"].append(ev.auc(y_te, logit) or float("nan"))
        metrics["ece"].append(ev.expected_calibration_error(y_te, ev.sigmoid(logit)) or float("nan"))
        base = tfidf_lr_baseline().fit(tr["completion_text"], y_tr)
        prob = base.predict_proba(te["completion_text"])[:, 1]
        metrics["auc_tfidf_lr"].append(ev.auc(y_te, prob) or float("nan"))
        metrics["ece_tfidf_lr"].append(ev.expected_calibration_error(y_te, prob) or float("nan"))
        metrics["auc_logprob"].append(ev.auc(y_te, te["mean_logprob"].to_numpy(dtype=float)) or float("nan"))
        old, _ = fit_pointwise_head(tr, y_tr, hashed)
        metrics["auc_hashed"].append(ev.auc(y_te, old.score(te.reset_index())) or float("nan"))
    return {
        **{name: _summary(values) for name, values in metrics.items()},
        "rows": len(rows),
        "programmers": int(rows["user_id"].nunique()),
        "positive_rate": round(float(y.mean()), 4),
        "folds": k,
        "split": f"GroupKFold({k}) by programmer (user_id); label: "
        + ("the table's label column" if columns else "code copied from the answer"),
        "seconds": round(time.perf_counter() - t0, 1),
        **info,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--sizes", default="100000,1000000", help="comma-separated session counts (first: 100k, second: 1M)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--real", type=Path, default=ROOT / DEFAULT_REAL, help="RealHumanEval chat_data.csv (default: %(default)s)"
    )
    parser.add_argument(
        "--real-map",
        action="append",
        default=None,
        help="read --real as a CSV/TSV/JSON Lines table with this column mapping (role=column, as `undertow "
        "import table --map`); default: RealHumanEval's chat_data.csv",
    )
    parser.add_argument(
        "--real-time-format",
        default="iso",
        help="with --real-map: how its time column reads (iso, unix, unix_ms, offset)",
    )
    args = parser.parse_args()
    with contextlib.suppress(AttributeError, OSError):
        psutil.Process().cpu_affinity(list(range(min(2, psutil.cpu_count() or 1))))
    config = RewardsConfig(sgd_epochs=3)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for n in sizes:
        results[n] = run(n, config, args.seed)
        print(f"n={n}: {results[n]}", file=sys.stderr)
    small, large = results[sizes[0]], results[sizes[-1]]
    real: dict[str, Any] | None = None
    reason = None
    if args.real.is_file():
        real = run_real(args.real, config, columns=args.real_map, time_format=args.real_time_format)
        print(f"real: {real}", file=sys.stderr)
    else:
        reason = f"real data not found at {args.real}; pass --real PATH to RealHumanEval's chat_data.csv"
    out = {
        "train_s_100k": round(small["train_s"], 3),
        "train_s_1m": round(large["train_s"], 3),
        "score_per_s": round(large["score_per_s"], 1),
        "peak_rss_mb": round(_peak_mb(), 1),
        "auc": round(large["auc"], 4),
        "auc_baseline": large["auc_baseline"],
        "auc_logprob": round(large["auc_logprob"], 4),
        "ece": round(large["ece"], 4),
        "pairwise_acc": round(large["pairwise_acc"], 4),
        "pairwise_acc_baseline": large["pairwise_acc_baseline"],
        "pairwise_acc_logprob": round(large["pairwise_acc_logprob"], 4),
        "pairwise_acc_position": round(large["pairwise_acc_position"], 4),
        "train_rows": {str(n): r["train_rows"] for n, r in results.items()},
        "test_rows": large["test_rows"],
        "test_pairs": large["test_pairs"],
        "split": SPLIT,
        "real_auc": real["auc"]["mean"] if real else None,
        "real_auc_tfidf_lr": real["auc_tfidf_lr"]["mean"] if real else None,
        "real_auc_logprob": real["auc_logprob"]["mean"] if real else None,
        "real_ece": real["ece"]["mean"] if real else None,
        "real": real,
        "real_reason": reason,
        "sizes": sizes,
        "backend": "sklearn",
        "pointwise_model": config.pointwise_model,
        "note": "train_s: both heads on the training rows of that size, featurization included; synthetic metrics: "
        "test rows of the largest size; real: means over folds (per-fold values under real)",
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
