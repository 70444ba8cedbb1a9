"""The loop on a REAL Celery worker subprocess (``--pool=solo``) over the embedded SQLite broker:
the chain end to end, preemption mid-training with an exact resume, and a killed worker whose
lease expires so the replica comes back. Redis and RabbitMQ brokers run a round trip too."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
from sched_support import FileFleet, ToyTrainer, settings_for, wait_for
from sqlalchemy import select

pytestmark = pytest.mark.slow


def _engine(env: dict[str, str]) -> Any:
    from ingest.db import make_engine

    return make_engine(env["UNDERTOW_DATABASE_URL"])


def _jobs(engine: Any, chain_id: str | None = None) -> list[Any]:
    from ingest.db import transaction
    from scheduler.tables import JobRow

    with transaction(engine) as s:
        q = select(JobRow).order_by(JobRow.created_at)
        if chain_id:
            q = q.where(JobRow.chain_id == chain_id)
        return list(s.scalars(q).all())


def _events(engine: Any, event: str | None = None, holder: str | None = None) -> list[Any]:
    from ingest.db import transaction
    from scheduler.tables import BorrowEventRow

    with transaction(engine) as s:
        q = select(BorrowEventRow).order_by(BorrowEventRow.id)
        if event:
            q = q.where(BorrowEventRow.event == event)
        if holder:
            q = q.where(BorrowEventRow.holder == holder)
        return list(s.scalars(q).all())


def _uninterrupted(steps: int, seed: int = 0) -> str:
    t = ToyTrainer(steps, seed=seed)
    while not t.done:
        t.step()
    return t.digest()


def test_loop_chain_runs_end_to_end_on_a_real_worker(shared: dict[str, str]) -> None:
    from scheduler.celery_app import make_celery
    from scheduler.tasks.loop import loop_chain

    sched_env = shared
    settings = settings_for(sched_env)
    engine = _engine(sched_env)
    result = loop_chain(make_celery(settings), run_id="run-1", steps=12).apply_async()
    final = result.get(timeout=120)
    chain_id = result.parent.parent.parent.parent.parent.id
    assert final["run_id"] == "run-1"
    assert final["ingest"] == {"sessions": 0, "signals": 0, "dead_letters": 0}
    assert final["reward_model"]["retrained"] is False  # an empty database has nothing to train on
    assert final["rl_update"]["weights_sha256"] == _uninterrupted(12)
    assert final["promoted"] == final["policy_version"]
    jobs = _jobs(engine, chain_id)
    names = [j.name for j in jobs]
    assert names == [f"undertow.{n}" for n in ("collect", "retrain", "rl_update", "snapshot", "canary", "promote")]
    assert {j.state for j in jobs} == {"SUCCESS"}
    assert len({j.chain_id for j in jobs}) == 1
    assert all(j.duration_s is not None and j.duration_s >= 0 and j.outputs for j in jobs)
    # The borrowed replica went drain -> sleep -> wake -> rejoin and is serving again.
    fleet = FileFleet(Path(sched_env["UNDERTOW_HOME"])).read()
    rl_job = jobs[2]
    lent = _events(engine, "lent", holder=rl_job.id)[0].replica_id
    calls = [c[0] for c in fleet["calls"] if c[1] == lent]
    assert calls[-4:] == ["drain", "sleep", "wake", "rejoin"]
    assert fleet["replicas"][lent]["state"] == "serving"
    events = [e.event for e in _events(engine, holder=rl_job.id)]
    assert events == [
        "lent",
        "state:sleeping",
        "state:lent",
        "state:checkpointing",
        "state:waking",
        "state:verifying",
        "returned",
    ]


def test_failed_canary_rolls_back(shared: dict[str, str]) -> None:
    from scheduler.celery_app import make_celery
    from scheduler.tasks.loop import loop_chain

    sched_env = shared
    final = loop_chain(make_celery(settings_for(sched_env)), steps=3, fail_canary=True).apply_async().get(timeout=120)
    assert final["canary"]["passed"] is False
    assert final["rolled_back"] == final["policy_version"]
    log = (Path(sched_env["UNDERTOW_HOME"]) / "deploy.log").read_text().splitlines()
    mine = [line.split()[0] for line in log if line.split()[1] == final["policy_version"]]
    assert mine == ["canary", "rollback"]


def test_preemption_hands_back_in_time_and_resumes_to_the_same_result(shared: dict[str, str]) -> None:
    from scheduler.celery_app import make_celery
    from scheduler.tasks import leases

    sched_env = shared
    settings = settings_for(sched_env)
    engine = _engine(sched_env)
    steps = 40
    res = make_celery(settings).send_task(
        "undertow.rl_update", args=({"run_id": "pre-1", "steps": steps, "step_sleep_s": 0.1, "seed": 3},)
    )
    lease = wait_for(lambda: [x for x in leases.active_leases(engine) if x["state"] == "lent"], what="a lent replica")
    time.sleep(1.0)  # a few training steps
    deadline_s = 10.0
    asked_at = time.time()
    assert leases.request_recall(engine, [lease[0]["replica_id"]], deadline_s) == [lease[0]["replica_id"]]
    wait_for(lambda: _events(engine, "preempted", holder=res.id), timeout=30, what="the replica handed back")
    handed_back = _events(engine, "preempted", holder=res.id)[0]
    assert handed_back.detail["within_deadline"] is True
    assert handed_back.at.timestamp() - asked_at < deadline_s
    out = res.get(timeout=120)
    assert out["rl_update"]["resumed"] is True
    assert out["rl_update"]["weights_sha256"] == _uninterrupted(steps, seed=3)
    job = next(j for j in _jobs(engine) if j.id == res.id)
    assert job.state == "SUCCESS" and job.attempts >= 2
    assert leases.active_leases(engine) == []


def test_killed_worker_lease_expires_and_replica_returns(shared: dict[str, str], start_worker: Any) -> None:
    from scheduler.celery_app import make_celery
    from scheduler.tasks import leases

    sched_env = shared
    w1 = start_worker(sched_env, "doomed", queues="doomed")
    settings = settings_for(sched_env)
    engine = _engine(sched_env)
    celery = make_celery(settings)
    sent = celery.send_task(
        "undertow.rl_update", args=({"run_id": "kill-1", "steps": 10_000, "step_sleep_s": 0.05},), queue="doomed"
    )
    held = wait_for(lambda: [x for x in leases.active_leases(engine) if x["state"] == "lent"], what="a lent replica")
    w1.kill()
    replica = held[0]["replica_id"]
    time.sleep(float(sched_env["UNDERTOW_SCHEDULER__LEASE_TTL_S"]) + 0.5)
    reaped = celery.send_task("undertow.reap_leases").get(timeout=60)
    assert reaped["returned"] == [replica]
    assert leases.active_leases(engine) == []
    fleet = FileFleet(Path(sched_env["UNDERTOW_HOME"])).read()
    assert fleet["replicas"][replica]["state"] == "serving"
    assert [e.event for e in _events(engine, "expired", holder=sent.id)] == ["expired"]
    assert next(j for j in _jobs(engine) if j.id == sent.id).state == "LOST"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(
    ("broker", "port"),
    [("redis://127.0.0.1:6379/15", 6379), ("amqp://guest:guest@127.0.0.1:5672//", 5672)],
    ids=["redis", "rabbitmq"],
)
def test_production_brokers_round_trip(
    sched_env: dict[str, str], start_worker: Any, broker: str, port: int, tmp_path: Path
) -> None:
    if not _port_open(port):
        pytest.skip(f"no broker listening on 127.0.0.1:{port}")
    from scheduler.celery_app import make_celery

    queue = f"undertow-test-{tmp_path.name}"
    env = {**sched_env, "UNDERTOW_SCHEDULER__CELERY_BROKER_URL": broker}
    start_worker(env, "prod", queues=queue)
    celery = make_celery(settings_for(env))
    out = celery.send_task("undertow.collect", args=({"run_id": "b"},), queue=queue).get(timeout=60)
    assert out["ingest"]["sessions"] == 0
    assert _jobs(_engine(sched_env))[0].state == "SUCCESS"


def test_beat_planning_recalls_what_a_pool_can_no_longer_lend(shared: dict[str, str]) -> None:
    from scheduler.celery_app import make_celery
    from scheduler.tasks import leases

    engine = _engine(shared)
    fleet = FileFleet(Path(shared["UNDERTOW_HOME"]))
    celery = make_celery(settings_for(shared))
    assert leases.acquire(engine, "r3", "default", "holder-plan", "training", 60)
    quiet = celery.send_task("undertow.plan_capacity").get(timeout=60)["plans"][0]
    assert quiet["lendable"] >= 1 and quiet["recalled"] == []  # 50 rps of 400: room to lend
    assert 0 <= quiet["generation"] < max(2, quiet["lendable"]) and quiet["hot_reserve"] >= 0
    assert quiet["tail_forecast_rps"] >= quiet["forecast_rps"]
    with fleet._edit() as s:
        s["load_rps"] = 330.0  # the forecast now needs every replica
    try:
        busy = celery.send_task("undertow.plan_capacity").get(timeout=60)["plans"][0]
    finally:
        with fleet._edit() as s:
            s["load_rps"] = 50.0
    assert busy["lendable"] == 0 and busy["recalled"] == ["r3"]
    assert leases.renew(engine, "r3", "holder-plan", 60).recall_requested
    assert leases.release(engine, "r3", "holder-plan", event="preempted")


def test_jobs_list_cli_shows_the_runs(shared: dict[str, str], tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, **shared}
    out = subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "jobs", "list", "--json", "--limit", "500"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    jobs = json.loads(out.stdout.strip().splitlines()[-1])["jobs"]
    assert jobs and {"id", "name", "state", "inputs", "outputs", "duration_s"} <= set(jobs[0])
    assert any(j["name"] == "undertow.rl_update" and j["state"] == "SUCCESS" for j in jobs)
