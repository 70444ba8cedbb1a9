"""Every API action end to end, checked by its effect: the API in process, a REAL Celery worker
subprocess on the SQLite broker, two CPU engine processes, the gateway on loopback and a weight
store with versions v0, v1, v2. A rollout, promotion or rollback is judged by the pool's target and
by the version and hash each replica reports; a retrain by what the new model was trained on; a
cancel by the steps that never ran."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from scheduler_helpers import Worker, make_env, settings_for, wait_for
from sqlalchemy import func, select

pytestmark = [pytest.mark.api_e2e, pytest.mark.slow]


class Stack:
    """What one module's tests share."""

    def __init__(self, env: dict[str, str], engine: Any, client: Any, token: str, versions: Any, urls: list[str]):
        self.env, self.engine, self.client, self.versions, self.urls = env, engine, client, versions, urls
        self.headers = {"Authorization": f"Bearer {token}"}

    def job(self, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
        """Wait for the job to finish; its final form."""

        def done() -> dict[str, Any] | None:
            job = self.client.get(f"/api/v1/jobs/{job_id}", headers=self.headers).json()
            return job if job["state"] in ("SUCCESS", "FAILURE", "REVOKED", "LOST") else None

        return wait_for(done, timeout=timeout, every=0.5, what=f"job {job_id}")  # type: ignore[no-any-return]

    def served(self) -> list[tuple[str, str]]:
        """(version, hash) each engine reports, read from the engines themselves."""
        from serving_helpers import CONTROL_TOKEN

        from serving.client import EngineClient

        async def read() -> list[tuple[str, str]]:
            out = []
            for url in self.urls:
                async with EngineClient(url, token=CONTROL_TOKEN) as c:
                    info = await c.weight_info()
                out.append((info.version, info.hash))
            return out

        return asyncio.run(read())

    def target(self) -> str | None:
        from serving.fleet import get_target

        row = get_target(self.engine)
        return row.version if row else None


class Load:
    """Bounded loopback requests through the gateway, so a stage's gate has a sample."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            for _ in range(2000):
                if self.stop.is_set():
                    return
                c.post(self.url + "/v1/completions", json={"prompt": "def add", "max_tokens": 2})

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def deploy_stack(
    root: Path, url: str | None, name: str, prepare: Callable[[Any, dict[str, str]], None] | None = None
) -> Iterator[Stack]:
    """API in process, a real Celery worker, two CPU engines behind the gateway, the pool on v0 (``url``: a
    PostgreSQL database, else SQLite); ``prepare(engine, env)`` runs on the migrated database first."""
    from fastapi.testclient import TestClient
    from serving_helpers import CONTROL_TOKEN, make_versions

    from ingest.db import make_engine
    from ingest.embedded import free_port
    from scheduler.api.app import create_app
    from scheduler.api.auth import create_token
    from serving import fleet
    from serving.config import FleetConfig, GatewayConfig
    from serving.gateway import Gateway, create_gateway_app, health_loop, registry_source
    from serving.launch import ServerThread

    versions = make_versions(root / "weights")
    port = free_port()
    env = {
        **make_env(root, url),
        **versions.env(),  # the store's signing key, its public key, the engines' control token
        "UNDERTOW_POLICY__WEIGHTS_URL": str(versions.store),
        "UNDERTOW_SERVING__GATEWAY_PORT": str(port),
        "UNDERTOW_SERVING__DEPLOY__CANARY_REPLICAS": "1",
        "UNDERTOW_SERVING__DEPLOY__STAGES": "[1.0]",
        "UNDERTOW_SERVING__DEPLOY__GATE_MIN_REQUESTS": "3",
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_WAIT_S": "90",
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_LATENCY_RATIO": "50",
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_ERROR_RATE_DELTA": "1.0",
        "UNDERTOW_SERVING__DEPLOY__STALE_AFTER_S": "60",
    }
    engine = make_engine(env["UNDERTOW_DATABASE_URL"])
    if prepare is not None:
        prepare(engine, env)
    procs = versions.start_engines(2, root)
    health = FleetConfig(health_interval_s=0.5, health_timeout_s=2.0, unhealthy_after=1, control_token=CONTROL_TOKEN)
    for i, p in enumerate(procs):
        fleet.register_replica(engine, f"r{i}", p.url)
    fleet.set_target(engine, "v0", versions.hashes["v0"])
    asyncio.run(fleet.check_fleet(engine, health))
    gw = Gateway(registry_source(engine, "default", 0.2), None, GatewayConfig(), "undertow-policy")
    worker = Worker(env, root / "worker.log", name)
    try:
        with ServerThread(create_gateway_app(gw, [health_loop(engine, health, "default")]), port=port):
            worker.wait_ready()
            settings = settings_for(env, api={"rate_limit_per_minute": 100_000, "rate_limit_burst": 10_000})
            token = create_token(engine, f"{name}-operator", "operator")[1]
            with TestClient(create_app(settings, engine=engine)) as client:
                yield Stack(env, engine, client, token, versions, [p.url for p in procs])
    finally:
        worker.stop()
        for p in procs:
            p.kill()


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack on SQLite, then on PostgreSQL (database and Celery broker alike)."""
    url = request.getfixturevalue("module_pg_url") if request.param == "postgres" else None
    yield from deploy_stack(tmp_path_factory.mktemp("e2e"), url, "e2e")


def test_rollout_moves_every_replica_and_a_redelivered_rollout_changes_nothing(stack: Stack) -> None:
    gateway = f"http://127.0.0.1:{stack.env['UNDERTOW_SERVING__GATEWAY_PORT']}"
    with Load(gateway):
        r = stack.client.post("/api/v1/deployments", json={"version": "v1"}, headers=stack.headers)
        assert r.status_code == 202, r.text
        job = stack.job(r.json()["id"])
    assert job["state"] == "SUCCESS", job
    deployment = job["result"]["deployment"]
    assert deployment["status"] == "succeeded" and deployment["target"] == "v1"
    assert stack.target() == "v1"
    assert stack.served() == [("v1", stack.versions.hashes["v1"])] * 2
    # The same rollout delivered again (a redelivery) applies nothing twice.
    from scheduler.loop.app import make_celery
    from scheduler.tables import JobRow
    from serving.tables import DeploymentRow

    again = make_celery(settings_for(stack.env)).send_task("undertow.rollout", args=(job["params"],)).get(timeout=60)
    assert again["deployment"]["status"] == "unchanged"
    with stack.engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(DeploymentRow).where(DeploymentRow.to_version == "v1")) == 1
        assert conn.scalar(select(func.count()).select_from(JobRow).where(JobRow.name == "rollout")) == 1


def test_rollback_returns_the_pool_to_the_previous_version(stack: Stack) -> None:
    dep = stack.client.get("/api/v1/deployments", params={"status": "succeeded"}, headers=stack.headers).json()
    (latest,) = [d for d in dep["items"] if d["to_version"] == "v1"]
    r = stack.client.post(f"/api/v1/deployments/{latest['id']}/rollback", json={"reason": "e2e"}, headers=stack.headers)
    assert r.status_code == 202, r.text
    job = stack.job(r.json()["id"])
    assert job["state"] == "SUCCESS", job
    assert stack.target() == "v0"
    assert stack.served() == [("v0", stack.versions.hashes["v0"])] * 2
    after = stack.client.get(f"/api/v1/deployments/{latest['id']}", headers=stack.headers).json()
    assert after["status"] == "rolled_back"
    again = stack.client.post(f"/api/v1/deployments/{latest['id']}/rollback", headers=stack.headers)
    assert again.status_code == 409


def test_promote_skips_the_waiting_gates_and_cancel_stops_a_queued_job(stack: Stack) -> None:
    # No traffic: the canary's gate waits for its sample, so the deployment stays running.
    r = stack.client.post("/api/v1/deployments", json={"version": "v2"}, headers=stack.headers)
    rollout_job = r.json()["id"]
    running = wait_for(
        lambda: [
            d
            for d in stack.client.get(
                "/api/v1/deployments", params={"status": "running"}, headers=stack.headers
            ).json()["items"]
            if d["to_version"] == "v2"
        ],
        timeout=60,
        what="the v2 rollout running",
    )[0]
    # The single worker is busy with that rollout: this job waits in the queue, then is cancelled.
    queued = stack.client.post("/api/v1/deployments", json={"version": "v1"}, headers=stack.headers).json()["id"]
    cancelled = stack.client.post(f"/api/v1/jobs/{queued}/cancel", headers=stack.headers)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "REVOKED"
    promote = stack.client.post(f"/api/v1/deployments/{running['id']}/promote", headers=stack.headers)
    assert promote.status_code == 202, promote.text
    assert stack.job(rollout_job)["state"] == "SUCCESS"
    assert stack.job(promote.json()["id"])["state"] == "SUCCESS"
    assert stack.target() == "v2"
    assert stack.served() == [("v2", stack.versions.hashes["v2"])] * 2
    done = stack.client.get(f"/api/v1/deployments/{running['id']}", headers=stack.headers).json()
    assert done["status"] == "succeeded"
    assert [s["outcome"] for s in done["stages"]] == ["passed"] * len(done["stages"])
    # The cancelled job never ran: its step stayed unstarted, and nothing moved to v1.
    time.sleep(3.0)
    job = stack.client.get(f"/api/v1/jobs/{queued}", headers=stack.headers).json()
    assert job["state"] == "REVOKED" and [s["state"] for s in job["steps"]] == ["REVOKED"]
    assert stack.target() == "v2" and stack.served() == [("v2", stack.versions.hashes["v2"])] * 2
    assert stack.client.post(f"/api/v1/jobs/{queued}/cancel", headers=stack.headers).status_code == 409


def test_reward_model_retrain_trains_on_exactly_the_window(stack: Stack) -> None:
    from api_helpers import seed_telemetry

    from ingest.tables import SessionRow
    from reward_models.tables import RewardModelRow

    seeded = seed_telemetry(stack.engine, n_sessions=400)
    since = seeded.start + timedelta(hours=12)
    until = seeded.end - timedelta(hours=6)
    body = {"kind": "reward_model", "since": since.isoformat(), "until": until.isoformat(), "force": True}
    r = stack.client.post("/api/v1/retrains", json=body, headers=stack.headers)
    job = stack.job(r.json()["id"], timeout=300)
    assert job["state"] == "SUCCESS", job
    outcome = job["result"]["reward_model"]
    assert outcome["retrained"] is True and outcome["reasons"] == ["forced by the job"]
    with stack.engine.connect() as conn:
        row = conn.execute(select(RewardModelRow).where(RewardModelRow.version == outcome["version"])).one()
        in_window = conn.scalar(
            select(func.count())
            .select_from(SessionRow)
            .where(SessionRow.occurred_at >= since, SessionRow.occurred_at < until)
        )
    assert since <= row.window_start and row.window_end < until  # nothing from outside the window
    assert outcome["n_train"] + outcome["n_holdout"] == in_window  # and everything inside it
    # Without force, the triggers decide: nothing new arrived since, so nothing is retrained.
    body.pop("force")
    quiet = stack.job(stack.client.post("/api/v1/retrains", json=body, headers=stack.headers).json()["id"])
    assert quiet["state"] == "SUCCESS" and quiet["result"]["reward_model"]["retrained"] is False
    # The forced job's step delivered again (a worker died before acknowledging it) trains nothing new.
    from scheduler.loop.app import make_celery

    count = select(func.count()).select_from(RewardModelRow)
    with stack.engine.connect() as conn:
        versions_before = conn.scalar(count)
    again = make_celery(settings_for(stack.env)).send_task("undertow.retrain", args=(job["params"],)).get(timeout=120)
    assert again["reward_model"]["version"] == outcome["version"]
    with stack.engine.connect() as conn:
        assert conn.scalar(count) == versions_before
