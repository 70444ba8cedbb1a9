"""Reward-model benchmark: training time at 100k and 1M labeled sessions, scoring rate, memory peak,
and held-out metrics next to the baselines.

Data: :func:`reward_models.synthetic.synthetic_frame` (known hidden preference, vectorized),
sessions in time order; the newest 20% are the hold-out. The model is the default scikit-learn
backend (hashed n-grams + numeric features, SGD logistic regression; Bradley-Terry on selection
pairs). Baselines in the same run: a constant score (AUC 0.5, pairwise accuracy 0.5) and the
policy's own mean logprob. ``train_s_*`` includes featurization; threads are capped at 2.

Usage: ``python benchmarks/rewards.py --json`` (``--sizes 100000,1000000`` to change sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from reward_models import evaluation as ev  # noqa: E402
from reward_models.config import RewardsConfig  # noqa: E402
from reward_models.models import SklearnPairwise, SklearnPointwise  # noqa: E402
from reward_models.synthetic import synthetic_frame  # noqa: E402


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(n: int, config: RewardsConfig, seed: int) -> dict[str, float]:
    """Generate ``n`` sessions, train pointwise + pairwise heads on the older 80%, evaluate on the newest 20%."""
    frame, y, pairs = synthetic_frame(n, seed=seed)
    split = int(n * 0.8)
    t0 = time.perf_counter()
    head = SklearnPointwise(config).fit(frame.iloc[:split], y[:split])
    tr = pairs[(pairs["chosen"] < split) & (pairs["rejected"] < split)]
    pair_head = SklearnPairwise(config).fit(
        frame.iloc[:split], tr["chosen"].to_numpy(), tr["rejected"].to_numpy(), np.ones(len(tr))
    )
    train_s = time.perf_counter() - t0
    test = frame.iloc[split:]
    t1 = time.perf_counter()
    logit = head.score(test)
    score_s = time.perf_counter() - t1
    lp = frame["mean_logprob"].to_numpy()
    te = pairs[(pairs["chosen"] >= split) & (pairs["rejected"] >= split)]
    pscore = np.zeros(n)
    pscore[split:] = pair_head.score(test)
    c, r = te["chosen"].to_numpy(), te["rejected"].to_numpy()
    return {
        "train_s": train_s,
        "score_per_s": len(test) / score_s,
        "auc": ev.auc(y[split:], logit) or float("nan"),
        "auc_baseline": 0.5,
        "auc_logprob": ev.auc(y[split:], lp[split:]) or float("nan"),
        "ece": ev.expected_calibration_error(y[split:], ev.sigmoid(logit)) or float("nan"),
        "pairwise_acc": ev.pairwise_accuracy(pscore[c], pscore[r]) or float("nan"),
        "pairwise_acc_baseline": 0.5,
        "pairwise_acc_logprob": ev.pairwise_accuracy(lp[c], lp[r]) or float("nan"),
        "pairwise_acc_position": ev.pairwise_accuracy(
            -te["chosen_pos"].to_numpy(float), -te["rejected_pos"].to_numpy(float)
        )
        or float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--sizes", default="100000,1000000", help="comma-separated session counts (first: 100k, second: 1M)"
    )
    parser.add_argument("--seed", type=int, default=0)
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
        "sizes": sizes,
        "backend": "sklearn",
        "note": "train_s includes featurization of the training split; metrics: newest 20% of the largest size",
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
