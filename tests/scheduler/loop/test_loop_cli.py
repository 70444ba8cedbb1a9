"""``undertow jobs loop`` and ``undertow jobs cancel`` as an operator runs them, against a scheduler home
whose broker (the SQLAlchemy transport on its SQLite database) has no worker yet: a queued job is
cancelled, a second cancel and an unknown id are refused with a clear message, and the queued message
that stays on the broker never runs the cancelled job once a worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scheduler_helpers import wait_for
from sqlalchemy import select


def _cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "jobs", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=120,
    )


def _rows(env: dict[str, str], job_id: str) -> list[Any]:
    from ingest.db import make_engine, transaction
    from scheduler.tables import JobRow

    with transaction(make_engine(env["UNDERTOW_DATABASE_URL"])) as s:
        return list(s.scalars(select(JobRow).where(JobRow.chain_id == job_id).order_by(JobRow.id)))


def test_a_cancelled_queued_job_never_runs(sched_env: dict[str, str], start_worker: Any, tmp_path: Path) -> None:
    queued = _cli(sched_env, tmp_path, "loop", "--json")
    assert queued.returncode == 0, queued.stderr
    job_id = json.loads(queued.stdout.strip().splitlines()[-1])["job_id"]
    assert {r.state for r in _rows(sched_env, job_id)} == {"PENDING"}

    cancelled = _cli(sched_env, tmp_path, "cancel", job_id, "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout.strip().splitlines()[-1]) == {
        "job_id": job_id,
        "state": "REVOKED",
        "cancelled": True,
    }
    again = _cli(sched_env, tmp_path, "cancel", job_id)
    assert again.returncode != 0 and "already finished (REVOKED)" in again.stderr
    unknown = _cli(sched_env, tmp_path, "cancel", "no-such-job")
    assert unknown.returncode != 0 and "no job 'no-such-job'" in unknown.stderr

    # A worker now takes the message that stayed queued: the first step sees the cancel and ends.
    start_worker(sched_env, "late")
    wait_for(
        lambda: any(r.name == "undertow.collect" and r.attempts for r in _rows(sched_env, job_id)),
        timeout=60,
        what="the queued step delivered",
    )
    time.sleep(2.0)
    rows = {r.name: r for r in _rows(sched_env, job_id)}
    assert rows["undertow.collect"].state == "REVOKED" and rows["undertow.collect"].outputs is None  # ran nothing
    assert all(rows[n].attempts == 0 for n in ("undertow.retrain", "undertow.rl_update"))  # never delivered
    assert rows["loop"].state == "REVOKED"
