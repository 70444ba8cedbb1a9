"""Alembic environment: every package's tables on one metadata, one branch per package."""

from __future__ import annotations

from alembic import context

from ingest.db import import_all_tables, make_engine

config = context.config
target_metadata = import_all_tables()


def run_migrations_offline() -> None:
    """Emit SQL without a connection."""
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run against a live connection (batch mode so SQLite can alter tables)."""
    connectable = config.attributes.get("connection")
    if connectable is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connectable)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
