"""Realistic demo-sized rows for the API and dashboard tests, written through the real paths.

Telemetry goes through the ingest contract (``validate_event``) and writer; fleet, deployments
and reward-model rows are written with the owning layers' tables. Four policy versions are
served one after another, each better than the last (the users' hidden preference), so every
chart has a visible trend; candidate groups mix the current and the previous version, so
selection win rates differ by version.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.schemas import validate_event
from ingest.writer import write_events
from serving.tables import DeploymentRow, DeploymentStageRow, ReplicaRow, TargetRow

VERSIONS = ("v0", "v1", "v2", "v3")
QUALITY = {"v0": 0.42, "v1": 0.52, "v2": 0.61, "v3": 0.70}
HORIZONS = (300, 3600, 86400)
MODEL = "undertow-coder"
SECRET_PROMPT = "Write merge_intervals(xs) for the billing service"
SECRET_CODE = "def merge_intervals(xs):\n    return sorted(xs)  # SECRET-CODE-MARKER\n"
PADDING = (
    "    # step one: sort\n",
    "    result = None\n",
    "    # now return it\n",
    "    value = 0\n",
    "    pass\n",
    "    # done\n",
)


@dataclass
class Seeded:
    """What was written, for assertions."""

    sessions: int = 0
    signals: int = 0
    session_ids: list[str] = field(default_factory=list)
    start: datetime = datetime(2026, 1, 1, tzinfo=UTC)
    end: datetime = datetime(2026, 1, 1, tzinfo=UTC)
    reward_models: list[str] = field(default_factory=list)
    borrow_windows: int = 0
    jobs: list[str] = field(default_factory=list)


def _ts(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _env(kind: str, session_id: str | None, at: datetime, payload: dict[str, Any], user: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "schema_version": 1,
        "event_id": str(uuid.uuid4()),
        "type": kind,
        "occurred_at": _ts(at),
        "user_id": user,
        "payload": payload,
    }
    if session_id is not None:
        env["session_id"] = session_id
    return env


def demand_weight(at: datetime) -> float:
    """Relative traffic at a time of day: busy afternoons, quiet nights (peak 15:00, trough 03:00 UTC)."""
    hour = at.hour + at.minute / 60.0
    return 1.0 + 0.85 * float(np.cos((hour - 15.0) / 24.0 * 2 * np.pi))


def arrival_times(rng: np.random.Generator, n: int, start: datetime, span: timedelta) -> list[datetime]:
    """``n`` sorted session times over ``[start, start + span)`` following the daily cycle."""
    out: list[datetime] = []
    while len(out) < n:
        at = start + span * float(rng.random())
        if rng.random() * 1.85 < demand_weight(at):
            out.append(at)
    return sorted(out)


def seed_telemetry(engine: Engine, *, n_sessions: int = 600, seed: int = 7, now: datetime | None = None) -> Seeded:
    """Write ``n_sessions`` sessions served from 74 to 26 hours ago, with their signals (every
    retention horizon has elapsed, so the reward models get final labels)."""
    rng = np.random.default_rng(seed)
    now = now or datetime.now(UTC)
    # Anchored to midnight so the same seed draws the same data whatever the time of day.
    start = now.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(hours=96)
    span = timedelta(hours=48)
    events: list[dict[str, Any]] = []
    out = Seeded(start=start, end=start + span)
    times = arrival_times(rng, n_sessions, start, span)
    i = 0
    while i < n_sessions:
        frac = i / n_sessions
        at = times[i]
        version = VERSIONS[min(int(frac * len(VERSIONS)), len(VERSIONS) - 1)]
        user = f"user-{rng.integers(0, 40)}"
        grouped = rng.random() < 0.3 and version != "v0"
        k = 3 if grouped else 1
        group_id = f"g-{uuid.uuid4().hex[:12]}" if grouped else None
        previous = VERSIONS[VERSIONS.index(version) - 1]
        members: list[tuple[str, str, float]] = []
        for c in range(k):
            v = version if (c == 0 or not grouped or rng.random() < 0.5) else previous
            sid = f"s-{uuid.uuid4().hex}"
            q = QUALITY[v]
            utility = q + rng.normal(0, 0.15)
            members.append((sid, v, utility))
            payload: dict[str, Any] = {
                "model": MODEL,
                "policy_version": v,
                "prompt": {"text": SECRET_PROMPT},
                "segments": [
                    {"role": "user", "text": SECRET_PROMPT},
                    {
                        "role": "assistant",
                        "text": SECRET_CODE + "".join(PADDING[: int(np.clip(round((0.8 - utility) * 10), 0, 6))]),
                        "token_ids": [1, 2, 3],
                        "logprobs": [float(-0.1 - (1 - utility) * rng.random()), -0.2, -0.3],
                    },
                ],
                "latency_ms": float(rng.uniform(80, 400)),
            }
            if grouped:
                payload |= {"group_id": group_id, "candidate_index": c}
            events.append(_env("session.completed", sid, at, payload, user))
            out.session_ids.append(sid)
            written = int(rng.integers(4, 30))
            for h in HORIZONS:
                if at + timedelta(seconds=h) <= now:
                    kept = float(np.clip(utility - 0.08 * HORIZONS.index(h) + rng.normal(0, 0.05), 0, 1))
                    events.append(
                        _env(
                            "code.retained",
                            sid,
                            at + timedelta(seconds=h),
                            {"horizon_s": h, "lines_written": written, "lines_retained": round(kept * written)},
                            user,
                        )
                    )
            accepted = utility + rng.normal(0, 0.08) > 0.55
            events.append(
                _env(
                    "edit.accepted" if accepted else "edit.rejected",
                    sid,
                    at + timedelta(seconds=20),
                    {"lines": written},
                    user,
                )
            )
            if rng.random() < 0.12 * (1 - q):
                events.append(
                    _env(
                        "model.switched",
                        sid,
                        at + timedelta(minutes=5),
                        {"from_model": MODEL, "to_model": "other"},
                        user,
                    )
                )
            if rng.random() < 0.15:
                events.append(
                    _env("feedback.thumbs", sid, at + timedelta(minutes=1), {"value": 1 if utility > 0.5 else -1}, user)
                )
        if grouped:
            ids = [m[0] for m in members]
            events.append(_env("candidates.shown", ids[0], at, {"group_id": group_id, "session_ids": ids}, user))
            chosen = max(members, key=lambda m: m[2] + rng.normal(0, 0.1))[0]
            events.append(
                _env(
                    "candidate.selected",
                    chosen,
                    at + timedelta(seconds=30),
                    {"group_id": group_id, "chosen_session_id": chosen},
                    user,
                )
            )
        i += k
    validated = [validate_event(e) for e in events]
    with transaction(engine) as session:
        result = write_events(session, validated)
    out.sessions = sum(1 for e in events if e["type"] == "session.completed")
    out.signals = result.stored - out.sessions
    return out


def seed_fleet(engine: Engine, now: datetime | None = None) -> None:
    """Three replicas (one borrowed), a target per pool, and two deployments with stages."""
    now = now or datetime.now(UTC)
    with transaction(engine) as s:
        for i, state in enumerate(("serving", "serving", "borrowed")):
            s.add(
                ReplicaRow(
                    id=f"cpu-{i}",
                    url=f"http://127.0.0.1:{8301 + i}",
                    pool="default",
                    region="local",
                    backend="cpu",
                    state=state,
                    version="v3",
                    weights_hash="h3",
                    health="ok",
                    failures=0,
                    last_check=now,
                    registered_at=now - timedelta(hours=40),
                )
            )
        s.add(TargetRow(pool="default", version="v3", weights_hash="h3", updated_at=now - timedelta(hours=8)))
        for n, (frm, to, status) in enumerate((("v1", "v2", "succeeded"), ("v2", "v3", "running")), start=1):
            t0 = now - timedelta(hours=20 - 10 * n)
            dep = DeploymentRow(
                id=n,
                pool="default",
                from_version=frm,
                to_version=to,
                to_hash=f"h{to[1:]}",
                kind="delta",
                status=status,
                message="",
                started_at=t0,
                finished_at=t0 + timedelta(minutes=4) if status != "running" else None,
            )
            dep.stages = [
                DeploymentStageRow(
                    idx=0,
                    name="canary",
                    replicas=["cpu-0"],
                    outcome="passed",
                    metrics={"requests": {to: 40, frm: 120}, "error_rate": {to: 0.0, frm: 0.0}},
                    started_at=t0,
                    finished_at=t0 + timedelta(minutes=2),
                )
            ]
            s.add(dep)


def seed_reward_models(engine: Engine, home: Path, end: datetime) -> list[str]:
    """Train two real reward-model versions (the reward-model layer's own trainer): one on the
    data up to 12 hours before ``end``, one on all of it."""
    from reward_models.config import RewardsConfig
    from reward_models.train import train_reward_models

    # The registry outcome the API tests read (the first version promoted, the second not better on
    # the same hold-out) was fixed on these data with a share cap of 0.05; with 40 users the default
    # 0.02 means equal shares, which changes which version wins. The cap itself is tested in
    # tests/reward_models/test_robust.py.
    config = RewardsConfig(max_user_share=0.05)
    return [
        train_reward_models(engine, config, home, now=end - timedelta(hours=12)).version,
        train_reward_models(engine, config, home, now=datetime.now(UTC)).version,
    ]


def seed_borrowing(engine: Engine, start: datetime, end: datetime) -> int:
    """Borrow windows in the quiet hours of each night (00:30-05:30 UTC), written through the
    scheduler's event log; the last window is still open when it has not ended yet."""
    from scheduler.loop.leases import log_event

    windows = 0
    day = start.replace(hour=0, minute=30, second=0, microsecond=0)
    with transaction(engine) as s:
        while day < end:
            lent, back = day, day + timedelta(hours=5)
            if back > start:
                log_event(s, "cpu-2", "default", "lent", "seed-rl", lent, purpose="training")
                log_event(s, "cpu-2", "default", "returned", "seed-rl", back)
                windows += 1
            day += timedelta(days=1)
    return windows


def seed_jobs(engine: Engine, now: datetime) -> list[str]:
    """Finished, failed and running jobs, recorded through the scheduler's job table writer."""
    from scheduler.loop.jobs import record

    specs = [
        ("undertow.retrain", "SUCCESS", 50.0, 0.2),
        ("undertow.rl_update", "SUCCESS", 49.0, 2.5),
        ("undertow.canary", "SUCCESS", 46.0, 0.4),
        ("undertow.promote", "SUCCESS", 45.5, 0.3),
        ("undertow.retrain", "FAILURE", 26.0, 0.1),
        ("undertow.rl_update", "SUCCESS", 25.0, 3.0),
        ("undertow.canary", "SUCCESS", 21.5, 0.5),
        ("undertow.rollback", "SUCCESS", 20.8, 0.2),
        ("undertow.retrain", "SUCCESS", 2.0, 0.3),
        ("undertow.rl_update", "STARTED", 1.5, None),
    ]
    ids = []
    for n, (name, state, hours_ago, took_h) in enumerate(specs):
        job_id = f"seed-job-{n:02d}"
        created = now - timedelta(hours=hours_ago)
        record(
            engine,
            job_id,
            name=name,
            state=state,
            created_at=created,
            started_at=created + timedelta(minutes=1),
            finished_at=created + timedelta(hours=took_h) if took_h is not None else None,
            inputs={"args": [{"run_id": job_id}], "kwargs": {}},
            outputs={"ok": True} if state == "SUCCESS" else None,
            error="TrainingDataError: too few labels" if state == "FAILURE" else None,
        )
        ids.append(job_id)
    return ids


def seed_policy_versions(engine: Engine, home: Path, start: datetime, end: datetime) -> None:
    """The trainer's rows for v0..v3 (through :func:`policy.versions.record_version`), each trained
    on the telemetry served by its parent; a checkpoint directory holds only its ``config.json``."""
    from policy.versions import record_version

    step = (end - start) / len(VERSIONS)
    for n, version in enumerate(VERSIONS):
        checkpoint = home / "checkpoints" / version
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "config.json").write_text('{"model_type": "qwen3_moe"}')
        record_version(
            engine,
            version=version,
            parent=VERSIONS[n - 1] if n else None,
            step=10 * n,
            checkpoint_path=checkpoint,
            metrics={"loss/policy": round(0.9 - 0.1 * n, 3), "eval/heldout_retention": QUALITY[version]},
            num_samples=120 * n,
            staleness_mean=0.4 if n else None,
            staleness_max=1 if n else None,
            data_start=start + step * (n - 1) if n else None,
            data_end=start + step * n if n else None,
        )


def seed_all(engine: Engine, home: Path, n_sessions: int = 600) -> Seeded:
    """Every kind of row the dashboards read (reward-model artifacts go under ``home``)."""
    now = datetime.now(UTC)
    seeded = seed_telemetry(engine, n_sessions=n_sessions, now=now)
    seed_fleet(engine, now)
    seed_policy_versions(engine, home, seeded.start, seeded.end)
    seeded.reward_models = seed_reward_models(engine, home, seeded.end)
    seeded.borrow_windows = seed_borrowing(engine, seeded.start, seeded.end)
    seeded.jobs = seed_jobs(engine, now)
    return seeded


def make_settings(tmp_path: Path, db_url: str, **api: Any) -> Any:
    """Settings for an app on ``db_url`` (rate limits high unless the test sets them)."""
    from scheduler.settings import Settings

    api = {"rate_limit_per_minute": 100_000, "rate_limit_burst": 10_000, **api}
    return Settings(home=tmp_path, database_url=db_url, api=api)


def auth(token: str) -> dict[str, str]:
    """The header that carries ``token``."""
    return {"Authorization": f"Bearer {token}"}
