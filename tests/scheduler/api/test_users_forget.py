"""Forgetting a user through the API and the command line: the user's rows are gone, other users' kept,
the versions trained on them flagged (and only those), late events dropped, the call audited without
the id; malformed, oversized, duplicate and hostile requests refused or harmless."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from api_helpers import auth, make_settings
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from ingest.db import transaction
from ingest.schemas import validate_event
from ingest.tables import SessionRow, SignalRow
from ingest.writer import write_events
from policy.tables import PolicyVersionRow
from reward_models.tables import RewardModelRow
from scheduler.api.tables import AuditRow

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def _session(user: str, n: int, at: datetime) -> list[dict[str, object]]:
    sid = f"s-{user}-{n}"
    base = {"schema_version": 1, "occurred_at": at.isoformat(), "user_id": user, "session_id": sid}
    payload = {
        "model": "m",
        "policy_version": "v0",
        "prompt": {"text": "p"},
        "segments": [{"role": "assistant", "text": "def f(): pass"}],
    }
    return [
        {**base, "event_id": f"e-{sid}", "type": "session.completed", "payload": payload},
        {**base, "event_id": f"t-{sid}", "type": "feedback.thumbs", "payload": {"value": 1}},
    ]


def _seed(engine: Engine) -> None:
    events = _session("alice", 1, T0) + _session("alice", 2, T0 + timedelta(days=1)) + _session("bob", 1, T0)
    with transaction(engine) as session:
        write_events(session, [validate_event(e) for e in events])
        received = datetime.now(UTC)
        for version, start, end, created in (
            ("rm-covers", T0 - timedelta(days=1), T0 + timedelta(hours=1), received + timedelta(hours=1)),
            ("rm-before", T0 - timedelta(days=9), T0 - timedelta(days=8), received + timedelta(hours=1)),
            ("rm-older", T0 - timedelta(days=1), T0 + timedelta(days=2), received - timedelta(days=1)),
        ):
            session.add(
                RewardModelRow(
                    version=version,
                    created_at=created,
                    backend="sk",
                    status="candidate",
                    reason="",
                    artifact_sha256="0" * 64,
                    artifact_path="x",
                    window_start=start,
                    window_end=end,
                    n_labeled=10,
                    config={},
                    metrics={},
                    reference_scores=[],
                )
            )
        for version, parent, start, end in (
            ("p1", None, T0 + timedelta(hours=12), T0 + timedelta(days=2)),
            ("p2", "p1", T0 + timedelta(days=5), T0 + timedelta(days=6)),
            ("p-other", None, T0 - timedelta(days=9), T0 - timedelta(days=8)),
            ("p-offline", None, None, None),
        ):
            session.add(
                PolicyVersionRow(
                    version_id=version,
                    parent_id=parent,
                    step=1,
                    data_start=start,
                    data_end=end,
                    num_samples=1,
                    num_dropped_stale=0,
                    metrics={},
                    checkpoint_path="x",
                    created_at=received + timedelta(hours=1),
                )
            )


def _count(engine: Engine, user: str) -> tuple[int, int]:
    with transaction(engine) as session:
        sessions = session.scalar(select(func.count()).select_from(SessionRow).where(SessionRow.user_id == user))
        signals = session.scalar(select(func.count()).select_from(SignalRow).where(SignalRow.user_id == user))
    return int(sessions or 0), int(signals or 0)


@pytest.fixture
def app_client(engine: Engine, tmp_path: Path, migrated_db: str):  # type: ignore[no-untyped-def]
    from scheduler.api.app import create_app
    from scheduler.api.auth import create_token

    _seed(engine)
    tokens = {role: create_token(engine, f"u-{role}", role)[1] for role in ("viewer", "operator")}
    with TestClient(create_app(make_settings(tmp_path, migrated_db), engine=engine)) as c:
        yield c, tokens


def test_forget_through_the_api(app_client, engine: Engine) -> None:  # type: ignore[no-untyped-def]
    from ingest.forget import user_hash

    c, tokens = app_client
    assert c.post("/api/v1/users/forget", json={"user_id": "alice"}, headers=auth(tokens["viewer"])).status_code == 403
    assert c.post("/api/v1/users/forget", json={"user_id": "alice"}).status_code == 401
    bad_ids = ({"user_id": ""}, {"user_id": "x" * 129}, {"user_id": "ali\u0000ce"}, {"user_id": 7})
    for bad in (*bad_ids, {"user_id": "alice", "also": 1}, {}):
        assert c.post("/api/v1/users/forget", json=bad, headers=auth(tokens["operator"])).status_code == 422
    assert _count(engine, "alice") == (2, 2)

    out = c.post("/api/v1/users/forget", json={"user_id": "alice"}, headers=auth(tokens["operator"]))
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["deleted"]["sessions"] == 2 and body["deleted"]["signals"] == 2
    assert body["flagged"] == {"reward_models": ["rm-covers"], "policy_versions": ["p1", "p2"]}
    assert _count(engine, "alice") == (0, 0) and _count(engine, "bob") == (1, 1)
    with transaction(engine) as session:
        flags = dict(session.execute(select(RewardModelRow.version, RewardModelRow.trained_on_forgotten)).all())
        assert flags == {"rm-covers": 1, "rm-before": 0, "rm-older": 0}
        policy = dict(session.execute(select(PolicyVersionRow.version_id, PolicyVersionRow.trained_on_forgotten)).all())
        assert policy == {"p1": 1, "p2": 1, "p-other": 0, "p-offline": 0}
        entry = session.scalar(select(AuditRow).where(AuditRow.action == "user.forget", AuditRow.status_code == 200))
        assert entry is not None and entry.actor == "u-operator"
        assert entry.detail["user_hash"] == user_hash("alice") and "alice" not in json.dumps(entry.detail)

    again = c.post("/api/v1/users/forget", json={"user_id": "alice"}, headers=auth(tokens["operator"]))
    assert again.status_code == 200 and sum(again.json()["deleted"].values()) == 0
    with transaction(engine) as session:  # a duplicate forget flags nothing twice
        assert (
            session.scalar(select(RewardModelRow.trained_on_forgotten).where(RewardModelRow.version == "rm-covers"))
            == 1
        )

    with transaction(engine) as session:  # a late event of alice is dropped and counted
        result = write_events(session, [validate_event(e) for e in _session("alice", 3, T0 + timedelta(days=3))])
    assert result.dropped == 2 and _count(engine, "alice") == (0, 0)
    listed = c.get("/api/v1/users/forgotten", headers=auth(tokens["operator"])).json()
    assert [(t["user_hash"], t["dropped_events"]) for t in listed] == [(user_hash("alice"), 2)]
    assert c.get("/api/v1/users/forgotten", headers=auth(tokens["viewer"])).status_code == 403

    hostile = c.post("/api/v1/users/forget", json={"user_id": "' OR 1=1 --"}, headers=auth(tokens["operator"]))
    assert hostile.status_code == 200 and _count(engine, "bob") == (1, 1)


def test_users_forget_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ingest.db import make_engine, upgrade
    from scheduler.cli import app

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    upgrade(url)
    engine = make_engine(url)
    _seed(engine)
    monkeypatch.setenv("UNDERTOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("UNDERTOW_DATABASE_URL", url)
    runner = CliRunner()
    out = runner.invoke(app, ["users", "forget", "bob", "--json"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.stdout.strip().splitlines()[-1])
    assert body["deleted"]["sessions"] == 1 and body["flagged"]["reward_models"] == ["rm-covers"]
    assert _count(engine, "bob") == (0, 0) and _count(engine, "alice") == (2, 2)
    listed = runner.invoke(app, ["users", "forgotten", "--json"])
    assert listed.exit_code == 0 and len(json.loads(listed.stdout.strip().splitlines()[-1])["forgotten"]) == 1
    assert runner.invoke(app, ["users", "forget", "x" * 129]).exit_code != 0
    engine.dispose()
