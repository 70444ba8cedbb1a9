"""Fixtures for the reward-model tests: synthetic telemetry loaded through the real ingest writer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from ingest.db import make_engine, transaction

START = datetime(2026, 1, 5, tzinfo=UTC)
SPAN_S = 6 * 86400.0
NOW = START + timedelta(seconds=SPAN_S + 2 * 86400)


def write_envelopes(engine: Engine, events: Sequence[dict[str, Any]]) -> int:
    """Validate contract envelopes and store them with ``ingest.writer.write_events``; returns how many stored."""
    from ingest.schemas import validate_event
    from ingest.writer import write_events

    stored = 0
    with transaction(engine) as session:
        for start in range(0, len(events), 500):
            result = write_events(session, [validate_event(e) for e in events[start : start + 500]])
            stored += result.stored
    return stored


@pytest.fixture
def load_events() -> Callable[[Engine, Sequence[dict[str, Any]]], int]:
    """``load_events(engine, envelopes) -> stored``: the real ingest write path (validation, idempotent writer)."""
    return write_envelopes


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    """An engine on a migrated SQLite database."""
    from ingest.db import upgrade

    upgrade(sqlite_url)
    eng = make_engine(sqlite_url)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def synthetic_600() -> tuple[list[dict[str, Any]], Any]:
    """600 synthetic sessions with all their signals (generated once per test session)."""
    from reward_models.synthetic import generate_events

    return generate_events(600, seed=7, start=START, span_s=SPAN_S, now=NOW)
