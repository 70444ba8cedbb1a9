"""Faults while events stream in: kill -9 of the consumer, the database going away, a broker restart.

Every test checks the end state against what was produced: each event stored exactly once,
no duplicates recorded, nothing lost.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import (
    TcpProxy,
    assert_exactly_once,
    produce_in_background,
    stored_count,
    stored_ids,
    stream_events,
    wait_for,
)
from sqlalchemy import event, select, text

from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import IngestConsumer
from ingest.db import make_engine, transaction, upgrade
from ingest.embedded import create_topics
from ingest.tables import DuplicateRow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("client", ["kafka-python", "librdkafka"])
def test_kill_9_three_times_while_20000_events_stream(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, client: str
) -> None:
    """With the project's producer, and with librdkafka sending idempotent lz4 batches with headers."""
    kafka_cfg = kafka_cfg.model_copy(update={"partitions": 4})
    create_topics(broker.bootstrap, {kafka_cfg.topic: 4, kafka_cfg.dlq_topic: 1})
    url = f"sqlite:///{tmp_path / 'kill.db'}"
    upgrade(url)
    reader = make_engine(url)
    events = stream_events(10_000)
    env = dict(
        os.environ,
        UNDERTOW_HOME=str(tmp_path / "home"),
        UNDERTOW_DATABASE_URL=url,
        UNDERTOW_KAFKA_BOOTSTRAP=broker.bootstrap,
        UNDERTOW_KAFKA__TOPIC=kafka_cfg.topic,
        UNDERTOW_KAFKA__DLQ_TOPIC=kafka_cfg.dlq_topic,
        UNDERTOW_KAFKA__GROUP_ID=kafka_cfg.group_id,
        UNDERTOW_INGEST__BATCH_SIZE="300",
    )
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", "ingest"]

    def start() -> subprocess.Popen[bytes]:
        log = open(tmp_path / "consumer.log", "ab")  # noqa: SIM115
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    rng = random.Random(20_000)
    # Slow enough that the stream outlasts three kills: a restarted consumer catches up within seconds.
    producer = produce_in_background(broker.bootstrap, kafka_cfg.topic, events, rate=700, client=client)
    proc = start()
    try:
        for kill in range(3):
            before = stored_count(reader)
            wait_for(lambda b=before: stored_count(reader) > b, 60, f"progress before kill {kill + 1}")
            time.sleep(rng.uniform(0.2, 2.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            proc = start()
        producer.join(timeout=120)
        assert not producer.is_alive()
        wait_for(lambda: stored_count(reader) >= len(events), 120, "every event")
        # The consumers before may have stored everything: SIGTERM the last one once it is up (its
        # handler installed), not while it is still importing.
        log_path = tmp_path / "consumer.log"
        wait_for(lambda: log_path.read_text(errors="replace").count("ingest.assigned") >= 4, 60, "the last consumer up")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_exactly_once(reader, events)
    reader.dispose()


def _run_consumer(engine: Any, bootstrap: str, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig) -> tuple[Any, Any]:
    consumer = IngestConsumer(engine, bootstrap, kafka_cfg, ingest_cfg, mode="assign")
    thread = threading.Thread(target=consumer.run, kwargs={"max_seconds": 170}, daemon=True)
    thread.start()
    return consumer, thread


@pytest.mark.postgres
def test_postgres_goes_away_mid_stream(
    broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, pg_url: str
) -> None:
    url = pg_url
    if True:
        upgrade(url)
        direct = make_engine(url)
        proxy = TcpProxy("127.0.0.1", 5432)
        proxy.start()
        proxied = make_engine(url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_size=2)
        create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
        events = stream_events(1500, seed=12)
        producer = produce_in_background(broker.bootstrap, kafka_cfg.topic, events, rate=1500)
        consumer, thread = _run_consumer(proxied, broker.bootstrap, kafka_cfg, ingest_cfg)
        wait_for(lambda: stored_count(direct) > 0, 60, "first rows")
        proxy.stop()  # the database is unreachable: connections reset, new ones refused
        time.sleep(2.5)
        assert thread.is_alive()
        proxy.start()
        wait_for(lambda: stored_count(direct) > len(events) // 2, 60, "progress after the outage")
        with direct.connect() as conn:  # and the server kills the consumer's sessions
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
            )
        producer.join(timeout=60)
        wait_for(
            lambda: stored_count(direct) >= len(events),
            90,
            f"every event {consumer.stats} {stored_count(direct)} {thread.is_alive()}",
        )
        consumer.stop()
        thread.join(timeout=30)
        assert consumer.stats.db_retries > 0
        assert_exactly_once(direct, events)
        proxy.stop()
        proxied.dispose()
        direct.dispose()


def test_sqlite_locked_mid_stream(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig
) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)

    @event.listens_for(engine, "connect")
    def _short_busy_timeout(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute("PRAGMA busy_timeout=100")

    reader = make_engine(sqlite_url)
    create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
    events = stream_events(1000, seed=13)
    producer = produce_in_background(broker.bootstrap, kafka_cfg.topic, events, rate=1000)
    # The retry loop under test is the same for both writers; this one runs it in a thread, where the
    # short busy timeout set on this engine's connections applies (the writer processes open their own
    # engine). The process writer's faults are covered by the kill -9 and PostgreSQL tests above.
    thread_cfg = ingest_cfg.model_copy(update={"writer": "thread"})
    consumer, thread = _run_consumer(engine, broker.bootstrap, kafka_cfg, thread_cfg)
    wait_for(lambda: stored_count(reader) > 0, 60, "first rows")
    import sqlite3

    blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the database is unavailable to the consumer
    time.sleep(2.0)
    blocker.execute("ROLLBACK")
    blocker.close()
    producer.join(timeout=60)
    wait_for(lambda: stored_count(reader) >= len(events), 90, "every event")
    consumer.stop()
    thread.join(timeout=30)
    assert consumer.stats.db_retries > 0
    assert_exactly_once(reader, events)
    engine.dispose()
    reader.dispose()


def test_broker_restart_reconnects_without_operator(
    sqlite_url: str, fresh_broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig
) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    kafka_cfg = kafka_cfg.model_copy(update={"partitions": 4})
    create_topics(fresh_broker.bootstrap, {kafka_cfg.topic: 4, kafka_cfg.dlq_topic: 1})
    first, second = stream_events(150, seed=14), stream_events(150, seed=15)
    consumer = IngestConsumer(engine, fresh_broker.bootstrap, kafka_cfg, ingest_cfg, mode="group")
    thread = threading.Thread(target=consumer.run, kwargs={"max_seconds": 150}, daemon=True)
    thread.start()
    produce_in_background(fresh_broker.bootstrap, kafka_cfg.topic, first, rate=2000).join(timeout=60)
    wait_for(lambda: stored_count(engine) >= len(first), 60, "the first events")

    fresh_broker.restart()  # memory storage: the topics come back empty

    produce_in_background(fresh_broker.bootstrap, kafka_cfg.topic, second, rate=2000).join(timeout=60)
    wait_for(lambda: stored_count(engine) >= len(first) + len(second), 90, "the events sent after the restart")
    assert thread.is_alive()
    consumer.stop()
    thread.join(timeout=30)
    ids = stored_ids(engine)
    assert len(ids) == len(set(ids))
    assert set(ids) == {e["event_id"] for e in first + second}
    # Records of the new log read before the client saw the new cluster id are read again from
    # its beginning: counted as duplicates (never stored twice), and only ever those.
    with transaction(engine) as s:
        duplicated = set(s.scalars(select(DuplicateRow.event_id)))
    assert duplicated <= {e["event_id"] for e in second}
    engine.dispose()
