"""Fixtures of the ingest tests: per-test topics on the shared embedded broker, configs, events."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ingest.config import IngestConfig, KafkaConfig

DATA = Path(__file__).parent / "data"


@pytest.fixture
def kafka_cfg() -> KafkaConfig:
    """Topics and a group of this test's own, so tests share one broker without interfering."""
    tag = uuid.uuid4().hex[:10]
    return KafkaConfig(
        topic=f"tel-{tag}", dlq_topic=f"tel-{tag}.dlq", partitions=2, group_id=f"grp-{tag}", max_message_bytes=1 << 20
    )


@pytest.fixture
def ingest_cfg() -> IngestConfig:
    """Small batches and short backoffs so faults show quickly."""
    return IngestConfig(batch_size=200, poll_timeout_ms=100, retry_initial_s=0.05, retry_max_s=0.5, topic_check_s=0.5)


@pytest.fixture
def producer(broker: Any, kafka_cfg: KafkaConfig) -> Iterator[Any]:
    """A telemetry producer on this test's topic (large requests allowed, for oversize tests)."""
    from ingest.embedded import create_topics
    from ingest.producer import TelemetryProducer

    create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
    p = TelemetryProducer(broker.bootstrap, kafka_cfg.topic, max_request_size=8 << 20)
    yield p
    p.close()


@pytest.fixture
def pg_url(pg_unavailable: str | None) -> Iterator[str]:
    """A fresh, empty PostgreSQL database (skips with the reason where no server answers)."""
    import os

    from sqlalchemy import create_engine, text

    if pg_unavailable:
        pytest.skip(pg_unavailable)
    admin_url = os.environ.get("UNDERTOW_TEST_PG_ADMIN_URL", "postgresql+psycopg://root@127.0.0.1:5432/postgres")
    name = f"undertow_ingest_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
