"""The settings tree: defaults, ``undertow.toml``, environment precedence, and the CLI's answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.settings import Settings


def test_environment_wins_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "undertow.toml").write_text('log_level = "DEBUG"\n[kafka]\ntopic = "from.toml"\npartitions = 7\n')
    monkeypatch.setenv("UNDERTOW_KAFKA__TOPIC", "from.env")
    s = Settings()
    assert s.kafka.topic == "from.env"
    assert s.kafka.partitions == 7
    assert s.log_level == "DEBUG"


def test_default_database_is_embedded_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNDERTOW_DATABASE_URL", raising=False)
    s = Settings(home=tmp_path / "home")
    assert s.is_embedded_database
    assert s.resolved_database_url.startswith("sqlite:///")
    monkeypatch.setenv("UNDERTOW_DATABASE_URL", "postgresql+psycopg://u:secret@h/db")
    s = Settings()
    assert not s.is_embedded_database
    assert "secret" not in json.dumps(s.resolved())


def test_invalid_setting_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UNDERTOW_KAFKA__PARTITIONS", "zero")
    with pytest.raises(ValueError, match="partitions"):
        Settings()


def _undertow(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *args], cwd=cwd, env=full_env, capture_output=True, text=True
    )


def test_help_answers_fast(tmp_path: Path) -> None:
    start = time.perf_counter()
    out = _undertow("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "telemetry" in out.stdout.lower()
    # Thin entrypoint: heavy libraries are imported inside commands, not at start.
    heavy = "('torch', 'pandas', 'sklearn', 'transformers', 'kafka', 'sqlalchemy')"
    code = f"import sys, scheduler.cli; print(sorted(m for m in {heavy} if m in sys.modules))"
    probe = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    assert time.perf_counter() - start < 10


def test_config_show_prints_one_json_object(tmp_path: Path) -> None:
    out = _undertow("config", "show", cwd=tmp_path, env={"UNDERTOW_HOME": str(tmp_path / "h")})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["kafka"]["topic"] == "undertow.telemetry"


def test_a_bad_configuration_is_a_message_and_exit_2_never_a_traceback(tmp_path: Path) -> None:
    """Every invalid setting named with its variable and toml key, its value never echoed (it may be a
    secret); a toml file that does not parse named with where it fails; exit status 2, no traceback."""
    env = {
        "UNDERTOW_HOME": str(tmp_path / "h"),
        "UNDERTOW_POLICY__KL_COEF": "s3cret-not-a-number",
        "UNDERTOW_KAFKA__PARTITIONS": "-4",
    }
    out = _undertow("config", "show", cwd=tmp_path, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert "Traceback" not in out.stderr and "s3cret" not in out.stderr
    assert "2 invalid setting(s)" in out.stderr
    assert "policy.kl_coef" in out.stderr and "UNDERTOW_POLICY__KL_COEF" in out.stderr
    assert "[kafka] partitions" in out.stderr and "config docs" in out.stderr

    (tmp_path / "undertow.toml").write_text("[policy]\nkl_coef = \n")
    out = _undertow("config", "show", cwd=tmp_path, env={"UNDERTOW_HOME": str(tmp_path / "h")})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "undertow.toml" in out.stderr and "not valid TOML" in out.stderr and "line 2" in out.stderr

    (tmp_path / "undertow.toml").write_text("[policy]\nkl_coef = 0.05\n")  # fixed: the command answers
    out = _undertow("config", "show", cwd=tmp_path, env={"UNDERTOW_HOME": str(tmp_path / "h")})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["policy"]["kl_coef"] == 0.05


def test_embedded_database_upgrades_itself_but_postgres_asks(tmp_path: Path, db_url: str) -> None:
    """On the embedded default any command migrates; on a configured database it names the fix."""
    if db_url.startswith("sqlite"):
        out = _undertow("db", "status", cwd=tmp_path, env={"UNDERTOW_HOME": str(tmp_path / "h")})
        assert out.returncode == 0, out.stderr
        from scheduler.runtime import open_database

        eng = open_database(Settings(home=tmp_path / "h"))
        from ingest.db import pending_heads

        assert pending_heads(eng) == set()
    else:
        from ingest.db import SchemaOutdated
        from scheduler.runtime import open_database

        with pytest.raises(SchemaOutdated, match="undertow db upgrade"):
            open_database(Settings(database_url=db_url))
        out = _undertow("db", "upgrade", cwd=tmp_path, env={"UNDERTOW_DATABASE_URL": db_url})
        assert out.returncode == 0, out.stderr
        open_database(Settings(database_url=db_url))


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md is generated from the settings tree; regenerate with `undertow config docs`."""
    from scheduler.settings.docs import render_reference

    path = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert path.read_text() == render_reference(), "run `undertow config docs --output docs/configuration.md`"
    assert "`UNDERTOW_KAFKA__TOPIC`" in path.read_text()
