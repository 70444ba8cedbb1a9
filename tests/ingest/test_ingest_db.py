"""The UTC timestamp column type on SQLite and PostgreSQL: aware values of any zone come back as the
same instant in UTC, a naive one is refused before it reaches the database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, insert, select
from sqlalchemy.exc import StatementError

from ingest.db import UTCDateTime, as_utc, make_engine


def test_utc_column_round_trips_instants_and_refuses_naive_values(db_url: str) -> None:
    engine = make_engine(db_url)
    table = Table("utc_probe", MetaData(), Column("id", Integer, primary_key=True), Column("at", UTCDateTime))
    table.create(engine)
    try:
        tokyo = datetime(2026, 12, 1, 9, 30, tzinfo=timezone(timedelta(hours=9)))
        with engine.begin() as conn:
            conn.execute(insert(table).values(id=1, at=tokyo))
            back = conn.scalar(select(table.c.at).where(table.c.id == 1))
        assert back == tokyo and back.tzinfo == UTC and back.hour == 0
        with pytest.raises(StatementError, match="naive datetime"), engine.begin() as conn:
            conn.execute(insert(table).values(id=2, at=datetime(2026, 12, 1, 9, 30)))
        with engine.begin() as conn:
            assert conn.scalar(select(table.c.at).where(table.c.id == 2)) is None  # nothing was written
    finally:
        table.drop(engine)
        engine.dispose()


def test_as_utc_reads_naive_as_utc_and_converts_aware() -> None:
    assert as_utc(datetime(2026, 1, 1, 12)) == datetime(2026, 1, 1, 12, tzinfo=UTC)
    paris = datetime(2026, 1, 1, 13, tzinfo=timezone(timedelta(hours=1)))
    assert as_utc(paris).tzinfo == UTC and as_utc(paris).hour == 12
