"""``/api/v1/gateway-keys`` and ``undertow gateway-keys``: operators create, list and revoke the
gateway's client keys; a key created through the API is accepted by a gateway on the same database,
and refused once revoked. Viewers, bad bodies and unknown names get clear 4xx; every call is audited
without the key in it."""

from __future__ import annotations

import asyncio
import json
import uuid

from api_helpers import auth
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine


def test_operators_manage_keys_the_gateway_honours(
    client: TestClient, tokens: dict[str, str], api_engine: Engine
) -> None:
    from serving.keys import KeyRing

    name = f"plugin-{uuid.uuid4().hex[:6]}"
    assert client.post("/api/v1/gateway-keys", json={"name": name}, headers=auth(tokens["viewer"])).status_code == 403
    created = client.post(
        "/api/v1/gateway-keys",
        json={"name": name, "scopes": ["serve", "metrics"], "user_id": "ann", "rate_per_s": 3},
        headers=auth(tokens["operator"]),
    )
    assert created.status_code == 201, created.text
    key = created.json()["key"]
    assert key.startswith("ugw_") and created.json()["user_id"] == "ann"
    again = client.post("/api/v1/gateway-keys", json={"name": name}, headers=auth(tokens["operator"]))
    assert again.status_code == 409 and "exists already" in again.json()["detail"]
    for bad in (
        {"name": ""},
        {"name": "x", "scopes": ["admin"]},
        {"name": "x", "rate_per_s": 0},
        {"name": "x", "z": 1},
    ):
        assert client.post("/api/v1/gateway-keys", json=bad, headers=auth(tokens["operator"])).status_code == 422

    listed = client.get("/api/v1/gateway-keys", headers=auth(tokens["operator"])).json()
    row = next(k for k in listed if k["name"] == name)
    assert "key" not in row and row["prefix"] == key[:10] and row["revoked_at"] is None
    assert all(key not in json.dumps(k) for k in listed)

    ring = KeyRing(api_engine, refresh_s=0.0)
    found = asyncio.run(ring.lookup(key))
    assert found is not None and found.user_id == "ann" and found.rate_per_s == 3.0

    assert client.delete(f"/api/v1/gateway-keys/{name}", headers=auth(tokens["operator"])).status_code == 204
    assert client.delete(f"/api/v1/gateway-keys/{name}", headers=auth(tokens["operator"])).status_code == 404
    assert asyncio.run(ring.lookup(key)) is None

    audit = client.get("/api/v1/audit", params={"action": "gateway_key.create"}, headers=auth(tokens["operator"]))
    entries = [e for e in audit.json()["items"] if e["detail"].get("name") == name]
    assert entries and all(key not in json.dumps(e) for e in entries)


def test_cli_creates_lists_and_revokes(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from scheduler.cli import app

    monkeypatch.setenv("UNDERTOW_HOME", str(tmp_path))
    monkeypatch.delenv("UNDERTOW_DATABASE_URL", raising=False)
    runner = CliRunner()
    made = runner.invoke(app, ["gateway-keys", "create", "ci-bot", "--scope", "metrics", "--json"])
    assert made.exit_code == 0, made.output
    key = json.loads(made.stdout.strip().splitlines()[-1])["key"]
    listed = runner.invoke(app, ["gateway-keys", "list", "--json"])
    assert "ci-bot" in listed.stdout and key not in listed.stdout
    bad = runner.invoke(app, ["gateway-keys", "create", "x", "--scope", "root"])
    assert bad.exit_code != 0 and "scopes must be" in bad.output
    assert runner.invoke(app, ["gateway-keys", "revoke", "ci-bot"]).exit_code == 0
    gone = runner.invoke(app, ["gateway-keys", "revoke", "ci-bot"])
    assert gone.exit_code != 0 and "no active gateway key" in gone.output
