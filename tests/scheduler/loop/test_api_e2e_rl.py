"""``POST /api/v1/retrains`` with ``kind: rl_run`` end to end on the demo's real stack (embedded
Kafka, ingest, SQLite, a Celery worker with the default fleet control and the production trainer,
two CPU engines, the gateway, the API over HTTP) and simulated developers sending requests with
candidate groups and signals: the update trains on the sessions of the requested window, and on no
session outside it, then stores and rolls out the version it trained."""

from __future__ import annotations

import asyncio
import os
import threading
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from scheduler_helpers import wait_for
from sqlalchemy import func, select

pytestmark = [pytest.mark.api_e2e, pytest.mark.slow]


def _groups(engine: object) -> int:
    from ingest.tables import SessionRow

    with engine.connect() as conn:  # type: ignore[attr-defined]
        return int(conn.scalar(select(func.count(func.distinct(SessionRow.group_id)))) or 0)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_rl_run_trains_on_exactly_the_requested_window(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    from ingest.synthetic import default_trace_path, load_rates
    from ingest.tables import SessionRow
    from policy.evaluate import EvalConfig
    from policy.model import load_checkpoint
    from scheduler.demo.developers import DeveloperConfig, Developers
    from scheduler.demo.run import DemoOptions, _env
    from scheduler.demo.stack import DemoStack, v0_cache
    from scheduler.settings import load_settings

    saved = dict(os.environ)
    span_s = 240.0
    opts = DemoOptions(replicas=2, steps_per_version=2, groups_per_step=2, gate_min_requests=3, population=False)
    os.environ.pop("UNDERTOW_DATABASE_URL", None)
    os.environ.update(_env(tmp_path / "home", opts, 86400.0 / span_s))
    if backend == "postgres":  # the database and the Celery broker on PostgreSQL, migrated as an operator would
        from ingest.db import upgrade

        os.environ["UNDERTOW_DATABASE_URL"] = request.getfixturevalue("module_pg_url")
        upgrade(os.environ["UNDERTOW_DATABASE_URL"])
    stack = None
    devs = None
    try:
        settings = load_settings()
        eval_cfg = EvalConfig(per_tier=1, samples_per_task=1)
        v0_path, v0_metrics = v0_cache(settings, tmp_path / "cache", sft_steps=40, eval_cfg=eval_cfg)
        stack = DemoStack(settings, v0_path, v0_metrics, replicas=opts.replicas).start()
        trace = default_trace_path()
        assert trace is not None
        devs = Developers(
            stack.gateway_url,
            load_checkpoint(v0_path)[1],
            load_rates(trace),
            span_s,
            86400.0 / span_s,
            DeveloperConfig(mean_rps=1.0, max_tokens=24),
            api_key=stack.gateway_key,
        )
        threading.Thread(target=lambda: asyncio.run(devs.run()), daemon=True).start()
        wait_for(lambda: _groups(stack.engine) >= 12, timeout=480, every=1.0, what="candidate groups stored")
        with stack.engine.connect() as conn:
            stamps = sorted(conn.scalars(select(SessionRow.occurred_at)))
        since = stamps[len(stamps) // 2]
        before = {str(s) for s in _ids(stack.engine, None, since)}
        headers = {"Authorization": f"Bearer {stack.api_token}"}
        with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as api:
            body = {"kind": "rl_run", "since": since.isoformat(), "reason": "e2e window"}
            r = api.post("/api/v1/retrains", json=body)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            job = wait_for(
                lambda: (
                    (j := api.get(f"/api/v1/jobs/{job_id}").json())["state"] in ("SUCCESS", "FAILURE", "LOST") and j
                ),
                timeout=600,
                every=2.0,
                what="the RL job",
            )
        assert job["state"] == "SUCCESS", job
        until = datetime.fromisoformat(job["params"]["window"]["until"])
        trained = set(job["result"]["rl_update"]["trained_sessions"])
        inside = {str(s) for s in _ids(stack.engine, since, until)}
        assert trained and trained <= inside  # only sessions of the window
        assert not trained & before  # none from before it, though they were eligible
        assert job["result"]["snapshot"]["version"] == job["result"]["rl_update"]["version"]
        assert job["result"]["deployment"]["status"] in ("succeeded", "rolled_back")
        assert [s["state"] for s in job["steps"]] == ["SUCCESS"] * 3
    finally:
        if devs is not None:
            devs.halt()
        if stack is not None:
            stack.stop()
        os.environ.clear()
        os.environ.update(saved)


def _ids(engine: object, since: datetime | None, until: datetime | None) -> list[str]:
    """Session ids in ``[since, until)``: candidate groups and single sessions, both of which the
    update trains on (singles against the running baseline)."""
    from ingest.tables import SessionRow

    query = select(SessionRow.session_id)
    if since is not None:
        query = query.where(SessionRow.occurred_at >= since)
    if until is not None:
        query = query.where(SessionRow.occurred_at < until)
    with engine.connect() as conn:  # type: ignore[attr-defined]
        return list(conn.scalars(query))
