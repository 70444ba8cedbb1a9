"""``undertow tokens`` and ``undertow api --help``: create (shown once, stored hashed), list,
revoke; bad roles and duplicate names are refused with a message that says what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("UNDERTOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("UNDERTOW_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_tokens_create_list_revoke(env: Path) -> None:
    from sqlalchemy import select

    from ingest.db import make_engine, session_factory
    from scheduler.api.auth import hash_token, resolve_token
    from scheduler.api.tables import ApiTokenRow
    from scheduler.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["tokens", "create", "--name", "ops-alice", "--role", "operator", "--json"])
    assert out.exit_code == 0, out.output
    created = json.loads(out.stdout.strip().splitlines()[-1])
    token = created["token"]
    assert created["role"] == "operator" and token.startswith("ut_") and len(token) > 40

    engine = make_engine(f"sqlite:///{env / 'home' / 'undertow.db'}")
    with session_factory(engine)() as s:
        row = s.scalar(select(ApiTokenRow).where(ApiTokenRow.name == "ops-alice"))
        assert row is not None and row.token_hash == hash_token(token) and token not in (row.prefix + row.token_hash)
        assert resolve_token(s, token) is not None

    listed = runner.invoke(app, ["tokens", "list", "--json"])
    assert token not in listed.stdout and "ops-alice" in listed.stdout
    assert runner.invoke(app, ["tokens", "create", "--name", "ops-alice"]).exit_code != 0  # duplicate name
    bad = runner.invoke(app, ["tokens", "create", "--role", "admin"])
    assert bad.exit_code != 0 and "viewer, operator" in bad.output
    assert runner.invoke(app, ["tokens", "revoke", "ops-alice"]).exit_code == 0
    with session_factory(engine)() as s:
        assert resolve_token(s, token) is None
    assert runner.invoke(app, ["tokens", "revoke", "ops-alice"]).exit_code != 0
    engine.dispose()


def test_api_command_is_registered() -> None:
    from scheduler.cli import app

    out = CliRunner().invoke(app, ["api", "--help"])
    assert out.exit_code == 0 and "--port" in out.output
