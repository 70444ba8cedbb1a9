"""Telemetry from a producer this project did not write: librdkafka (``confluent-kafka``), idempotent,
with each compression codec production uses. ``undertow ingest --once``, run as a user runs it, stores
every valid event once and dead-letters the malformed record, whatever the codec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import cli_env, last_json, raw, session_event, undertow

from ingest.config import KafkaConfig


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_ingest_reads_compressed_batches_from_librdkafka(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, codec: str
) -> None:
    from confluent_kafka import Producer

    from ingest.embedded import create_topics

    create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
    producer = Producer(
        {
            "bootstrap.servers": broker.bootstrap,
            "compression.type": codec,
            "enable.idempotence": True,  # acks=all, sequence numbers per partition
            "linger.ms": 20,  # several records per compressed batch
        }
    )
    events = [session_event(i) for i in range(30)]
    for event in events:
        producer.produce(kafka_cfg.topic, raw(event), key=event["session_id"].encode())
    producer.produce(kafka_cfg.topic, b"\x00not json", key=b"bad")
    producer.produce(kafka_cfg.topic, raw(events[0]), key=events[0]["session_id"].encode())  # a duplicate
    assert producer.flush(30) == 0

    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    done = undertow(["ingest", "--once"], env, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert last_json(done.stdout)["records"] == len(events) + 2
    stats = last_json(undertow(["stats", "--json"], env).stdout)
    assert {key: stats[key] for key in ("events", "sessions", "duplicates", "dead_letters")} == {
        "events": {"session.completed": len(events)},
        "sessions": len(events),
        "duplicates": 1,
        "dead_letters": 1,
    }
    assert stats["unreadable_batches"]["count"] == 0
    letters = last_json(undertow(["dlq", "list", "--json"], env).stdout)["dead_letters"]
    assert [d["reason"] for d in letters] == ["invalid_json"]
    json.dumps(letters)


def test_records_of_an_aborted_transaction_are_never_stored(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig
) -> None:
    """A transactional librdkafka producer aborts one transaction and commits the next: ingest stores
    the committed events only, and the transaction markers between them are neither events nor dead
    letters."""
    from confluent_kafka import Producer

    from ingest.embedded import create_topics

    create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
    producer = Producer(
        {
            "bootstrap.servers": broker.bootstrap,
            "transactional.id": f"tx-{kafka_cfg.group_id}",
            "compression.type": "lz4",
        }
    )
    producer.init_transactions(30)
    aborted = [session_event(i) for i in range(100, 110)]
    committed = [session_event(i) for i in range(10)]
    for batch, finish in ((aborted, producer.abort_transaction), (committed, producer.commit_transaction)):
        producer.begin_transaction()
        for event in batch:
            producer.produce(kafka_cfg.topic, raw(event), key=event["session_id"].encode())
        finish(30)
    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    done = undertow(["ingest", "--once"], env, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = last_json(undertow(["stats", "--json"], env).stdout)
    del stats["unreadable_batches"]
    assert stats == {
        "events": {"session.completed": len(committed)},
        "sessions": len(committed),
        "duplicates": 0,
        "dead_letters": 0,
    }
