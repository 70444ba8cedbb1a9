"""The reward-hacking guard and the drift trigger act inside the loop, end to end and checked by their
effect: a REAL Celery worker subprocess on the SQLite broker, and (for promotions) two CPU engine
processes behind the gateway with a weight store of v0, v1, v2.

- A version whose sessions the promoted reward model scores higher than the incumbent's while users
  retain less of their code is refused, at the canary gate and at an operator's promote: the pool
  stays on the old version and the reason is on the deployment and in the audit log. A version that
  is better on both counts is promoted.
- Shifting the reward model's scores on recent sessions makes the periodic trigger start a retrain
  (a new reward-model version is registered, the job's reason is ``drift``); without the shift,
  nothing starts.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scheduler_helpers import Worker, make_env, settings_for, wait_for
from sqlalchemy import func, select
from test_api_e2e import Load, Stack, deploy_stack

pytestmark = [pytest.mark.api_e2e, pytest.mark.slow]

HORIZONS = (300, 3600, 86400)
PROMPT = "Write merge_intervals(xs) for the billing service"
CODE = "def merge_intervals(xs):\n    return sorted(xs)\n"
PADDING = ("    # step one: sort\n", "    result = None\n", "    # now return it\n", "    value = 0\n", "    pass\n")


def _env(kind: str, session_id: str, at: datetime, payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "event_id": str(uuid.uuid4()),
        "type": kind,
        "occurred_at": at.isoformat().replace("+00:00", "Z"),
        "user_id": f"user-{abs(hash(session_id)) % 30}",
        "session_id": session_id,
        "payload": payload,
    }


def write_sessions(
    engine: Any,
    version: str,
    n: int,
    *,
    start: datetime,
    looks: tuple[float, float],
    kept: tuple[float, float] | None,
    seed: int,
) -> datetime:
    """``n`` sessions of ``version`` one minute apart from ``start``. ``looks``: the range of the
    quality their text shows (less padding and a surer logprob look better to a reward model trained
    on the base data); ``kept``: the range of the share of lines users retain at every horizon (None:
    the same as ``looks``). Returns the time of the last session."""
    from ingest.db import transaction
    from ingest.schemas import validate_event
    from ingest.writer import write_events

    rng = np.random.default_rng(seed)
    now = datetime.now(UTC)
    events: list[dict[str, Any]] = []
    at = start
    for i in range(n):
        at = start + timedelta(minutes=i)
        quality = float(rng.uniform(*looks))
        retained = quality if kept is None else float(rng.uniform(*kept))
        sid = f"s-{uuid.uuid4().hex}"
        padding = "".join(PADDING[: int(np.clip(round((0.8 - quality) * 8), 0, len(PADDING)))])
        payload = {
            "model": "undertow-coder",
            "policy_version": version,
            "prompt": {"text": PROMPT},
            "segments": [
                {"role": "user", "text": PROMPT},
                {
                    "role": "assistant",
                    "text": CODE + padding,
                    "token_ids": [1, 2, 3],
                    "logprobs": [float(-0.05 - (1 - quality) * 0.5), -0.2, -0.3],
                },
            ],
            "latency_ms": 120.0,
        }
        events.append(_env("session.completed", sid, at, payload))
        written = 20
        for h in HORIZONS:
            if at + timedelta(seconds=h) <= now:
                share = float(np.clip(retained + rng.normal(0, 0.03), 0, 1))
                body = {"horizon_s": h, "lines_written": written, "lines_retained": round(share * written)}
                events.append(_env("code.retained", sid, at + timedelta(seconds=h), body))
        accepted = retained + rng.normal(0, 0.05) > 0.5
        events.append(
            _env("edit.accepted" if accepted else "edit.rejected", sid, at + timedelta(seconds=20), {"lines": written})
        )
    with transaction(engine) as session:
        write_events(session, [validate_event(e) for e in events])
    return at


def base_and_reward_model(engine: Any, env: dict[str, str], n: int = 1000) -> tuple[str, datetime]:
    """Base sessions (text quality matches what users keep) four days ago, and a reward model trained
    and promoted on them; returns its version and the time of the newest base session."""
    from reward_models.train import train_reward_models

    start = datetime.now(UTC) - timedelta(days=4)
    last = write_sessions(engine, "base", n, start=start, looks=(0.15, 0.85), kept=None, seed=1)
    settings = settings_for(env)
    report = train_reward_models(engine, settings.rewards, Path(settings.home), until=last + timedelta(seconds=1))
    assert report.promoted, report.reason
    return report.version, last


# The reward-hacking guard at promotion --------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The deployment stack of ``test_api_e2e``, pool on v0, with telemetry where v1 looks better to the
    reward model but users keep less of it than of v0, and v2 is better on both."""

    def telemetry(engine: Any, env: dict[str, str]) -> None:
        base_and_reward_model(engine, env, n=400)
        start = datetime.now(UTC) - timedelta(days=2, hours=12)
        write_sessions(engine, "v0", 80, start=start, looks=(0.35, 0.55), kept=(0.4, 0.5), seed=2)
        write_sessions(engine, "v1", 80, start=start + timedelta(hours=2), looks=(0.75, 0.85), kept=(0.1, 0.2), seed=3)
        write_sessions(engine, "v2", 80, start=start + timedelta(hours=4), looks=(0.75, 0.85), kept=(0.7, 0.8), seed=4)

    yield from deploy_stack(tmp_path_factory.mktemp("guard"), None, "guard", telemetry)


def _running(stack: Stack, version: str) -> dict[str, Any]:
    def find() -> list[dict[str, Any]]:
        page = stack.client.get("/api/v1/deployments", params={"status": "running"}, headers=stack.headers).json()
        return [d for d in page["items"] if d["to_version"] == version]

    return wait_for(find, timeout=60, what=f"the {version} rollout running")[0]  # type: ignore[no-any-return]


def test_an_operator_promote_of_a_flagged_version_is_refused_with_the_reason(stack: Stack) -> None:
    r = stack.client.post("/api/v1/deployments", json={"version": "v1"}, headers=stack.headers)
    rollout_job = r.json()["id"]
    running = _running(stack, "v1")  # no traffic yet: its canary waits for a sample
    refused = stack.client.post(
        f"/api/v1/deployments/{running['id']}/promote", json={"reason": "looks fine"}, headers=stack.headers
    )
    assert refused.status_code == 409, refused.text
    assert "reward-hacking guard" in refused.json()["detail"] and "retention fell" in refused.json()["detail"]
    dep = stack.client.get(f"/api/v1/deployments/{running['id']}", headers=stack.headers).json()
    assert "refused by the reward-hacking guard" in dep["message"]

    def refusal() -> list[dict[str, Any]]:
        page = stack.client.get("/api/v1/audit", params={"action": "deployment.promote"}, headers=stack.headers)
        return [e for e in page.json()["items"] if e["detail"].get("deployment_id") == running["id"]]

    entry = wait_for(refusal, timeout=10, what="the audit entry of the refused promote")[0]
    assert entry["status_code"] == 409 and "reward-hacking guard" in entry["detail"]["refused"]
    # The pool never moved; the operator rolls the canary back.
    assert stack.target() == "v0"
    back = stack.client.post(f"/api/v1/deployments/{running['id']}/rollback", headers=stack.headers)
    assert back.status_code == 202, back.text
    assert stack.job(back.json()["id"])["state"] == "SUCCESS"
    assert stack.job(rollout_job)["state"] == "SUCCESS"
    assert stack.target() == "v0" and stack.served() == [("v0", stack.versions.hashes["v0"])] * 2
    after = stack.client.get(f"/api/v1/deployments/{running['id']}", headers=stack.headers).json()
    assert after["status"] == "rolled_back" and "refused by the reward-hacking guard" in after["message"]


def test_the_canary_gate_rolls_back_a_version_the_guard_flags(stack: Stack) -> None:
    v0 = [("v0", stack.versions.hashes["v0"])] * 2
    with Load(f"http://127.0.0.1:{stack.env['UNDERTOW_SERVING__GATEWAY_PORT']}"):
        r = stack.client.post("/api/v1/deployments", json={"version": "v1"}, headers=stack.headers)
        assert r.status_code == 202, r.text
        job = stack.job(r.json()["id"])
    assert job["state"] == "SUCCESS", job
    outcome = job["result"]["deployment"]
    assert outcome["status"] == "rolled_back" and outcome["target"] == "v0", outcome
    assert "reward-hacking guard" in outcome["message"]
    assert stack.target() == "v0" and stack.served() == v0
    dep = stack.client.get(f"/api/v1/deployments/{outcome['deployment_id']}", headers=stack.headers).json()
    assert dep["status"] == "rolled_back" and "refused by the reward-hacking guard" in dep["message"]
    canary = dep["stages"][0]
    assert canary["outcome"] == "failed" and canary["metrics"]["guard"]["flagged"] is True


def test_a_genuinely_better_version_is_promoted(stack: Stack) -> None:
    r = stack.client.post("/api/v1/deployments", json={"version": "v2"}, headers=stack.headers)
    rollout_job = r.json()["id"]
    running = _running(stack, "v2")
    promote = stack.client.post(f"/api/v1/deployments/{running['id']}/promote", headers=stack.headers)
    assert promote.status_code == 202, promote.text
    assert stack.job(promote.json()["id"])["state"] == "SUCCESS"
    assert stack.job(rollout_job)["state"] == "SUCCESS"
    assert stack.target() == "v2" and stack.served() == [("v2", stack.versions.hashes["v2"])] * 2
    dep = stack.client.get(f"/api/v1/deployments/{running['id']}", headers=stack.headers).json()
    assert dep["status"] == "succeeded" and "reward-hacking guard: no divergence" in dep["message"]


# The drift trigger --------------------------------------------------------------------------------


def test_drift_of_recent_scores_starts_a_reward_model_retrain(tmp_path: Path) -> None:
    from ingest.db import make_engine
    from reward_models.tables import RewardModelRow
    from scheduler.loop.app import make_celery
    from scheduler.tables import JobRow

    env = make_env(tmp_path)
    engine = make_engine(env["UNDERTOW_DATABASE_URL"])
    first, _ = base_and_reward_model(engine, env)
    worker = Worker(env, tmp_path / "worker.log", "drift")
    try:
        worker.wait_ready()
        celery = make_celery(settings_for(env))

        def check() -> dict[str, Any]:
            return celery.send_task("undertow.check_retrain").get(timeout=120)  # type: ignore[no-any-return]

        def reward_models() -> list[str]:
            with engine.connect() as conn:
                return list(conn.scalars(select(RewardModelRow.version)))

        def retrain_jobs() -> int:
            with engine.connect() as conn:
                return int(
                    conn.scalar(select(func.count()).select_from(JobRow).where(JobRow.name == "reward_model_retrain"))
                    or 0
                )

        # Recent sessions like the ones it was trained on: no drift, nothing starts.
        recent = datetime.now(UTC) - timedelta(hours=12)  # within the drift window (a day)
        write_sessions(engine, "base", 200, start=recent, looks=(0.15, 0.85), kept=None, seed=5)
        quiet = check()
        assert quiet["retrain"] is False and quiet["job_id"] is None, quiet
        assert quiet["details"]["drift"]["drifted"] is False
        assert reward_models() == [first] and retrain_jobs() == 0
        # Recent sessions whose scores all sit at the top of the reference: drift, a retrain starts.
        write_sessions(engine, "base", 200, start=recent + timedelta(hours=4), looks=(0.8, 0.85), kept=None, seed=6)
        fired = check()
        assert fired["retrain"] is True and fired["job_id"], fired
        assert fired["details"]["drift"]["drifted"] is True
        job = wait_for(
            lambda: (
                j
                if (j := _job(engine, fired["job_id"])) and j.state in ("SUCCESS", "FAILURE", "LOST", "REVOKED")
                else None
            ),
            timeout=180,
            what="the drift retrain",
        )
        assert job.state == "SUCCESS", job.error
        assert job.inputs["state"]["reason"] == "drift"
        result = job.outputs["reward_model"]
        assert result["retrained"] is True and any("score drift" in r for r in result["reasons"]), result
        assert set(reward_models()) == {first, result["version"]} and result["version"] != first
        # The retrain job is the one the trigger started, and only one.
        assert retrain_jobs() == 1
    finally:
        worker.stop()


def _job(engine: Any, job_id: str) -> Any:
    from sqlalchemy.orm import Session

    from scheduler.tables import JobRow

    with Session(engine) as s:
        row = s.get(JobRow, job_id)
        if row is not None:
            s.expunge(row)
        return row
