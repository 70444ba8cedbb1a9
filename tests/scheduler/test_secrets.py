"""Secrets: masked by ``undertow config show``, never stored in the database, generated for compose; and the
files that hold users' data readable by their owner only."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import inspect, select, table, text

ROOT = Path(__file__).resolve().parents[2]
REDIS_PASSWORD = "redis-pw-Zq81kX0aLw9"
DB_PASSWORD = "db-p@ss:w0rd-Hj2kq"  # hostile: an '@' and a ':' in the password, as a careless URL has them
JUDGE_KEY = "sk-judge-7fK2mQpR0vXz"
SIGNING_SECRET = "signing-secret-4Nq9wLp2Ts8v"
METRICS_KEY = "ugw_metrics-secret-Yb5cD1eF"
SECRETS = (REDIS_PASSWORD, "p@ss:w0rd", JUDGE_KEY, SIGNING_SECRET, METRICS_KEY)


def _env(home: Path, **more: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "UNDERTOW_HOME": str(home),
        "UNDERTOW_SCHEDULER__CELERY_BROKER_URL": f"redis://:{REDIS_PASSWORD}@redis:6379/0",
        "UNDERTOW_SCHEDULER__CELERY_RESULT_BACKEND": f"redis://undertow:{REDIS_PASSWORD}@redis:6379/1",
        "UNDERTOW_REWARDS__JUDGE__API_KEY": JUDGE_KEY,
        "UNDERTOW_REWARDS__JUDGE__BASE_URL": f"https://judge.example/v1?api_key={JUDGE_KEY}",
        "UNDERTOW_INGEST__SIGNING_KEYS": json.dumps({"gateway": SIGNING_SECRET}),
        "UNDERTOW_SERVING__GATEWAY__METRICS_KEY": METRICS_KEY,
        **more,
    }


def _cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real ``undertow`` command, in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_config_show_masks_every_secret(tmp_path: Path) -> None:
    env = _env(tmp_path / "home", UNDERTOW_DATABASE_URL=f"postgresql+psycopg://undertow:{DB_PASSWORD}@db:5432/u")
    result = _cli(["config", "show"], env)
    assert result.returncode == 0, result.stderr
    for secret in SECRETS:
        assert secret not in result.stdout and secret not in result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["database_url"] == "postgresql+psycopg://undertow:**********@db:5432/u"
    assert shown["scheduler"]["celery_broker_url"] == "redis://:**********@redis:6379/0"
    assert shown["scheduler"]["celery_result_backend"] == "redis://undertow:**********@redis:6379/1"
    assert shown["rewards"]["judge"]["api_key"] == "**********"
    assert shown["rewards"]["judge"]["base_url"] == "https://judge.example/v1?api_key=**********"
    assert shown["ingest"]["signing_keys"] == {"gateway": "**********"}
    assert shown["serving"]["gateway"]["metrics_key"] == "**********"
    assert shown["kafka_bootstrap"] is None and shown["serving"]["fleet"]["control_token"] is None


def test_urls_without_a_password_are_shown_as_they_are() -> None:
    from scheduler.settings import mask_urls

    plain = ["redis://redis:6379/0", "postgresql://undertow@db/u", "http://127.0.0.1:8000/v1", "kafka:9092"]
    assert mask_urls({"a": plain, "n": 3, "none": None}) == {"a": plain, "n": 3, "none": None}
    two = "redis://:one@h1:26379;redis://:two@h2:26379"  # Celery's failover list: each masked, hosts kept
    assert mask_urls(two) == "redis://:**********@h1:26379;redis://:**********@h2:26379"


@pytest.fixture
def trained_db(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    from ingest.db import make_engine, transaction, upgrade
    from ingest.schemas import validate_event
    from ingest.writer import write_events
    from reward_models.synthetic import generate_events

    url = f"sqlite:///{tmp_path / 'secrets.db'}"
    upgrade(url)
    engine = make_engine(url)
    now = datetime.now(UTC)
    events, _ = generate_events(200, seed=5, start=now - timedelta(days=6), span_s=4 * 86400, now=now)
    with transaction(engine) as session:
        write_events(session, [validate_event(e) for e in events])
    engine.dispose()
    yield url, _env(tmp_path / "home", UNDERTOW_DATABASE_URL=url)


def test_the_recorded_config_holds_no_secret(trained_db: tuple[str, dict[str, str]]) -> None:
    """``rewards train`` records the resolved config with the version: no table's text holds a secret."""
    from ingest.db import make_engine

    url, env = trained_db
    result = _cli(["rewards", "train", "--json"], env)
    assert result.returncode == 0, result.stderr[-2000:]
    engine = make_engine(url)
    with engine.connect() as conn:
        config = json.loads(conn.execute(text("SELECT config FROM reward_models")).scalar_one())
        assert config["rewards"]["judge"]["api_key"] == "**********"  # the recorded config is there, masked
        assert config["scheduler"]["celery_broker_url"] == "redis://:**********@redis:6379/0"
        dumped = []
        for name in inspect(conn).get_table_names():
            dumped += [repr(tuple(row)) for row in conn.execute(select(text("*")).select_from(table(name)))]
    engine.dispose()
    everything = "\n".join(dumped)
    assert "reward_models" in inspect(make_engine(url)).get_table_names() and len(dumped) > 100
    for secret in SECRETS:
        assert secret not in everything
    database = Path(url.removeprefix("sqlite:///"))
    raw = b"".join(p.read_bytes() for p in database.parent.glob(database.name + "*"))
    for secret in SECRETS:
        assert secret.encode() not in raw  # not in a page the tables no longer reference either


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would leave new files group- and world-readable (and group-writable)."""
    before = os.umask(0o002)
    yield
    os.umask(before)


@pytest.mark.usefixtures("loose_umask")
def test_home_and_database_files_are_private(tmp_path: Path) -> None:
    from ingest.db import make_engine, upgrade
    from scheduler.settings import load_settings

    settings = load_settings(home=tmp_path / "home")
    assert _mode(settings.home) == 0o700
    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE probe (x TEXT)"))
        conn.execute(text("INSERT INTO probe VALUES ('user code')"))
        files = sorted(settings.home.glob("undertow.db*"))
        assert [p.name for p in files] == ["undertow.db", "undertow.db-shm", "undertow.db-wal"]
        assert {p.name: _mode(p) for p in files} == dict.fromkeys((p.name for p in files), 0o600)
    engine.dispose()

    existing = tmp_path / "shared"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    load_settings(home=existing)
    assert _mode(existing) == 0o755  # an operator's own directory keeps its mode


@pytest.mark.usefixtures("loose_umask")
def test_spool_directory_and_segments_are_private(tmp_path: Path) -> None:
    from serving.spool import Spool

    spool = Spool(tmp_path / "home" / "spool")
    spool.append([b'{"event_id": "a", "payload": "user prompt"}', b'{"event_id": "b"}'])
    segment = spool.oldest()
    assert segment is not None and _mode(spool.dir) == 0o700 and _mode(segment) == 0o600
    spool.settle(segment, 1, [b'{"event_id": "b"}'])  # the rewrite of what is still owed
    assert segment.read_bytes() == b'{"event_id": "b"}\n' and _mode(segment) == 0o600
    spool.append([b'{"event_id": "c"}'])
    assert {p.name: _mode(p) for p in spool.dir.iterdir()} == {p.name: 0o600 for p in spool.dir.iterdir()}
    spool.close()


def _env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            assert value.startswith("'") and value.endswith("'"), line.split("=")[0]
            values[name] = value[1:-1]
    return values


def test_make_secrets_writes_what_compose_requires(tmp_path: Path) -> None:
    compose = (ROOT / "deploy" / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?", compose))
    assert {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "UNDERTOW_ENGINE_CONTROL_TOKEN"} <= required
    assert "undertow:undertow@" not in compose and "POSTGRES_PASSWORD: undertow" not in compose
    assert "--requirepass" in compose and "redis://:${REDIS_PASSWORD:?" in compose

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "deploy" / ".env"
    first = _cli(["config", "secrets", "--output", str(out)], env)
    assert first.returncode == 0, first.stderr
    values = _env_file(out)
    assert required <= set(values) and _mode(out) == 0o600
    keys = json.loads(values["UNDERTOW_SIGNING_KEYS"])
    leaves = [v for k, v in values.items() if k != "UNDERTOW_SIGNING_KEYS"] + list(keys.values())
    assert set(keys) == {"gateway", "dlq-replay"}
    assert all(len(v) >= 40 for v in leaves) and len(set(leaves)) == len(leaves)
    for value in leaves:
        assert value not in first.stdout + first.stderr  # the command never prints a secret

    from scheduler.settings import Settings

    Settings(ingest={"signing_keys": keys})  # the settings accept what compose hands them

    before = out.read_bytes()
    again = _cli(["config", "secrets", "--output", str(out)], env)
    assert again.returncode == 1 and "--force" in again.stderr and out.read_bytes() == before
    forced = _cli(["config", "secrets", "--output", str(out), "--force"], env)
    assert forced.returncode == 0 and _mode(out) == 0o600
    assert set(_env_file(out).values()).isdisjoint(values.values())

    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in (ROOT / ".dockerignore").read_text().splitlines()
