"""The control-plane API against the real database (SQLite and PostgreSQL): roles, data that
matches what was stored, filters, redaction of prompts and code, hostile input."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from api_helpers import SECRET_CODE, SECRET_PROMPT, Seeded, auth, make_settings
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ingest.db import session_factory
from ingest.tables import SessionRow, SignalRow

READ_PATHS = [
    "/api/v1/rewards/summary",
    "/api/v1/rewards/retention",
    "/api/v1/rewards/timeseries",
    "/api/v1/reward-models",
    "/api/v1/deployments/current",
    "/api/v1/deployments",
    "/api/v1/fleet/replicas",
    "/api/v1/fleet/states",
    "/api/v1/fleet/borrowing",
    "/api/v1/sessions",
    "/api/v1/jobs",
]


def test_health_and_metrics_need_no_token(client: TestClient) -> None:
    assert client.get("/health").json()["status"] == "ok"
    body = client.get("/metrics").text
    for name in (
        "undertow_ingest_lag_seconds",
        "undertow_ingest_events_per_second",
        "undertow_dead_letters",
        "undertow_jobs",
        "undertow_borrowed_replicas",
        "undertow_rollout_state",
    ):
        assert f"# TYPE {name} gauge" in body
    assert 'undertow_borrowed_replicas{pool="default"} 1.0' in body
    assert 'undertow_rollout_state{pool="default",state="running",version="v3"} 1.0' in body
    assert 'undertow_events_stored{type="session.completed"} 300.0' in body


def test_reads_need_a_valid_token(client: TestClient, tokens: dict[str, str], api_engine: Engine) -> None:
    from scheduler.api.auth import create_token, revoke_token

    name = f"gone-{uuid.uuid4().hex[:6]}"
    _, revoked = create_token(api_engine, name, "operator")
    assert revoke_token(api_engine, name)
    for path in READ_PATHS:
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=auth("ut_not-a-real-token")).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Basic dXNlcjpwYXNz"}).status_code == 401, path
        assert client.get(path, headers=auth(revoked)).status_code == 401, path
        assert client.get(path, headers=auth(tokens["viewer"])).status_code == 200, path


def test_rewards_match_the_stored_signals(client: TestClient, tokens: dict[str, str], api_engine: Engine) -> None:
    rows = client.get("/api/v1/rewards/summary", headers=auth(tokens["viewer"])).json()
    by = {(r["policy_version"], r["signal"], r["horizon_s"]): r for r in rows}
    with session_factory(api_engine)() as s:
        for version in ("v0", "v3"):
            edits = dict(
                s.execute(
                    select(SignalRow.type, func.count())
                    .join(SessionRow, SessionRow.session_id == SignalRow.session_id)
                    .where(SessionRow.policy_version == version, SignalRow.type.in_(("edit.accepted", "edit.rejected")))
                    .group_by(SignalRow.type)
                ).all()
            )
            acc = by[(version, "acceptance", None)]
            assert acc["n"] == sum(edits.values())
            assert acc["mean"] == pytest.approx(edits["edit.accepted"] / sum(edits.values()))
            assert acc["ci_low"] < acc["mean"] < acc["ci_high"]
        groups = s.scalar(select(func.count()).where(SignalRow.type == "candidate.selected"))
    # The users' hidden preference rises with the version: the API must show it.
    assert by[("v3", "retention", 300)]["mean"] > by[("v0", "retention", 300)]["mean"] + 0.1
    # Exactly one winner per selected group, whichever version it came from.
    wins = [r for r in rows if r["signal"] == "selection_win"]
    assert round(sum(r["mean"] * r["n"] for r in wins)) == groups
    curves = client.get("/api/v1/rewards/retention", headers=auth(tokens["viewer"])).json()
    assert {r["horizon_s"] for r in curves} == {300, 3600, 86400}


def test_timeseries_filters(client: TestClient, tokens: dict[str, str]) -> None:
    h = auth(tokens["viewer"])
    full = client.get("/api/v1/rewards/timeseries", params={"signal": "acceptance", "bucket_s": 3600}, headers=h).json()
    assert full["bucket_s"] == 3600 and {p["policy_version"] for p in full["points"]} == {"v0", "v1", "v2", "v3"}
    assert all(p["bucket_start"].endswith("Z") for p in full["points"])
    only = client.get(
        "/api/v1/rewards/timeseries", params={"signal": "acceptance", "policy_version": ["v1", "v2"]}, headers=h
    ).json()
    assert {p["policy_version"] for p in only["points"]} == {"v1", "v2"}
    cut = full["points"][len(full["points"]) // 2]["bucket_start"]
    later = client.get("/api/v1/rewards/timeseries", params={"signal": "acceptance", "since": cut}, headers=h).json()
    assert 0 < sum(p["n"] for p in later["points"]) < sum(p["n"] for p in full["points"])
    other = client.get("/api/v1/rewards/summary", params={"model": "no-such-model"}, headers=h).json()
    assert other == []
    bad = client.get(
        "/api/v1/rewards/summary", params={"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, headers=h
    )
    assert bad.status_code == 422
    assert client.get("/api/v1/rewards/timeseries", params={"signal": "vibes"}, headers=h).status_code == 422
    assert client.get("/api/v1/rewards/timeseries", params={"bucket_s": 1}, headers=h).status_code == 422


def test_viewers_never_see_prompts_or_code(client: TestClient, tokens: dict[str, str], app_factory) -> None:  # type: ignore[no-untyped-def]
    viewer, operator = auth(tokens["viewer"]), auth(tokens["operator"])
    page = client.get("/api/v1/sessions", params={"limit": 500}, headers=viewer).json()
    assert page["total"] == 300 and all(i["text_redacted"] and i["prompt"] is None for i in page["items"])
    one = page["items"][0]["session_id"]
    for path in [*READ_PATHS, f"/api/v1/sessions/{one}", "/metrics", "/"]:
        body = client.get(path, headers=viewer).text
        assert "SECRET-CODE-MARKER" not in body and SECRET_PROMPT not in body, path
    full = client.get(f"/api/v1/sessions/{one}", headers=operator).json()
    assert full["completion"].startswith(SECRET_CODE) and full["prompt"] == SECRET_PROMPT and not full["text_redacted"]
    with TestClient(app_factory(expose_text_to_viewers=True)) as c:
        assert c.get(f"/api/v1/sessions/{one}", headers=viewer).json()["completion"].startswith(SECRET_CODE)
    assert client.get("/api/v1/sessions/no-such-session", headers=viewer).status_code == 404


def test_reward_model_registry(client: TestClient, tokens: dict[str, str], seeded: Seeded) -> None:
    h = auth(tokens["viewer"])
    first, second = seeded.reward_models
    page = client.get("/api/v1/reward-models", headers=h).json()
    assert [i["version"] for i in page["items"]] == [second, first] and page["total"] == 2
    old, new = (client.get(f"/api/v1/reward-models/{v}", headers=h).json() for v in (first, second))
    # The first version beat the baselines and was promoted; the second did not beat it on the same hold-out.
    assert old["status"] == "promoted" and old["promoted_at"] is not None and old["n_labeled"] > 0
    assert new["status"] == "candidate" and first in new["reason"]
    assert old["window_end"] < new["window_end"] and new["n_labeled"] > old["n_labeled"]
    metrics = client.get(f"/api/v1/reward-models/{first}/metrics", headers=h).json()["metrics"]
    assert metrics and all(isinstance(k, str) for k in metrics)
    promoted = client.get("/api/v1/reward-models", params={"status": "promoted"}, headers=h).json()
    assert promoted["total"] == 1
    assert client.get(f"/api/v1/reward-models/{first}/lineage", headers=h).json()["chain"] == [first]
    chain = client.get(f"/api/v1/reward-models/{second}/lineage", headers=h).json()["chain"]
    assert chain == [first, second]
    assert client.get("/api/v1/reward-models/nope", headers=h).status_code == 404
    assert client.get("/api/v1/reward-models/nope/lineage", headers=h).status_code == 404


def test_reward_hacking_guard_reads_the_promoted_model(
    client: TestClient, tokens: dict[str, str], seeded: Seeded
) -> None:
    report = client.get("/api/v1/rewards/divergence", headers=auth(tokens["viewer"])).json()
    assert report["reward_model"] in seeded.reward_models
    versions = [v["policy_version"] for v in report["versions"]]
    assert versions == ["v0", "v1", "v2", "v3"]  # rollout order
    assert all(0.0 <= v["real"] <= 1.0 and v["n"] > 0 for v in report["versions"])
    # The seeded users' retention rises with each version: nothing to flag.
    assert report["flagged"] is False and "no divergence" in report["reason"]
    assert report["versions"][-1]["real"] > report["versions"][0]["real"]


def test_fleet_and_deployments(client: TestClient, tokens: dict[str, str]) -> None:
    h = auth(tokens["viewer"])
    assert len(client.get("/api/v1/fleet/replicas", headers=h).json()) == 3
    assert [r["id"] for r in client.get("/api/v1/fleet/replicas", params={"state": "borrowed"}, headers=h).json()] == [
        "cpu-2"
    ]
    states = {(s["state"], s["replicas"]) for s in client.get("/api/v1/fleet/states", headers=h).json()}
    assert states == {("serving", 2), ("borrowed", 1)}
    current = client.get("/api/v1/deployments/current", headers=h).json()
    assert current == [
        {
            "pool": "default",
            "version": "v3",
            "weights_hash": "h3",
            "replica_versions": {"v3": 3},
            "state": "running",
            "latest_deployment_id": 2,
        }
    ]
    dep = client.get("/api/v1/deployments/1", headers=h).json()
    assert dep["stages"][0]["name"] == "canary" and dep["status"] == "succeeded"
    assert client.get("/api/v1/deployments/999", headers=h).status_code == 404
    assert client.get("/api/v1/deployments", params={"status": "running"}, headers=h).json()["total"] == 1


def test_borrowing_timeline_and_policy_versions(client: TestClient, tokens: dict[str, str], seeded: Seeded) -> None:
    h = auth(tokens["viewer"])
    windows = client.get("/api/v1/fleet/borrowing", headers=h).json()
    assert len(windows) == seeded.borrow_windows >= 2
    assert all(w["replica"] == "cpu-2" and w["purpose"] == "training" and w["start"] < w["end"] for w in windows)
    late = client.get("/api/v1/fleet/borrowing", params={"since": windows[-1]["start"]}, headers=h).json()
    assert len(late) == 1
    assert client.get("/api/v1/fleet/borrowing", params={"pool": "elsewhere"}, headers=h).json() == []
    versions = client.get("/api/v1/policy-versions", headers=h).json()
    assert [v["version"] for v in versions["items"]] == ["v3", "v2", "v1", "v0"]
    assert [v["status"] for v in versions["items"]] == ["serving (default)", "trained", "trained", "trained"]
    assert [v["parent"] for v in versions["items"]] == ["v2", "v1", "v0", None]
    assert sum(v["info"]["sessions"] for v in versions["items"]) == seeded.sessions
    assert (
        client.get("/api/v1/policy-versions", params={"limit": 1, "offset": 3}, headers=h).json()["items"][0]["step"]
        == 0
    )
    metrics = client.get("/api/v1/policy-versions/v3/metrics", headers=h).json()["metrics"]
    assert metrics["eval/heldout_retention"] == 0.7 and metrics["loss/policy"] == 0.6
    assert metrics["online/acceptance"]["n"] > 0 and "online/retention@86400s" in metrics
    assert client.get("/api/v1/policy-versions/v3/lineage", headers=h).json()["chain"] == ["v0", "v1", "v2", "v3"]
    assert client.get("/api/v1/policy-versions/v9", headers=h).status_code == 404


def test_viewer_cannot_mutate_and_every_attempt_is_audited(client: TestClient, tokens: dict[str, str]) -> None:
    viewer, operator = auth(tokens["viewer"]), auth(tokens["operator"])
    calls = [
        ("/api/v1/retrains", {"kind": "reward_model", "window_hours": 24}),
        ("/api/v1/deployments", {"version": "v3", "pool": "default"}),
        ("/api/v1/deployments/2/promote", {}),
        ("/api/v1/deployments/2/rollback", {}),
        ("/api/v1/jobs/some-job/cancel", {}),
    ]
    for path, body in calls:
        assert client.post(path, json=body, headers=viewer).status_code == 403, path
        assert client.post(path, json=body).status_code == 401, path
    assert client.get("/api/v1/audit", headers=viewer).status_code == 403
    # A finished deployment cannot be promoted; a missing job cannot be cancelled.
    assert client.post("/api/v1/deployments/1/promote", json={}, headers=operator).status_code == 409
    assert client.post("/api/v1/jobs/no-such-job/cancel", headers=operator).status_code == 404
    log = client.get("/api/v1/audit", params={"limit": 500}, headers=operator).json()
    entries = log["items"]
    refused = [e for e in entries if e["actor"] == "test-viewer" and e["method"] == "POST"]
    assert len(refused) == len(calls) and all(e["status_code"] == 403 and e["role"] == "viewer" for e in refused)
    # A refused read is audited too.
    assert any(e["actor"] == "test-viewer" and e["method"] == "GET" and e["status_code"] == 403 for e in entries)
    anonymous = [e for e in entries if e["actor"] == "anonymous" and e["method"] == "POST" and e["path"] != "/login"]
    assert len(anonymous) == len(calls) and all(e["status_code"] == 401 for e in anonymous)
    ops = [(e["action"], e["status_code"], e["detail"]) for e in entries if e["actor"] == "test-operator"]
    assert ("deployment.promote", 409, {"deployment_id": 1}) in ops
    assert ("job.cancel", 404, {"job_id": "no-such-job"}) in ops
    assert all(e["occurred_at"].endswith("Z") for e in entries)


def test_hostile_and_malformed_input(client: TestClient, tokens: dict[str, str]) -> None:
    h = auth(tokens["operator"])
    assert (
        client.post(
            "/api/v1/retrains", content=b"{not json", headers={**h, "Content-Type": "application/json"}
        ).status_code
        == 422
    )
    assert client.post("/api/v1/retrains", json={"kind": "reward_model", "extra": 1}, headers=h).status_code == 422
    assert client.post("/api/v1/retrains", json={"kind": "nuke"}, headers=h).status_code == 422
    both = {"kind": "rl_run", "since": "2026-01-01T00:00:00Z", "window_hours": 3}
    assert client.post("/api/v1/retrains", json=both, headers=h).status_code == 422
    backwards = {"kind": "rl_run", "since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}
    assert client.post("/api/v1/retrains", json=backwards, headers=h).status_code == 422
    overflow = {"kind": "rl_run", "since": "0001-01-01T00:00:00+05:00"}
    assert client.post("/api/v1/retrains", json=overflow, headers=h).status_code == 422
    for path in (
        "/api/v1/sessions/%00",
        "/api/v1/reward-models/%1b%5b31m",
        "/api/v1/deployments/-1",
        "/api/v1/jobs/" + "x" * 300,
    ):
        assert 400 <= client.get(path, headers=h).status_code < 500, path
    assert client.get("/api/v1/sessions", params={"limit": 10**6}, headers=h).status_code == 422
    assert client.get("/api/v1/sessions", params={"model": "a\x00b"}, headers=h).status_code == 422
    assert client.get("/api/v1/sessions", params={"since": "yesterday"}, headers=h).status_code == 422
    assert client.get("/api/v1/rewards/summary", params={"policy_version": "\x00"}, headers=h).status_code == 422


def test_oversized_bodies_are_refused(client: TestClient, tokens: dict[str, str]) -> None:
    h = auth(tokens["operator"])
    big = {"kind": "reward_model", "reason": "x" * 70_000}
    r = client.post("/api/v1/retrains", json=big, headers=h)
    assert r.status_code == 413 and "limit is 65536 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit counts the streamed bytes
        for _ in range(20):
            yield b" " * 8192

    r = client.post("/api/v1/retrains", content=chunks(), headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 413


def test_rate_limit_per_token(app_factory, tokens: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    with TestClient(app_factory(rate_limit_per_minute=1, rate_limit_burst=5)) as c:
        codes = [c.get("/api/v1/fleet/states", headers=auth(tokens["viewer"])).status_code for _ in range(7)]
        assert codes[:5] == [200] * 5 and codes[5:] == [429, 429]
        limited = c.get("/api/v1/fleet/states", headers=auth(tokens["viewer"]))
        assert limited.status_code == 429 and 1 <= int(limited.headers["retry-after"]) <= 60
        # Another token has its own bucket; static assets are never limited.
        assert c.get("/api/v1/fleet/states", headers=auth(tokens["operator"])).status_code == 200
        assert c.get("/static/style.css").status_code == 200


def test_retrains_and_rollouts_queue_typed_jobs_on_real_celery_messages(
    client: TestClient, tokens: dict[str, str], api_engine: Engine
) -> None:
    from sqlalchemy import text

    op, viewer = auth(tokens["operator"]), auth(tokens["viewer"])
    jobs_before = client.get("/api/v1/jobs", headers=viewer).json()["total"]
    with api_engine.connect() as conn:
        queued_before = conn.execute(text("SELECT count(*) FROM kombu_message")).scalar() if _has_kombu(conn) else 0
    r = client.post(
        "/api/v1/retrains", json={"kind": "reward_model", "window_hours": 24, "reason": "drift"}, headers=op
    )
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["kind"] == "reward_model_retrain" and job["state"] == "PENDING"
    state = job["params"]  # the typed LoopState its first step receives
    assert state["force"] is False and state["requested_by"] == "test-operator" and state["reason"] == "drift"
    since, until = (datetime.fromisoformat(state["window"][k]) for k in ("since", "until"))
    assert until - since == timedelta(hours=24)
    assert [s["name"] for s in job["steps"]] == ["undertow.retrain"] and job["steps"][0]["state"] == "PENDING"
    assert client.get(f"/api/v1/jobs/{job['id']}", headers=viewer).json()["id"] == job["id"]
    rl = client.post("/api/v1/retrains", json={"kind": "rl_run", "since": "2026-01-01T00:00:00Z"}, headers=op).json()
    assert rl["kind"] == "rl_update" and rl["params"]["window"]["since"].startswith("2026-01-01")
    assert [s["name"] for s in rl["steps"]] == ["undertow.rl_update", "undertow.snapshot", "undertow.rollout"]
    rollout = client.post("/api/v1/deployments", json={"version": "v3", "pool": "default"}, headers=op)
    assert rollout.status_code == 202 and rollout.json()["params"]["version"] == "v3"
    promote = client.post("/api/v1/deployments/2/promote", json={"reason": "canary is fine"}, headers=op).json()
    assert promote["kind"] == "promote" and promote["params"]["deployment_id"] == 2
    back = client.post("/api/v1/deployments/2/rollback", headers=op).json()
    assert back["kind"] == "rollback" and back["params"]["version"] == "v2"
    page = client.get("/api/v1/jobs", params={"limit": 500}, headers=viewer).json()
    assert page["total"] == jobs_before + 5
    mine = {j["id"] for j in page["items"]} & {job["id"], rl["id"], rollout.json()["id"], promote["id"], back["id"]}
    assert len(mine) == 5
    retrains = client.get("/api/v1/jobs", params={"kind": "reward_model_retrain", "limit": 500}, headers=viewer).json()
    assert job["id"] in {j["id"] for j in retrains["items"]} and rl["id"] not in {j["id"] for j in retrains["items"]}
    # Each job's first task is a message waiting on the broker (the SQLAlchemy transport on this database).
    with api_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM kombu_message")).scalar() == queued_before + 5
    cancelled = client.post(f"/api/v1/jobs/{job['id']}/cancel", json={"reason": "wrong window"}, headers=op)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "REVOKED"
    assert client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=op).status_code == 409
    assert 'undertow_jobs{kind="reward_model_retrain",state="REVOKED"}' in client.get("/metrics").text
    audit = client.get("/api/v1/audit", params={"action": "retrain.create"}, headers=op).json()["items"]
    accepted = [e for e in audit if e["status_code"] == 202]
    assert {e["detail"]["job_id"] for e in accepted} == {job["id"], rl["id"]}
    assert all(e["actor"] == "test-operator" and e["detail"]["kind"] for e in accepted)


def _has_kombu(conn: object) -> bool:
    from sqlalchemy import inspect

    return "kombu_message" in inspect(conn).get_table_names()


def test_login_logout_are_audited_and_the_cookie_only_reads(client: TestClient, tokens: dict[str, str]) -> None:
    client.cookies.clear()
    client.get("/login")
    csrf = client.cookies["undertow_csrf"]  # the forms' double-submit token (tests/scheduler/api/test_api_edges.py)
    bad = client.post("/login", data={"token": "ut_nope", "next": "/fleet", "csrf_token": csrf}, follow_redirects=False)
    assert bad.status_code == 401 and "Unknown or revoked token" in bad.text
    good = client.post(
        "/login",
        data={"token": tokens["viewer"], "next": "https://evil.example/", "csrf_token": csrf},
        follow_redirects=False,
    )
    assert good.status_code == 303 and good.headers["location"] == "/"
    cookie = good.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert client.get("/fleet").status_code == 200  # the cookie reads dashboards
    # ... but never authorizes an API call, not even for an operator's token.
    client.cookies.clear()
    client.cookies.set("undertow_session", tokens["operator"])
    client.cookies.set("undertow_csrf", csrf)
    assert client.post("/api/v1/retrains", json={"kind": "reward_model"}).status_code == 401
    assert client.get("/api/v1/fleet/states").status_code == 401
    out = client.post("/logout", data={"csrf_token": csrf}, follow_redirects=False)
    assert out.status_code == 303 and 'undertow_session=""' in out.headers["set-cookie"]
    client.cookies.clear()
    assert client.get("/fleet", follow_redirects=False).headers["location"] == "/login?next=%2Ffleet"
    entries = client.get("/api/v1/audit", params={"limit": 500}, headers=auth(tokens["operator"])).json()["items"]
    logins = [(e["action"], e["actor"], e["status_code"]) for e in entries if e["action"] in ("login", "logout")]
    assert ("login", "anonymous", 401) in logins and ("login", "test-viewer", 303) in logins
    assert ("logout", "test-operator", 303) in logins


def test_policy_versions_read_the_weight_store(
    tmp_path: Path, shared_url: str, api_engine: Engine, tokens: dict[str, str]
) -> None:
    """Versions in the weight store (written by the policy layer's own store) join the list with
    their hash; one the trainer never recorded appears with the store's parent and step."""
    import torch

    from policy.weights import open_store
    from scheduler.api.app import create_app

    app = create_app(make_settings(tmp_path, shared_url), engine=api_engine)  # a home (and store) of its own
    settings = app.state.settings
    store = open_store(settings.policy, settings.home)  # the trainer's store: it signs with the home's key
    torch.manual_seed(0)
    base = {"w": torch.randn(4, 4, dtype=torch.bfloat16)}
    store.put(base, version="v3", parent=None, full=True, meta={"step": 30})
    store.put({"w": base["w"] + 1}, version="v4-hotfix", parent="v3", meta={"step": 31})
    with TestClient(app) as c:
        h = auth(tokens["viewer"])
        v3 = c.get("/api/v1/policy-versions/v3", headers=h).json()
        assert v3["info"]["weights"]["has_full"] and len(v3["info"]["weights"]["version_hash"]) > 16
        hotfix = c.get("/api/v1/policy-versions/v4-hotfix", headers=h).json()
        assert hotfix["parent"] == "v3" and hotfix["step"] == 31 and hotfix["status"] == "stored"
        chain = c.get("/api/v1/policy-versions/v4-hotfix/lineage", headers=h).json()["chain"]
        assert chain == ["v0", "v1", "v2", "v3", "v4-hotfix"]
