"""Shared fixtures: the embedded broker, databases on both SQLite and PostgreSQL, and the sandbox check.

``db_url`` is parametrized over both backends; the PostgreSQL case runs against the machine's
server (127.0.0.1:5432, trust auth) in a fresh database per test and skips with a reason where
no server answers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get("UNDERTOW_TEST_PG_ADMIN_URL", "postgresql+psycopg://root@127.0.0.1:5432/postgres")


def _pg_available() -> str | None:
    """None when PostgreSQL answers, else the reason it does not."""
    try:
        import psycopg  # noqa: F401
        from sqlalchemy import create_engine, text

        eng = create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with eng.connect() as conn:
            conn.execute(text("SELECT 1"))
        eng.dispose()
        return None
    except Exception as exc:  # the reason is shown in the skip message
        return f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc.__class__.__name__}: {exc}"


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """CLI tests configure structlog on a captured stream; reset it so later tests log safely."""
    import structlog

    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def pg_unavailable() -> str | None:
    """Why PostgreSQL cannot be used, or None."""
    return _pg_available()


def make_pg_database(pg_unavailable: str | None) -> Iterator[str]:
    """Create a fresh PostgreSQL database, yield its URL, drop it afterwards."""
    if pg_unavailable:
        pytest.skip(pg_unavailable)
    from sqlalchemy import create_engine, text

    name = f"undertow_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def module_pg_url(pg_unavailable: str | None) -> Iterator[str]:
    """A fresh PostgreSQL database shared by one module's tests (skips when there is no server)."""
    yield from make_pg_database(pg_unavailable)


@pytest.fixture(scope="session")
def session_pg_url(pg_unavailable: str | None) -> Iterator[str]:
    """A fresh PostgreSQL database shared by the whole session (skips when there is no server)."""
    yield from make_pg_database(pg_unavailable)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path, pg_unavailable: str | None) -> Iterator[str]:
    """An empty database URL, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'undertow.db'}"
    else:
        yield from make_pg_database(pg_unavailable)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """An empty SQLite database URL (for tests that need only the embedded backend)."""
    return f"sqlite:///{tmp_path / 'undertow.db'}"


@pytest.fixture
def migrated_db(db_url: str) -> str:
    """``db_url`` migrated to head, on both backends."""
    from ingest.db import upgrade

    upgrade(db_url)
    return db_url


@pytest.fixture
def engine(migrated_db: str) -> Iterator[object]:
    """An engine on a migrated database, on both backends."""
    from ingest.db import make_engine

    eng = make_engine(migrated_db)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def broker() -> Iterator[object]:
    """One embedded Tansu broker for the test session (tests use their own topics)."""
    from ingest.embedded import EmbeddedBroker

    b = EmbeddedBroker()
    b.start()
    yield b
    b.stop()


@pytest.fixture
def fresh_broker() -> Iterator[object]:
    """A broker of the test's own (for tests that kill or restart it)."""
    from ingest.embedded import EmbeddedBroker

    b = EmbeddedBroker()
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def sandbox() -> None:
    """Skips the test where the checker's sandbox cannot run (no user namespaces): the tools and
    rewards of the agent tests run candidates in it."""
    from policy.checker import SandboxUnavailable, require_sandbox

    try:
        require_sandbox()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
