"""The loop's tasks on a REAL Celery worker subprocess (``--pool=solo``) over the embedded SQLite
broker, with the test fleet and the toy trainer (the two override points): preemption mid-training
with an exact resume, a cancelled job whose training checkpoints and stops and whose later steps
never run, and a killed worker whose lease expires so the replica comes back. Redis and RabbitMQ
brokers run a round trip too."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_helpers import FileFleet, ToyTrainer, settings_for, wait_for
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


def _rl_state(run_id: str, steps: int, **extra: Any) -> dict[str, Any]:
    from scheduler.loop.state import LoopState, RLInputs

    return LoopState(run_id=run_id, rl=RLInputs(steps=steps, extra=extra)).wire()


def test_cancel_stops_the_running_training_and_the_steps_after_it(shared: dict[str, str]) -> None:
    from scheduler.loop import leases
    from scheduler.loop.state import LoopState, RLInputs
    from scheduler.loop.submit import cancel, submit

    settings = settings_for(shared)
    engine = _engine(shared)
    state = LoopState(run_id="cancel-1", kind="loop", rl=RLInputs(steps=10_000, extra={"step_sleep_s": 0.05}))
    job_id = submit(engine, settings, state)
    wait_for(lambda: [x for x in leases.active_leases(engine) if x["state"] == "lent"], what="training on a replica")
    checkpoint = Path(shared["UNDERTOW_HOME"]) / "checkpoints" / "cancel-1.ckpt"
    wait_for(checkpoint.exists, timeout=120, every=0.05, what="training steps (a periodic checkpoint)")
    row, cancelled = cancel(engine, settings, job_id, "test")
    assert cancelled and row.state == "REVOKED"
    wait_for(lambda: not leases.active_leases(engine) and checkpoint.exists(), timeout=60, what="training stopped")
    time.sleep(2.0)  # a later step would have started by now
    steps = _jobs(engine, job_id)
    by_name = {r.name: r for r in steps if r.id != job_id}
    assert by_name["undertow.collect"].state == "SUCCESS" and by_name["undertow.retrain"].state == "SUCCESS"
    assert by_name["undertow.rl_update"].state == "REVOKED"
    for later in ("undertow.snapshot", "undertow.rollout"):
        assert by_name[later].state == "REVOKED" and by_name[later].started_at is None  # never ran
    assert by_name["undertow.rl_update"].started_at is not None  # it was running when cancelled
    assert torch.load(checkpoint, weights_only=True)["i"] > 0  # and saved the steps it had made
    assert next(r for r in steps if r.id == job_id).state == "REVOKED"


def test_preemption_hands_back_in_time_and_resumes_to_the_same_result(shared: dict[str, str]) -> None:
    from scheduler.loop import leases
    from scheduler.loop.app import make_celery

    sched_env = shared
    settings = settings_for(sched_env)
    engine = _engine(sched_env)
    steps = 40
    res = make_celery(settings).send_task(
        "undertow.rl_update", args=(_rl_state("pre-1", steps, step_sleep_s=0.1, seed=3),)
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
    assert out["rl_update"]["metrics"]["weights_sha256"] == _uninterrupted(steps, seed=3)
    job = next(j for j in _jobs(engine) if j.id == res.id)
    assert job.state == "SUCCESS" and job.attempts >= 2
    assert leases.active_leases(engine) == []


def test_killed_worker_lease_expires_and_replica_returns(shared: dict[str, str], start_worker: Any) -> None:
    from scheduler.loop import leases
    from scheduler.loop.app import make_celery

    sched_env = shared
    w1 = start_worker(sched_env, "doomed", queues="doomed")
    settings = settings_for(sched_env)
    engine = _engine(sched_env)
    celery = make_celery(settings)
    sent = celery.send_task(
        "undertow.rl_update", args=(_rl_state("kill-1", 10_000, step_sleep_s=0.05),), queue="doomed"
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
    from scheduler.loop.app import make_celery

    queue = f"undertow-test-{tmp_path.name}"
    env = {**sched_env, "UNDERTOW_SCHEDULER__CELERY_BROKER_URL": broker}
    start_worker(env, "prod", queues=queue)
    celery = make_celery(settings_for(env))
    out = celery.send_task("undertow.collect", args=(_rl_state("b", 1),), queue=queue).get(timeout=60)
    assert out["ingest"]["sessions"] == 0
    assert _jobs(_engine(sched_env))[0].state == "SUCCESS"


def test_beat_planning_recalls_what_a_pool_can_no_longer_lend(shared: dict[str, str]) -> None:
    from scheduler.loop import leases
    from scheduler.loop.app import make_celery

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
    assert any(j["name"] == "undertow.rl_update" and j["state"] == "SUCCESS" for j in jobs)  # a task sent alone
    assert any(j["name"] == "loop" and j["state"] == "REVOKED" for j in jobs)  # the cancelled job


@pytest.mark.parametrize(
    ("broker", "port"),
    [(None, None), ("redis://127.0.0.1:6379/14", 6379), ("amqp://guest:guest@127.0.0.1:5672//", 5672)],
    ids=["sqlalchemy", "redis", "rabbitmq"],
)
def test_worker_killed_mid_step_is_redelivered_or_marked_lost(
    sched_env: dict[str, str], start_worker: Any, broker: str | None, port: int | None, tmp_path: Path
) -> None:
    """SIGKILL the worker mid-training: Redis and RabbitMQ hand the step to the next worker, which
    resumes from the checkpoint to exactly the uninterrupted result; the SQLAlchemy transport never
    redelivers, and the step is marked LOST within the configured bound."""
    if port is not None and not _port_open(port):
        pytest.skip(f"no broker listening on 127.0.0.1:{port}")
    from scheduler.loop.app import make_celery

    queue = f"undertow-kill-{tmp_path.name}"
    env = {**sched_env, "UNDERTOW_SCHEDULER__LONGEST_STEP_S": "2"}  # Redis visibility timeout: 2 + 4 s
    if broker:
        env["UNDERTOW_SCHEDULER__CELERY_BROKER_URL"] = broker
    engine = _engine(env)
    doomed = start_worker(env, "doomed", queues=queue)
    celery = make_celery(settings_for(env))
    steps = 60
    sent = celery.send_task(
        "undertow.rl_update", args=(_rl_state("kill-2", steps, step_sleep_s=0.05, seed=5),), queue=queue
    )
    checkpoint = Path(env["UNDERTOW_HOME"]) / "checkpoints" / "kill-2.ckpt"
    wait_for(checkpoint.exists, timeout=60, every=0.05, what="a periodic checkpoint")
    doomed.kill()
    killed_at = time.time()
    start_worker(env, "heir", queues=queue)
    lost_after = float(env["UNDERTOW_SCHEDULER__JOB_LOST_AFTER_S"])
    if broker is None:

        def lost() -> bool:
            celery.send_task("undertow.reap_jobs", queue=queue)  # what celery beat sends
            return _jobs(engine, sent.id)[0].state == "LOST"

        wait_for(lost, timeout=60, every=1.0, what="the step marked LOST")
        assert time.time() - killed_at < lost_after + 10
        assert "no sign of life" in (_jobs(engine, sent.id)[0].error or "")
        return
    out = sent.get(timeout=120)
    row = _jobs(engine, sent.id)[0]
    assert row.state == "SUCCESS" and row.attempts >= 2
    assert out["rl_update"]["resumed"] is True
    assert out["rl_update"]["metrics"]["weights_sha256"] == _uninterrupted(steps, seed=5)
