"""Two ``undertow ingest`` processes in one consumer group share a topic's partitions exactly once.

Both join the group while events stream into four partitions; once both store events, one is
killed with SIGKILL (no goodbye to the group, its open transaction rolled back). After the group's
session timeout the survivor is assigned the dead one's partitions and resumes them from the
offsets stored with the rows. At the end every event is stored exactly once, no duplicate
recorded: on PostgreSQL, and on SQLite, whose WAL mode lets the two processes' writers take
turns (a writer that finds the database locked waits, then retries its batch).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import (
    assert_exactly_once,
    produce_in_background,
    reap,
    start_ingest,
    stored_count,
    stream_events,
    wait_for,
)

from ingest.config import KafkaConfig
from ingest.db import make_engine, upgrade
from ingest.embedded import create_topics

ALL = {0, 1, 2, 3}


def assignments(log_path: Path) -> list[set[int]]:
    """The partitions of each ``ingest.assigned`` line of a consumer's log, oldest first."""
    lines = log_path.read_text(errors="replace").splitlines()
    found = (re.search(r"partitions=\[([\d, ]*)\]", line) for line in lines if "ingest.assigned" in line)
    return [{int(p) for p in match.group(1).split(",") if p.strip()} for match in found if match]


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_consumers_share_partitions_and_the_survivor_takes_over_after_kill_9(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, database: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("pg_url") if database == "postgres" else f"sqlite:///{tmp_path / 'group.db'}"
    upgrade(url)
    engine = make_engine(url)
    kafka_cfg = kafka_cfg.model_copy(update={"partitions": 4})
    create_topics(broker.bootstrap, {kafka_cfg.topic: 4, kafka_cfg.dlq_topic: 1})
    env = {
        **os.environ,
        "UNDERTOW_HOME": str(tmp_path / "home"),
        "UNDERTOW_DATABASE_URL": url,
        "UNDERTOW_KAFKA_BOOTSTRAP": broker.bootstrap,
        "UNDERTOW_KAFKA__TOPIC": kafka_cfg.topic,
        "UNDERTOW_KAFKA__DLQ_TOPIC": kafka_cfg.dlq_topic,
        "UNDERTOW_KAFKA__GROUP_ID": kafka_cfg.group_id,
        "UNDERTOW_KAFKA__PARTITIONS": "4",
        "UNDERTOW_INGEST__BATCH_SIZE": "200",
    }
    # 24,000 events at 700/s (about 34 s): the kill and the takeover land mid-stream even on a slow machine
    events = stream_events(12000, seed=41)
    producer = produce_in_background(broker.bootstrap, kafka_cfg.topic, events, rate=700)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start_ingest(env, logs[0])]
    try:
        wait_for(lambda: stored_count(engine) > 0, 60, "the first consumer's events")
        procs.append(start_ingest(env, logs[1]))
        # The second joins: the group rebalances and each consumer holds two of the four partitions.
        wait_for(lambda: assignments(logs[1]) and len(assignments(logs[0])) >= 2, 60, "the rebalance to two consumers")
        before = stored_count(engine)
        wait_for(lambda: stored_count(engine) > before + 1000, 60, "both consumers storing")
        first, second = assignments(logs[0])[-1], assignments(logs[1])[-1]
        assert first and second and not first & second and first | second == ALL  # shared, each once
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        killed_at = stored_count(engine)
        assert producer.is_alive(), "the stream ended before the kill: it would not land mid-stream"
        # The survivor takes every partition once the group gives up on the dead member.
        wait_for(lambda: assignments(logs[1])[-1] == ALL, 60, "the survivor's takeover")
        producer.join(timeout=90)
        assert not producer.is_alive()
        wait_for(lambda: stored_count(engine) >= len(events), 90, "every event, through the survivor")
        assert stored_count(engine) > killed_at
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=30) == 0
    finally:
        reap(procs)
    assert_exactly_once(engine, events)
    engine.dispose()
