"""Fixtures for the control plane: one migrated, seeded database per backend (SQLite and
PostgreSQL) shared by every test here (tests only add rows, and count what they add), tokens of
each role, and a client that speaks HTTP to the app in process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from api_helpers import Seeded, make_settings, seed_all
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine


@pytest.fixture(scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def shared_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated database URL for the module, on SQLite and on PostgreSQL."""
    from ingest.db import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('api') / 'undertow.db'}"
    else:
        url = request.getfixturevalue("session_pg_url")
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def api_engine(shared_url: str) -> Iterator[Engine]:
    """An engine on the module's database."""
    from ingest.db import make_engine

    engine = make_engine(shared_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def api_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Undertow home of the module's app (reward-model artifacts live under it)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="session")
def seeded(api_engine: Engine, api_home: Path) -> Seeded:
    """Demo-sized telemetry, fleet, deployments and trained reward models in the module's database."""
    return seed_all(api_engine, api_home, n_sessions=300)


@pytest.fixture(scope="session")
def tokens(api_engine: Engine) -> dict[str, str]:
    """A viewer and an operator token, in clear (named ``test-viewer`` and ``test-operator``)."""
    from scheduler.api.auth import create_token

    return {role: create_token(api_engine, f"test-{role}", role)[1] for role in ("viewer", "operator")}


@pytest.fixture(scope="session")
def client(api_home: Path, shared_url: str, api_engine: Engine, seeded: Seeded) -> Iterator[TestClient]:
    """A client for an app on the module's seeded database."""
    from scheduler.api.app import create_app

    app = create_app(make_settings(api_home, shared_url), engine=api_engine)
    with TestClient(app) as c:
        yield c


@pytest.fixture
def app_factory(api_home: Path, shared_url: str, api_engine: Engine):  # type: ignore[no-untyped-def]
    """Build another app on the module's database with other ``api`` settings."""
    from scheduler.api.app import create_app

    return lambda **api: create_app(make_settings(api_home, shared_url, **api), engine=api_engine)
