"""Migrations are static and reversible: upgrade, downgrade to base, upgrade again, and
autogenerate finds no difference from the models (on SQLite and PostgreSQL)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from ingest.db import downgrade, import_all_tables, make_engine, pending_heads, upgrade


def test_upgrade_downgrade_upgrade_matches_models(db_url: str) -> None:
    upgrade(db_url)
    downgrade(db_url, "base")
    engine = make_engine(db_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(db_url)
    metadata = import_all_tables()
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, metadata)
    assert diff == [], f"models and migrations differ: {diff}"
    assert pending_heads(engine) == set()
    engine.dispose()


def test_outdated_schema_names_the_upgrade_command(db_url: str) -> None:
    import pytest

    from ingest.db import SchemaOutdated, ensure_schema

    engine = make_engine(db_url)
    with pytest.raises(SchemaOutdated, match="undertow db upgrade"):
        ensure_schema(engine, auto_upgrade=False)
    ensure_schema(engine, auto_upgrade=True)
    assert pending_heads(engine) == set()
    engine.dispose()
