"""Batches ingest cannot read: a codec whose library is missing here, and corrupt batches on the broker.

The partition waits at the batch (nothing after it stored or skipped) while the others flow; the
consumer backs off instead of spinning, SIGTERM still stops it, and the failure shows in
``undertow stats --json`` and ``/metrics``. The corrupt batches are real ones on the broker: a gzip
batch whose compressed bytes were damaged before its CRC was computed (so only decompression
fails), and one damaged after (so its CRC does not match).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from ingest_helpers import REPO, cli_env, last_json, raw, session_event, start_ingest, undertow
from sqlalchemy import select

from ingest.config import KafkaConfig
from ingest.db import make_engine, transaction, upgrade
from ingest.embedded import create_topics
from ingest.tables import ConsumerOffsetRow, SessionRow

WITHOUT_SNAPPY = "import sys; sys.modules['snappy'] = None; from scheduler.cli import main; main()"
"""``undertow`` in a process where python-snappy cannot be imported (as on a machine without it)."""


@contextlib.contextmanager
def corrupt_batches(after_crc: bool) -> Iterator[None]:
    """kafka-python's producer, in this process, sends record batches with damaged compressed bytes."""
    from kafka.record.default_records import DefaultRecordBatchBuilder

    build = DefaultRecordBatchBuilder.build

    def damaged(self: Any) -> bytearray:
        buffer: bytearray = build(self)
        start = self.HEADER_STRUCT.size + 20  # inside the deflate stream, past the gzip header
        for i in range(start, min(len(buffer) - 10, start + 40)):
            buffer[i] ^= 0x5A
        if not after_crc:
            self.write_header(True)  # a CRC over the damaged bytes: only decompression can fail
        return buffer

    DefaultRecordBatchBuilder.build = damaged
    try:
        yield
    finally:
        DefaultRecordBatchBuilder.build = build


def stored_sessions(engine: Any) -> set[str]:
    with transaction(engine) as s:
        return set(s.scalars(select(SessionRow.event_id)))


def stored_offset(engine: Any, kafka_cfg: KafkaConfig, partition: int) -> int | None:
    with transaction(engine) as s:
        return s.scalar(
            select(ConsumerOffsetRow.next_offset).where(
                ConsumerOffsetRow.group_id == kafka_cfg.group_id, ConsumerOffsetRow.partition == partition
            )
        )


def test_a_codec_without_its_library_holds_its_partition_and_the_others_flow(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig
) -> None:
    """The reader lacks python-snappy. ``--once`` stores what it can read, says what to install and exits 3;
    with the library back, every event is stored once and nothing is held any more."""
    from confluent_kafka import Producer

    create_topics(broker.bootstrap, {kafka_cfg.topic: 2, kafka_cfg.dlq_topic: 1})
    snappy = Producer({"bootstrap.servers": broker.bootstrap, "compression.type": "snappy", "linger.ms": 20})
    plain = Producer({"bootstrap.servers": broker.bootstrap, "compression.type": "none"})
    held, flowing = [session_event(i) for i in range(12)], [session_event(i) for i in range(100, 110)]
    for event in held:
        snappy.produce(kafka_cfg.topic, raw(event), partition=0)
    for event in flowing:
        plain.produce(kafka_cfg.topic, raw(event), partition=1)
    assert snappy.flush(30) == 0 and plain.flush(30) == 0

    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    blind = subprocess.run(
        [sys.executable, "-c", WITHOUT_SNAPPY, "ingest", "--once"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert blind.returncode == 3, blind.stderr[-2000:]
    assert "cannot decode" in blind.stderr and "python-snappy" in blind.stderr and "offset 0" in blind.stderr
    assert last_json(blind.stdout)["stored"] == len(flowing)
    stats = last_json(undertow(["stats", "--json"], env).stdout)
    assert stats["sessions"] == len(flowing)
    unreadable = stats["unreadable_batches"]
    assert (unreadable["count"], unreadable["last_reason"], unreadable["last_partition"]) == (1, "codec_unavailable", 0)
    assert [(p["partition"], p["offset"]) for p in unreadable["held_partitions"]] == [(0, 0)]

    fixed = undertow(["ingest", "--once"], env, timeout=180)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    stats = last_json(undertow(["stats", "--json"], env).stdout)
    assert (stats["sessions"], stats["duplicates"]) == (len(held) + len(flowing), 0)
    assert stats["unreadable_batches"]["count"] == 1 and stats["unreadable_batches"]["held_partitions"] == []


@pytest.mark.parametrize("after_crc", [False, True], ids=["bad-payload", "bad-crc"])
def test_a_corrupt_batch_is_reported_and_nothing_past_it_is_committed(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, after_crc: bool
) -> None:
    from kafka import KafkaProducer

    create_topics(broker.bootstrap, {kafka_cfg.topic: 2, kafka_cfg.dlq_topic: 1})
    before, after, other = (
        [session_event(i) for i in range(5)],
        [session_event(i) for i in range(10, 15)],
        [session_event(i) for i in range(20, 30)],
    )
    with KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all") as good:
        for event in before:
            good.send(kafka_cfg.topic, raw(event), partition=0)
        good.flush()
        with (
            corrupt_batches(after_crc),
            KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", compression_type="gzip", linger_ms=50) as bad,
        ):
            sent = [bad.send(kafka_cfg.topic, raw(session_event(i)), partition=0) for i in range(50, 55)]
            bad.flush()
            corrupt_offset = sent[0].get(timeout=30).offset
        for event in after:
            good.send(kafka_cfg.topic, raw(event), partition=0)
        for event in other:
            good.send(kafka_cfg.topic, raw(event), partition=1)
        good.flush()

    url = f"sqlite:///{tmp_path / 'corrupt.db'}"
    upgrade(url)
    env = dict(cli_env(tmp_path, broker.bootstrap, kafka_cfg), UNDERTOW_DATABASE_URL=url)
    done = undertow(["ingest", "--once"], env, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"partition 0 at offset {corrupt_offset} is corrupt" in done.stderr
    engine = make_engine(url)
    assert stored_sessions(engine) == {e["event_id"] for e in before + other}
    assert stored_offset(engine, kafka_cfg, 0) == corrupt_offset  # the records after it are still to be read
    unreadable = last_json(undertow(["stats", "--json"], env).stdout)["unreadable_batches"]
    assert (unreadable["last_reason"], unreadable["last_offset"]) == ("corrupt_batch", corrupt_offset)
    engine.dispose()


def test_ingest_backs_off_on_a_corrupt_batch_without_spinning_and_stops_on_sigterm(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig
) -> None:
    """The consumer group's ``undertow ingest``: the partition is read again at 0.5 s, 1 s, 2 s, 2 s...
    while the other one flows; the process stays near idle, ``/metrics`` counts the failed reads, and
    SIGTERM during the back-off ends it at once with status 0."""
    from kafka import KafkaProducer
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.api.metrics import make_registry

    create_topics(broker.bootstrap, {kafka_cfg.topic: 2, kafka_cfg.dlq_topic: 1})
    with (
        corrupt_batches(after_crc=False),
        KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", compression_type="gzip", linger_ms=50) as bad,
    ):
        sent = [bad.send(kafka_cfg.topic, raw(session_event(i)), partition=0) for i in range(5)]
        bad.flush()
        corrupt_offset = sent[0].get(timeout=30).offset
    url = f"sqlite:///{tmp_path / 'backoff.db'}"
    upgrade(url)
    env = dict(
        cli_env(tmp_path, broker.bootstrap, kafka_cfg),
        UNDERTOW_DATABASE_URL=url,
        UNDERTOW_INGEST__UNREADABLE_RETRY_INITIAL_S="0.5",
        UNDERTOW_INGEST__UNREADABLE_RETRY_MAX_S="2",
    )
    log_path = tmp_path / "ingest.log"
    proc = start_ingest(env, log_path)
    engine = make_engine(url)
    try:
        deadline = time.monotonic() + 60
        while log_path.read_text(errors="replace").count("ingest.unreadable_batch") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")[-2000:]
            time.sleep(0.2)
        with KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all") as good:  # the other partition flows
            for i in range(20, 30):
                good.send(kafka_cfg.topic, raw(session_event(i)), partition=1)
            good.flush()
        watched = psutil.Process(proc.pid)
        cpu_before, wall_before = sum(watched.cpu_times()[:2]), time.monotonic()
        time.sleep(5)
        cpu_s, wall_s = sum(watched.cpu_times()[:2]) - cpu_before, time.monotonic() - wall_before
        assert cpu_s < 0.25 * wall_s, f"{cpu_s:.2f} s of CPU in {wall_s:.1f} s: the consumer spins"
        assert stored_sessions(engine) == {session_event(i)["event_id"] for i in range(20, 30)}

        stats = last_json(undertow(["stats", "--json"], env).stdout)["unreadable_batches"]
        assert stats["count"] >= 4 and stats["last_reason"] == "corrupt_batch"
        assert [(p["partition"], p["offset"]) for p in stats["held_partitions"]] == [(0, corrupt_offset)]
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(generate_latest(make_registry(engine)).decode())
            for sample in family.samples
        }
        assert samples[("undertow_ingest_unreadable_batches_total", (("reason", "corrupt_batch"),))] >= stats["count"]
        held = {"group": kafka_cfg.group_id, "topic": kafka_cfg.topic, "partition": "0", "reason": "corrupt_batch"}
        assert samples[("undertow_ingest_held_partitions", tuple(sorted(held.items())))] == 1

        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - stopping < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.dispose()
    assert stored_offset(engine, kafka_cfg, 0) in (None, corrupt_offset)
