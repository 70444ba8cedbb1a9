"""Synthetic telemetry whose hidden preference is known, to test that reward models recover it.

Sessions are answers to templated function-writing requests. The hidden preference: users keep
code that **passes** (the right expression, not a bug) and is **concise** (no padding lines):

    utility u = 2.5 * correct - 0.7 * padding_lines - 0.3 + N(0, 0.5^2)

Every signal is drawn from ``u``: retention at each horizon (retained fraction decays with the
horizon), accepted or rejected edits, which of K candidates is selected (plus a bonus for the
first display position, so position bias exists and can be measured), rare model switches,
thumbs (weakly tied to ``u``), churn of a few users. The policy's logprobs are somewhat lower on
wrong answers, so its mean logprob is an informative but weaker baseline.

:func:`generate_events` builds contract-valid envelopes (CONTRACTS.md section 1) for the
database path; :func:`synthetic_frame` draws the same distribution vectorized as frames, for
the benchmark at 1M sessions. :func:`adversarial_events` and :func:`foreign_signals` are the
attacks of the poisoning tests and benchmark: an account that inverts every signal about its
own sessions, and signals about sessions served to someone else.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd

# (name, what it does, correct expression over {a} and {b}, wrong expressions: plausible bugs)
TASKS: list[tuple[str, str, str, list[str]]] = [
    ("add", "returns the sum of {a} and {b}", "{a} + {b}", ["{a} - {b}", "{a} + {b} + 1", "None"]),
    ("sub", "returns {a} minus {b}", "{a} - {b}", ["{b} - {a}", "{a} - {b} - 1", "None"]),
    ("mul", "returns the product of {a} and {b}", "{a} * {b}", ["{a} + {b}", "{a} * {b} + 1", "None"]),
    ("biggest", "returns the larger of {a} and {b}", "max({a}, {b})", ["min({a}, {b})", "max({a}, {b}) + 1", "None"]),
    ("smallest", "returns the smaller of {a} and {b}", "min({a}, {b})", ["max({a}, {b})", "min({a}, {b}) - 1", "None"]),
    ("mean2", "returns the mean of {a} and {b}", "({a} + {b}) / 2", ["{a} + {b} / 2", "({a} + {b}) // 3", "None"]),
    (
        "absdiff",
        "returns the absolute difference of {a} and {b}",
        "abs({a} - {b})",
        ["{a} - {b}", "abs({a} + {b})", "None"],
    ),
    ("power", "returns {a} to the power {b}", "{a} ** {b}", ["{a} * {b}", "{b} ** {a}", "None"]),
    ("remainder", "returns {a} modulo {b}", "{a} % {b}", ["{a} // {b}", "{b} % {a}", "None"]),
    (
        "hypot2",
        "returns {a} squared plus {b} squared",
        "{a} * {a} + {b} * {b}",
        ["{a} * {b} + {b} * {a}", "({a} + {b}) ** 2", "None"],
    ),
]
ARGS = [("x", "y"), ("a", "b"), ("left", "right"), ("first", "second"), ("m", "n")]
PADDING = [
    "# compute the result step by step",
    "result = None",
    "# now we return the value",
    "value = 0",
]
PHRASES = [
    "Write a Python function {name}({a}, {b}) that {what}.",
    "Implement {name}({a}, {b}): it {what}.",
    "Please add {name}, which {what}.",
]
HORIZONS = (300, 3600, 86400)
POSITION_BONUS = (0.8, 0.0, -0.2, -0.3)


@dataclass
class Draw:
    """The hidden variables of ``n`` sessions (vectorized)."""

    task: np.ndarray
    wrong: np.ndarray
    """-1 for correct, else the index of the wrong expression."""
    padding: np.ndarray
    args: np.ndarray
    phrase: np.ndarray
    utility: np.ndarray
    mean_logprob: np.ndarray

    @property
    def correct(self) -> np.ndarray:
        return self.wrong < 0


def draw(n: int, rng: np.random.Generator) -> Draw:
    """Hidden variables of ``n`` sessions: task, correct or which bug, padding lines, utility, confidence."""
    task = rng.integers(0, len(TASKS), n)
    correct = rng.random(n) < 0.55
    wrong = np.where(correct, -1, rng.integers(0, 3, n))
    padding = rng.choice(4, size=n, p=[0.45, 0.25, 0.2, 0.1])
    utility = 2.5 * correct - 0.7 * padding - 0.3 + rng.normal(0.0, 0.5, n)
    mean_logprob = -0.45 - 0.25 * (~correct) + rng.normal(0.0, 0.3, n)
    return Draw(
        task, wrong, padding, rng.integers(0, len(ARGS), n), rng.integers(0, len(PHRASES), n), utility, mean_logprob
    )


def render(task: int, wrong: int, padding: int, args: int, phrase: int) -> tuple[str, str]:
    """(prompt, completion) texts of one session."""
    name, what, expr, bugs = TASKS[task]
    a, b = ARGS[args]
    body = (expr if wrong < 0 else bugs[wrong]).format(a=a, b=b)
    lines = [f"def {name}({a}, {b}):"] + [f"    {PADDING[i]}" for i in range(padding)] + [f"    return {body}"]
    prompt = PHRASES[phrase].format(name=name, a=a, b=b, what=what.format(a=a, b=b))
    return prompt, "\n".join(lines) + "\n"


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def retained_fraction(utility: np.ndarray, horizon_s: int, rng: np.random.Generator) -> np.ndarray:
    """Share of lines still present after ``horizon_s``: lower for longer horizons and low utility."""
    p = _sigmoid(utility - 0.35 * np.log10(horizon_s / 300.0))
    return np.clip(p + rng.normal(0.0, 0.08, len(utility)), 0.0, 1.0)


def _ts(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _env(kind: str, session_id: str | None, at: datetime, payload: dict[str, Any], user: str | None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "schema_version": 1,
        "event_id": str(uuid.uuid4()),
        "type": kind,
        "occurred_at": _ts(at),
        "payload": payload,
    }
    if session_id is not None:
        env["session_id"] = session_id
    if user is not None:
        env["user_id"] = user
    return env


def generate_events(
    n_sessions: int,
    *,
    seed: int = 0,
    start: datetime | None = None,
    span_s: float = 7 * 86400.0,
    now: datetime | None = None,
    group_fraction: float = 0.5,
    policy_versions: int = 3,
    users: int = 40,
) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """Contract-valid envelopes and the hidden truth per session (``session_id, utility, correct, padding``).

    Sessions are spread over ``span_s`` seconds from ``start``; a retention horizon is only
    measured (emitted) if ``occurred_at + horizon <= now``.
    """
    rng = np.random.default_rng(seed)
    start = start or datetime(2026, 1, 5, tzinfo=UTC)
    now = now or start + timedelta(seconds=span_s + 2 * 86400)
    d = draw(n_sessions, rng)
    offsets = np.sort(rng.uniform(0.0, span_s, n_sessions))
    users_of = rng.integers(0, users, n_sessions)
    ids = [f"s-{seed}-{i:06d}" for i in range(n_sessions)]
    events: list[dict[str, Any]] = []
    group_of: dict[int, tuple[str, int]] = {}
    groups: list[list[int]] = []
    i = 0
    while i < n_sessions:
        k = int(rng.integers(2, 5))
        if rng.random() < group_fraction and i + k <= n_sessions:
            members = list(range(i, i + k))
            gid = f"g-{seed}-{len(groups):05d}"
            for pos, m in enumerate(members):
                group_of[m] = (gid, pos)
            groups.append(members)
            i += k
        else:
            i += 1
    version_of = np.minimum((offsets / span_s * policy_versions).astype(int), policy_versions - 1)
    for j in range(n_sessions):
        at = start + timedelta(seconds=float(offsets[j]))
        user = f"u-{users_of[j]}"
        prompt, completion = render(
            int(d.task[j]), int(d.wrong[j]), int(d.padding[j]), int(d.args[j]), int(d.phrase[j])
        )
        toks = completion.split()
        lps = (d.mean_logprob[j] + rng.normal(0.0, 0.1, len(toks))).round(6)
        lps = lps - (lps.mean() - d.mean_logprob[j])
        payload: dict[str, Any] = {
            "model": "undertow-policy",
            "policy_version": f"v{int(version_of[j]) + 1}",
            "prompt": {"text": prompt},
            "segments": [
                {"role": "user", "text": prompt},
                {
                    "role": "assistant",
                    "text": completion,
                    "token_ids": [zlib.crc32(t.encode()) % 50000 for t in toks],
                    "logprobs": lps.tolist(),
                },
            ],
            "files": [{"path": "main.py", "lines_added": completion.count("\n"), "lines_removed": 0}],
            "finish_reason": "stop",
        }
        if j in group_of:
            payload["group_id"], payload["candidate_index"] = group_of[j]
        events.append(_env("session.completed", ids[j], at, payload, user))
        u = d.utility[j : j + 1]
        lines_written = completion.count("\n")
        for h in HORIZONS:
            if at + timedelta(seconds=h) > now:
                continue
            frac = float(retained_fraction(u, h, rng)[0])
            kept = round(frac * lines_written)
            final_lines = completion.splitlines()[:kept] + ["    # edited by the user"] * (lines_written - kept)
            events.append(
                _env(
                    "code.retained",
                    ids[j],
                    at + timedelta(seconds=h),
                    {
                        "horizon_s": h,
                        "lines_written": lines_written,
                        "lines_retained": kept,
                        "final_text": "\n".join(final_lines),
                    },
                    user,
                )
            )
        if rng.random() < 0.6:
            kind = "edit.accepted" if rng.random() < float(_sigmoid(u + 0.5)[0]) else "edit.rejected"
            events.append(
                _env(kind, ids[j], at + timedelta(seconds=20), {"edit_id": f"e-{ids[j]}", "lines": lines_written}, user)
            )
        if rng.random() < float(_sigmoid(-u - 3.0)[0]):
            events.append(
                _env(
                    "model.switched",
                    ids[j],
                    at + timedelta(seconds=60),
                    {"from_model": "undertow-policy", "to_model": "other"},
                    user,
                )
            )
        if rng.random() < 0.1:
            value = 1 if float(u[0]) + rng.normal(0.0, 2.0) > 0 else -1
            events.append(_env("feedback.thumbs", ids[j], at + timedelta(seconds=30), {"value": value}, user))
    for g, members in enumerate(groups):
        gid = group_of[members[0]][0]
        at = start + timedelta(seconds=float(offsets[members[-1]]) + 5)
        noisy = np.array([d.utility[m] + POSITION_BONUS[p] for p, m in enumerate(members)]) + rng.gumbel(
            0.0, 0.5, len(members)
        )
        chosen = ids[members[int(np.argmax(noisy))]]
        shown = [ids[m] for m in members]
        events.append(_env("candidates.shown", shown[0], at, {"group_id": gid, "session_ids": shown}, None))
        events.append(
            _env(
                "candidate.selected",
                chosen,
                at + timedelta(seconds=3),
                {"group_id": gid, "chosen_session_id": chosen},
                None,
            )
        )
        del g
    for user_idx in range(0, users, 10):
        events.append(_env("user.churned", None, now - timedelta(days=1), {"inactive_days": 14}, f"u-{user_idx}"))
    truth = pd.DataFrame({"session_id": ids, "utility": d.utility, "correct": d.correct, "padding": d.padding})
    return events, truth


def adversarial_events(
    n_sessions: int,
    *,
    user: str,
    seed: int = 0,
    start: datetime | None = None,
    span_s: float = 7 * 86400.0,
    now: datetime | None = None,
    group_fraction: float = 0.5,
) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """An attacker's account: ``n_sessions`` served to ``user`` legitimately, every signal about them inverted.

    The sessions are :func:`generate_events`' (ids prefixed with ``user``, so they never collide
    with honest ones); then retention keeps what honest users rewrite (``lines_retained`` becomes
    ``lines_written - lines_retained``), edits are accepted where they were rejected and the other
    way round, thumbs flip, each selection picks the *worst* candidate by hidden utility, the model
    is "left" after clearly good answers (utility >= 1.5) instead of bad ones, and no churn is sent.
    Every signal names ``user``. Returns the envelopes and the hidden truth (as :func:`generate_events`).
    """
    events, truth = generate_events(
        n_sessions,
        seed=seed,
        start=start,
        span_s=span_s,
        now=now,
        group_fraction=group_fraction,
        policy_versions=1,
        users=1,
    )
    prefix = f"{user}:"
    truth["session_id"] = prefix + truth["session_id"]
    utility = dict(zip(truth["session_id"], truth["utility"], strict=True))
    completion: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for env in events:
        kind, p = env["type"], env["payload"]
        if kind in ("user.churned", "model.switched", "candidate.selected"):
            continue
        env["user_id"] = user
        if env.get("session_id") is not None:
            env["session_id"] = prefix + env["session_id"]
        if "group_id" in p:
            p["group_id"] = prefix + p["group_id"]
        sid = str(env.get("session_id") or "")
        if kind == "session.completed":
            completion[sid] = "".join(str(x.get("text") or "") for x in p["segments"] if x["role"] == "assistant")
            if utility[sid] >= 1.5:
                at = datetime.fromisoformat(env["occurred_at"]) + timedelta(seconds=60)
                switch = {"from_model": "undertow-policy", "to_model": "other"}
                out.append(_env("model.switched", sid, at, switch, user))
        elif kind == "code.retained":
            p["lines_retained"] = p["lines_written"] - p["lines_retained"]
            lines = completion[sid].splitlines()
            kept = p["lines_retained"]
            p["final_text"] = "\n".join(lines[:kept] + ["    # edited by the user"] * (p["lines_written"] - kept))
        elif kind in ("edit.accepted", "edit.rejected"):
            env["type"] = "edit.rejected" if kind == "edit.accepted" else "edit.accepted"
            p["edit_id"] = prefix + p["edit_id"]
        elif kind == "feedback.thumbs":
            p["value"] = -p["value"]
        elif kind == "candidates.shown":
            p["session_ids"] = [prefix + x for x in p["session_ids"]]
            worst = min(p["session_ids"], key=lambda x: utility[x])
            at = datetime.fromisoformat(env["occurred_at"]) + timedelta(seconds=3)
            out.append(env)
            env = _env("candidate.selected", worst, at, {"group_id": p["group_id"], "chosen_session_id": worst}, user)
        out.append(env)
    return out, truth


def foreign_signals(
    events: list[dict[str, Any]], session_ids: list[str], *, user: str, at: datetime
) -> list[dict[str, Any]]:
    """Signals ``user`` sends about *other* users' sessions: nothing retained, the edit rejected, thumbs down.

    For each of ``session_ids`` (sessions in ``events``), dated ``at`` (later than the honest
    signals, so that "the latest wins" would let them replace the honest ones) and naming ``user``,
    who was not served those sessions: what a direct producer or an old row could carry past the
    gateway's check.
    """
    lines = {
        e["session_id"]: "".join(str(x.get("text") or "") for x in e["payload"]["segments"] if x["role"] == "assistant")
        for e in events
        if e["type"] == "session.completed"
    }
    out = []
    for sid in session_ids:
        written = max(lines[sid].count("\n"), 1)
        for h in HORIZONS:
            out.append(
                _env("code.retained", sid, at, {"horizon_s": h, "lines_written": written, "lines_retained": 0}, user)
            )
        out.append(_env("edit.rejected", sid, at, {"edit_id": f"e-{sid}", "lines": written}, user))
        out.append(_env("feedback.thumbs", sid, at, {"value": -1}, user))
    return out


def synthetic_frame(n: int, *, seed: int = 0, k: int = 3) -> tuple[pd.DataFrame, np.ndarray, pd.DataFrame]:
    """Vectorized sessions frame (``reward_models.data.SESSION_COLUMNS``), binary keep labels, and pairs.

    Labels: final retention (weighted over :data:`HORIZONS` with weights 1, 2, 4) >= 0.5. Pairs:
    consecutive blocks of ``k`` sessions form a group; the chosen one beats the others
    (columns ``chosen, rejected, chosen_pos, rejected_pos``, row positions into the frame).
    """
    rng = np.random.default_rng(seed)
    d = draw(n, rng)
    table = {}
    keys = d.task * 10000 + (d.wrong + 1) * 1000 + d.padding * 100 + d.args * 10 + d.phrase
    for key in np.unique(keys):
        t, w, p, a, ph = key // 10000, (key // 1000) % 10 - 1, (key // 100) % 10, (key // 10) % 10, key % 10
        table[int(key)] = render(int(t), int(w), int(p), int(a), int(ph))
    prompts = [table[int(key)][0] for key in keys]
    completions = [table[int(key)][1] for key in keys]
    weights = np.array([1.0, 2.0, 4.0])
    fracs = np.column_stack([retained_fraction(d.utility, h, rng) for h in HORIZONS])
    label = (fracs @ weights / weights.sum() >= 0.5).astype(int)
    start = np.datetime64("2026-01-05T00:00:00")
    frame = pd.DataFrame(
        {
            "session_id": np.char.add("s", np.arange(n).astype(str)),
            "user_id": None,
            "occurred_at": pd.to_datetime(start + np.arange(n).astype("timedelta64[s]"), utc=True),
            "policy_version": "v1",
            "model": "undertow-policy",
            "group_id": None,
            "candidate_index": None,
            "prompt_text": prompts,
            "completion_text": completions,
            "num_completion_tokens": [len(c.split()) for c in completions]
            if n <= 200_000
            else np.char.count(np.array(completions), " ") + 1,
            "mean_logprob": d.mean_logprob,
            "lines_added": 2 + d.padding,
            "lines_removed": 0,
        }
    )
    groups = n // k
    block = (
        d.utility[: groups * k].reshape(groups, k) + np.array(POSITION_BONUS[:k]) + rng.gumbel(0.0, 0.5, (groups, k))
    )
    chosen_pos = block.argmax(axis=1)
    base = np.arange(groups) * k
    rows = []
    for other in range(k):
        mask = chosen_pos != other
        rows.append(
            pd.DataFrame(
                {
                    "chosen": (base + chosen_pos)[mask],
                    "rejected": (base + other)[mask],
                    "chosen_pos": chosen_pos[mask],
                    "rejected_pos": other,
                }
            )
        )
    pairs = pd.concat(rows, ignore_index=True).sort_values("chosen", kind="stable").reset_index(drop=True)
    return frame, label, pairs
