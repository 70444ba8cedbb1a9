"""The database foundation: the declarative ``Base`` every layer's tables use, engine and session
factories, the UTC-aware timestamp column type, and the schema checks that tell a user to run
``undertow db upgrade``.

Every timestamp column is a :class:`UTCDateTime`: SQLite keeps no zone and hands back naive values,
so the type converts on the way in and out and callers only ever see aware UTC datetimes.

SQLite runs in WAL mode with a busy timeout so a consumer, a worker and the API can share one
file; PostgreSQL is used as is. Nothing is created at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, MetaData, create_engine, event, select
from sqlalchemy.engine import Dialect, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def as_utc(ts: datetime) -> datetime:
    """``ts`` as an aware UTC datetime; a naive one is taken as UTC already.

    For values that do not come from a :class:`UTCDateTime` column (pandas, pydantic, JSON);
    values read from such a column are aware UTC already. Raises ``ValueError`` for a time UTC
    cannot represent (``0001-01-01T00:00:00+05:00``).
    """
    try:
        return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError(f"timestamp {ts.isoformat()} is out of range in UTC") from exc


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that takes only aware datetimes and always returns aware UTC ones.

    A naive value is refused when bound (its zone is unknown, and SQLite would store it as
    is); an aware one is stored in UTC. SQLite returns what it stored without a zone, PostgreSQL
    in the session's zone: both come back as UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} for a UTC timestamp column: pass an aware datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


class Base(DeclarativeBase):
    """Declarative base shared by every package's ``tables.py``."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


_PG_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "connect_timeout": 10,
}


class SchemaOutdated(RuntimeError):
    """The database schema is behind the code; the message says what to run."""


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for ``url``; SQLite gets WAL, a busy timeout and foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            from ingest.private import private_dir, private_file

            private_file(private_dir(Path(parsed.database).parent) / Path(parsed.database).name)
        kwargs.setdefault("connect_args", {"timeout": 30, "check_same_thread": False})
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg":
        # TCP keepalives and a connect timeout: a silently cut connection fails in ~25 s instead of hanging.
        connect_args = dict(kwargs.get("connect_args") or {})
        for key, value in _PG_KEEPALIVES.items():
            connect_args.setdefault(key, value)
        kwargs["connect_args"] = connect_args
    return create_engine(url, **kwargs)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """A session factory bound to ``engine`` (objects stay usable after commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def transaction(engine: Engine) -> Iterator[Session]:
    """A session in one transaction: commit on success, roll back on error."""
    with session_factory(engine)() as session, session.begin():
        yield session


def revoke_named(engine: Engine, table: Any, name: str) -> bool:
    """Set ``revoked_at`` on the row of ``table`` named ``name`` (API tokens, gateway keys); False when
    there is no such row or it is revoked already."""
    with transaction(engine) as session:
        row = session.scalar(select(table).where(table.name == name))
        if row is None or row.revoked_at is not None:
            return False
        row.revoked_at = datetime.now(UTC)
        return True


def all_rows(engine: Engine, table: Any) -> list[Any]:
    """Every row of ``table`` in ``id`` order (credentials listings: hashes only, never a secret)."""
    with transaction(engine) as session:
        return list(session.scalars(select(table).order_by(table.id)))


def import_all_tables() -> MetaData:
    """Import every package's ``tables`` module so ``Base.metadata`` is complete."""
    import importlib

    for name in ("ingest", "reward_models", "policy", "serving", "scheduler", "scheduler.api"):
        try:
            importlib.import_module(f"{name}.tables")
        except ModuleNotFoundError as exc:
            if exc.name not in (name, f"{name}.tables"):
                raise
    return Base.metadata


def alembic_config(url: str) -> Any:
    """An Alembic ``Config`` for ``url`` pointing at the project's static migrations."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "heads") -> None:
    """Migrate the database at ``url`` to ``revision`` (all branch heads by default)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision``."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def pending_heads(engine: Engine) -> set[str]:
    """Heads of the migration scripts that the database has not reached."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config(str(engine.url)))
    heads = set(script.get_heads())
    with engine.connect() as conn:
        current = set(MigrationContext.configure(conn).get_current_heads())
    # A head counts as reached when the database is at it or past it on its branch.
    reached: set[str] = set()
    for rev in current:
        reached.update(r.revision for r in script.iterate_revisions(rev, "base"))
    return heads - reached


def ensure_schema(engine: Engine, *, auto_upgrade: bool) -> None:
    """Make sure the schema is current: upgrade it (embedded SQLite) or stop with a clear message."""
    missing = pending_heads(engine)
    if not missing:
        return
    if auto_upgrade:
        upgrade(engine.url.render_as_string(hide_password=False))
        return
    raise SchemaOutdated(
        f"The database schema at {engine.url.render_as_string(hide_password=True)} is behind this "
        f"version of Undertow (missing migrations: {', '.join(sorted(missing))}). "
        "Run `undertow db upgrade` to migrate it, then retry."
    )
