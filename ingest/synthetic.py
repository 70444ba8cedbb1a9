"""Realistic, contract-valid telemetry with a known hidden quality per session.

Used by the demo, the tests and the benchmark. Session arrivals follow a production request-rate
trace (Alibaba ServeGen "m-small", 10-minute windows) by inverse-CDF sampling of its piecewise
constant rate, so load rises and falls like the real day. Each session gets a hidden quality
``q`` in (0, 1) from a seeded Beta distribution; every signal is drawn from it:

- a share of requests are K-candidate groups (K = 2..4): K ``session.completed`` with
  ``group_id``/``candidate_index``, one ``candidates.shown``, one ``candidate.selected`` that
  picks by a softmax over the candidates' qualities;
- ``code.retained`` at 300 s, 3,600 s and 86,400 s, arriving that late, the retained share
  decaying faster for low ``q``; some carry ``final_text``;
- ``edit.accepted``/``edit.rejected`` (accept with probability ``q``), ``feedback.thumbs``,
  ``model.switched`` (more likely for low ``q``), ``user.churned`` for some users;
- a few sessions are delivered late (their signals arrive first), and some events twice.

Each item carries ``at_s``: when it reaches Kafka, in trace seconds from the start. Callers
compress time as they like.
"""

from __future__ import annotations

import csv
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from ingest.arrays import npy_to_b64

HORIZONS_S = (300, 3600, 86400)
WINDOW_S = 600

_TASKS = (
    ("parse a CSV line into fields", "def parse_line(line):\n    return line.strip().split(',')\n"),
    ("clamp a value to a range", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"),
    ("reverse the words of a sentence", "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n"),
    ("count the vowels in a string", "def vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n"),
    (
        "check that brackets are balanced",
        "def balanced(s):\n    depth = 0\n    for c in s:\n"
        "        depth += {'(': 1, ')': -1}.get(c, 0)\n        if depth < 0:\n            return False\n"
        "    return depth == 0\n",
    ),
    (
        "return the n-th Fibonacci number",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    ),
    ("merge two sorted lists", "def merge(a, b):\n    return sorted(a + b)\n"),
    ("deduplicate a list keeping order", "def dedupe(xs):\n    return list(dict.fromkeys(xs))\n"),
)
_MODELS = ("undertow-moe-tiny", "assistant-large", "assistant-small")


def load_rates(path: str | Path) -> np.ndarray:
    """Request rates (req/s) per 10-minute window of a ServeGen ``total_rate_10min.csv``.

    Windows that are all zero are collection gaps, not idle time: they take the mean of the
    non-zero windows.
    """
    with open(path, newline="") as fh:
        rates = np.array([float(row["total_rate_rps"]) for row in csv.DictReader(fh)], dtype=np.float64)
    if rates.size == 0 or not (rates > 0).any():
        raise ValueError(f"{path}: no non-zero rate windows; is it a ServeGen total_rate_10min.csv?")
    rates[rates <= 0] = rates[rates > 0].mean()
    return rates


def default_trace_path(repo_root: Path | None = None) -> Path | None:
    """The ServeGen trace beside the project (``../shared/data``), else the slice kept for tests."""
    root = repo_root or Path(__file__).resolve().parent.parent
    for candidate in (
        root.parent / "shared" / "data" / "traces" / "servegen-m-small" / "total_rate_10min.csv",
        root / "tests" / "ingest" / "data" / "servegen_m_small_day0.csv",
    ):
        if candidate.exists():
            return candidate
    return None


def arrival_times(n: int, rates: np.ndarray, span_s: float, rng: np.random.Generator, start_s: float = 0) -> np.ndarray:
    """``n`` sorted arrival times in ``[start_s, start_s + span_s)`` whose density follows ``rates``."""
    first = int(start_s // WINDOW_S)
    n_windows = max(1, int(np.ceil(span_s / WINDOW_S)))
    idx = (first + np.arange(n_windows)) % len(rates)
    weights = rates[idx] * np.minimum(WINDOW_S, span_s - np.arange(n_windows) * WINDOW_S)
    cdf = np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum()
    u = np.sort(rng.random(n))
    window = np.searchsorted(cdf, u, side="right") - 1
    within = (u - cdf[window]) / np.maximum(cdf[window + 1] - cdf[window], 1e-12)
    times = start_s + (window + within) * WINDOW_S
    return np.minimum(times, start_s + span_s - 1e-6)


@dataclass
class SyntheticItem:
    """One message to produce: when it reaches Kafka (trace seconds) and the event."""

    at_s: float
    event: dict[str, Any]
    duplicate: bool = False


@dataclass
class SyntheticTelemetry:
    """A seeded stream of events with the hidden quality behind them (``quality[session_id]``)."""

    items: list[SyntheticItem]
    quality: dict[str, float] = field(default_factory=dict)

    @property
    def distinct_events(self) -> int:
        """Events counting each ``event_id`` once."""
        return len({it.event["event_id"] for it in self.items})

    def counts_by_type(self) -> dict[str, int]:
        """Distinct events per type (what ``undertow stats`` must report after ingesting them)."""
        seen: dict[str, str] = {it.event["event_id"]: it.event["type"] for it in self.items}
        counts: dict[str, int] = {}
        for kind in seen.values():
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def generate(
    n_requests: int,
    seed: int = 0,
    rates: np.ndarray | None = None,
    span_s: float = 86400.0,
    start: datetime | None = None,
    group_share: float = 0.3,
    duplicate_share: float = 0.02,
    late_session_share: float = 0.05,
    with_experts: bool = True,
    horizons: tuple[int, ...] = HORIZONS_S,
    id_prefix: str = "",
) -> SyntheticTelemetry:
    """Telemetry of ``n_requests`` user requests (a group of K candidates counts as one request).

    ``id_prefix`` namespaces every id (events, sessions, groups, users), so two runs with the
    same seed can share a database without being duplicates of each other.
    """
    rng = np.random.default_rng(seed)
    rates = rates if rates is not None else np.ones(144)
    start = start or datetime(2025, 1, 6, tzinfo=UTC)
    arrivals = arrival_times(n_requests, rates, span_s, rng)
    n_users = max(1, n_requests // 8)
    users = [f"{id_prefix}user-{seed}-{i}" for i in range(n_users)]
    user_skill = rng.normal(0.0, 0.5, n_users)
    items: list[SyntheticItem] = []
    quality: dict[str, float] = {}

    def eid() -> str:
        return id_prefix + str(
            uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63)), version=4)
        )

    def envelope(kind: str, at: float, session_id: str | None, user: str, payload: dict[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {
            "schema_version": 1,
            "event_id": eid(),
            "type": kind,
            "occurred_at": (start + timedelta(seconds=float(at))).isoformat(),
            "user_id": user,
            "payload": payload,
        }
        if session_id is not None:
            env["session_id"] = session_id
        return env

    def emit(at: float, event: dict[str, Any]) -> None:
        items.append(SyntheticItem(at, event))

    for r, t0 in enumerate(arrivals):
        u = int(rng.integers(0, n_users))
        user = users[u]
        k = int(rng.integers(2, 5)) if rng.random() < group_share else 1
        group_id = f"{id_prefix}group-{seed}-{r}" if k > 1 else None
        task, code = _TASKS[int(rng.integers(0, len(_TASKS)))]
        model = _MODELS[0] if rng.random() < 0.8 else _MODELS[int(rng.integers(1, len(_MODELS)))]
        session_ids = [f"{id_prefix}sess-{seed}-{r}-{c}" for c in range(k)]
        qualities = [float(1 / (1 + np.exp(-(rng.normal(0.3, 1.2) + user_skill[u])))) for _ in range(k)]
        for c, (sid, q) in enumerate(zip(session_ids, qualities, strict=True)):
            quality[sid] = q
            n_lines = code.count("\n")
            text = code if q > 0.35 else code.replace("return", "return None  #", 1)
            n_prompt, n_out = int(rng.integers(12, 40)), int(rng.integers(16, 64))
            out_ids = rng.integers(0, 32000, n_out).tolist()
            payload: dict[str, Any] = {
                "model": model,
                "policy_version": "v0001" if model == _MODELS[0] else "external",
                "prompt": {
                    "text": f"Write a Python function to {task}.",
                    "token_ids": rng.integers(0, 32000, n_prompt).tolist(),
                },
                "segments": [
                    {"role": "user", "text": f"Write a Python function to {task}."},
                    {
                        "role": "assistant",
                        "text": text,
                        "token_ids": out_ids,
                        "logprobs": np.round(-rng.exponential(0.4 + (1 - q), n_out), 6).tolist(),
                    },
                ],
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 128, "logprobs_mode": "raw"},
                "finish_reason": "stop",
                "latency_ms": float(np.round(rng.gamma(4, 60), 1)),
                "files": [{"path": "solution.py", "lines_added": n_lines, "lines_removed": 0}],
            }
            if group_id is not None:
                payload["group_id"], payload["candidate_index"] = group_id, c
            if with_experts and model == _MODELS[0]:
                experts = rng.integers(0, 16, (n_prompt + n_out - 1, 4, 2)).astype(np.int32)
                payload["routed_experts"] = npy_to_b64(experts)
            delay = float(rng.exponential(1.0)) + (900.0 if rng.random() < late_session_share else 0.0)
            emit(t0 + delay, envelope("session.completed", t0, sid, user, payload))

        chosen = 0
        if k > 1:
            shown_at = t0 + 0.5
            emit(
                shown_at,
                envelope(
                    "candidates.shown",
                    shown_at,
                    session_ids[0],
                    user,
                    {"group_id": group_id, "session_ids": session_ids},
                ),
            )
            logits = np.array(qualities) * 4.0
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            chosen = int(rng.choice(k, p=probs))
            picked_at = shown_at + float(rng.exponential(20.0))
            emit(
                picked_at,
                envelope(
                    "candidate.selected",
                    picked_at,
                    session_ids[chosen],
                    user,
                    {"group_id": group_id, "chosen_session_id": session_ids[chosen]},
                ),
            )
        sid, q = session_ids[chosen], qualities[chosen]
        lines = code.count("\n")
        decided_at = t0 + 5 + float(rng.exponential(30.0))
        accepted = rng.random() < q
        emit(
            decided_at,
            envelope(
                "edit.accepted" if accepted else "edit.rejected",
                decided_at,
                sid,
                user,
                {"edit_id": f"{id_prefix}edit-{seed}-{r}", "lines": lines},
            ),
        )
        if accepted:
            kept = lines
            for h in horizons:
                kept = int(rng.binomial(kept, q ** (0.15 if h <= 300 else 0.3)))
                at = t0 + h + float(rng.exponential(60.0))
                body: dict[str, Any] = {"horizon_s": h, "lines_written": lines, "lines_retained": kept}
                if h == horizons[-1]:
                    body["final_text"] = code if kept == lines else code.splitlines(keepends=True)[0]
                emit(at, envelope("code.retained", at, sid, user, body))
        if rng.random() < 0.25:
            at = decided_at + float(rng.exponential(10.0))
            emit(at, envelope("feedback.thumbs", at, sid, user, {"value": 1 if rng.random() < q else -1}))
        if rng.random() < 0.15 * (1 - q):
            at = decided_at + float(rng.exponential(120.0))
            to = _MODELS[1] if model != _MODELS[1] else _MODELS[2]
            emit(at, envelope("model.switched", at, sid, user, {"from_model": model, "to_model": to}))

    for u, user in enumerate(users):
        if rng.random() < 0.05 + 0.1 * float(user_skill[u] < -0.5):
            at = span_s * float(rng.uniform(0.5, 1.0))
            emit(at, envelope("user.churned", at, None, user, {"inactive_days": int(rng.integers(7, 60))}))

    n_dupes = int(len(items) * duplicate_share)
    for i in rng.choice(len(items), size=n_dupes, replace=False) if n_dupes else []:
        original = items[int(i)]
        items.append(SyntheticItem(original.at_s + float(rng.exponential(30.0)), original.event, duplicate=True))
    items.sort(key=lambda it: it.at_s)
    return SyntheticTelemetry(items=items, quality=quality)


def flat_session(i: int, seed: int = 0, n_tokens: int = 32) -> dict[str, Any]:
    """A small valid ``session.completed`` (benchmarks and tests that need many cheap events)."""
    rng = np.random.default_rng(seed * 1_000_003 + i)
    return {
        "schema_version": 1,
        "event_id": f"ev-{seed}-{i}",
        "type": "session.completed",
        "occurred_at": "2025-01-06T12:00:00+00:00",
        "session_id": f"sess-{seed}-{i}",
        "user_id": f"user-{i % 97}",
        "payload": {
            "model": "undertow-moe-tiny",
            "policy_version": "v0001",
            "prompt": {"text": "Write a function.", "token_ids": rng.integers(0, 32000, 8).tolist()},
            "segments": [
                {
                    "role": "assistant",
                    "text": "def f():\n    return 1\n",
                    "token_ids": rng.integers(0, 32000, n_tokens).tolist(),
                    "logprobs": np.round(-rng.exponential(0.5, n_tokens), 6).tolist(),
                },
            ],
        },
    }
