"""Ingest benchmark: the raw kafka-python consume rate next to the full ingest rate, same data, one run.

Data: realistic telemetry from :mod:`ingest.synthetic` (sessions with token ids, logprobs and
routed experts, K-candidate groups, retention at three horizons, edits, thumbs, switches),
produced once to a fresh topic on the embedded broker.

- baseline ``raw_events_per_s``: a plain ``KafkaConsumer`` reading every partition from the start
  and JSON-decoding each value, nothing else;
- ``ingest_events_per_s``: :class:`ingest.consumer.IngestConsumer` over the same records
  (consume, validate against the contract, idempotent batched write, offsets stored in the same
  transaction, Kafka commit), until caught up, with its default writer (``writer``: validation
  in two processes beside the polling one, started from multiprocessing's fork server);
- both rates run from the first record received to the last one handled (connection set-up,
  the same for both, is left out); the baseline runs twice, before and after the ingest, and
  ``raw_events_per_s`` is the mean of the two (``raw_passes``), so a machine that speeds up or
  slows down during the run moves both sides of the ratio alike;
- 60,000 events by default: the ingest of 20,000 lasts about a second, in which filling and
  draining the pipeline (three batches in flight) weighs on the rate;
- latency: a steady stream produced while the consumer runs; from the producer's record
  timestamp to the commit of the transaction holding the row (p50, p99);
- ``lost`` / ``duplicated``: produced event ids missing from the database / recorded twice.

Usage: ``python benchmarks/ingest.py --json`` (a fresh SQLite file); ``--database postgresql``: a fresh
PostgreSQL database, created through ``--pg-admin-url`` (default: ``UNDERTOW_TEST_PG_ADMIN_URL``, else
the local server the tests use) and dropped afterwards; ``--database-url URL``: an existing database.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import BatchReport, IngestConsumer, fetch_options
from ingest.db import make_engine, transaction, upgrade
from ingest.embedded import EmbeddedBroker, create_topics
from ingest.producer import TelemetryProducer, event_key
from ingest.schemas import validate_event
from ingest.synthetic import default_trace_path, generate, load_rates
from ingest.tables import DuplicateRow, SessionRow, SignalRow

PG_ADMIN_URL = "postgresql+psycopg://root@127.0.0.1:5432/postgres"
"""Where ``--database postgresql`` creates its database unless told otherwise (the tests' local server)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def encode(events: list[dict]) -> list[tuple[bytes | None, bytes]]:
    out = []
    for e in events:
        out.append((event_key(validate_event(e)), json.dumps(e).encode()))
    return out


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]], rate: float | None = None) -> None:
    with TelemetryProducer(bootstrap, topic, linger_ms=20, batch_size=1 << 18) as producer:
        started = time.monotonic()
        futures = []
        for i, (key, value) in enumerate(messages):
            futures.append(producer.send_raw(value, key=key))
            if rate:
                ahead = i / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush()
        for fut in futures:
            fut.get(timeout=60)


def raw_consume(bootstrap: str, kafka: KafkaConfig, ingest: IngestConfig, expected: int) -> float:
    """Baseline: consume and JSON-decode every record; returns records per second.

    Same client options, batch size and poll timeout as the ingest consumer, timed the same way:
    from the first record received to the last one handled.
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(client_id="bench-raw", **fetch_options(bootstrap, kafka, ingest))
    parts = consumer.partitions_for_topic(kafka.topic) or set()
    consumer.assign([TopicPartition(kafka.topic, p) for p in sorted(parts)])
    n = 0
    first: float | None = None
    last = time.monotonic()
    while n < expected:
        batch = consumer.poll(timeout_ms=ingest.poll_timeout_ms, max_records=ingest.batch_size)
        records = [r for part in batch.values() for r in part]
        if records and first is None:
            first = time.monotonic()
        for rec in records:
            json.loads(rec.value)
        n += len(records)
        last = time.monotonic()
    consumer.close()
    return n / (last - (first or last))


def check(engine: object, event_ids: set[str]) -> tuple[int, int]:
    """(lost, duplicated) for this run's event ids."""
    ids = list(event_ids)
    stored: list[str] = []
    dupes = 0
    with transaction(engine) as s:  # type: ignore[arg-type]
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            stored += list(
                s.scalars(
                    SessionRow.__table__.select()
                    .with_only_columns(SessionRow.event_id)
                    .where(SessionRow.event_id.in_(chunk))
                )
            )
            stored += list(
                s.scalars(
                    SignalRow.__table__.select()
                    .with_only_columns(SignalRow.event_id)
                    .where(SignalRow.event_id.in_(chunk))
                )
            )
            dupes += len(
                list(
                    s.scalars(
                        DuplicateRow.__table__.select()
                        .with_only_columns(DuplicateRow.id)
                        .where(DuplicateRow.event_id.in_(chunk))
                    )
                )
            )
    lost = len(event_ids - set(stored))
    return lost, dupes + (len(stored) - len(set(stored)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--events", type=int, default=60000, help="events for the rate comparison")
    parser.add_argument("--latency-events", type=int, default=3000, help="events in the steady stream")
    parser.add_argument("--latency-rate", type=float, default=1500.0, help="events/s of the steady stream")
    parser.add_argument(
        "--database", choices=["sqlite", "postgresql"], default="sqlite", help="a fresh database of this kind"
    )
    parser.add_argument("--database-url", default=None, help="an existing database instead of a fresh one")
    parser.add_argument("--pg-admin-url", default=os.environ.get("UNDERTOW_TEST_PG_ADMIN_URL", PG_ADMIN_URL))
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    from scheduler.runtime.logs import configure_logging

    configure_logging("WARNING")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    tmp = tempfile.TemporaryDirectory()
    with fresh_database(args, Path(tmp.name)) as url:
        result = run(args, url, seed)
    tmp.cleanup()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


@contextlib.contextmanager
def fresh_database(args: argparse.Namespace, tmp: Path) -> Iterator[str]:
    """The database URL to ingest into: ``--database-url``, else a fresh SQLite file or PostgreSQL database."""
    if args.database_url:
        yield args.database_url
        return
    if args.database == "sqlite":
        yield f"sqlite:///{tmp / 'bench.db'}"
        return
    from sqlalchemy import create_engine, text

    name = f"undertow_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield args.pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run(args: argparse.Namespace, url: str, seed: int) -> dict[str, object]:
    """Produce, measure both sides, check what was stored; the result object."""
    upgrade(url)
    engine = make_engine(url)

    rates = load_rates(trace) if (trace := default_trace_path()) else None
    log("generating telemetry ...")
    events: list[dict] = []
    n_req = max(1, args.events // 3)
    while len(events) < args.events + args.latency_events:
        batch = generate(n_req, seed=seed + len(events), rates=rates, duplicate_share=0.0)
        events += [it.event for it in batch.items]
    bulk, stream = events[: args.events], events[args.events : args.events + args.latency_events]
    bulk_msgs, stream_msgs = encode(bulk), encode(stream)
    mean_bytes = float(np.mean([len(v) for _, v in bulk_msgs]))

    kafka = KafkaConfig(topic=f"bench-{seed}", dlq_topic=f"bench-{seed}.dlq", group_id=f"bench-{seed}", partitions=4)
    ingest = IngestConfig(batch_size=1000, poll_timeout_ms=100)
    with EmbeddedBroker() as broker:
        create_topics(broker.bootstrap, {kafka.topic: 4, kafka.dlq_topic: 1})
        log(f"producing {len(bulk_msgs)} events ({mean_bytes:.0f} B each) ...")
        t0 = time.perf_counter()
        produce(broker.bootstrap, kafka.topic, bulk_msgs)
        produce_rate = len(bulk_msgs) / (time.perf_counter() - t0)

        log("baseline: raw consume + JSON decode ...")
        raw_passes = [raw_consume(broker.bootstrap, kafka, ingest, len(bulk_msgs))]

        log("ingest: consume, validate, write, commit ...")
        stats = IngestConsumer(engine, broker.bootstrap, kafka, ingest, mode="assign").run(once=True)
        assert stats.first_record_s is not None and stats.last_commit_s is not None
        ingest_rate = stats.records / (stats.last_commit_s - stats.first_record_s)

        log("baseline again, after the ingest ...")
        raw_passes.append(raw_consume(broker.bootstrap, kafka, ingest, len(bulk_msgs)))
        raw_rate = float(np.mean(raw_passes))

        log(f"latency: {len(stream_msgs)} events at {args.latency_rate:.0f}/s while the consumer runs ...")
        latencies: list[float] = []

        def on_commit(report: BatchReport) -> None:
            latencies.extend(report.committed_at * 1000 - ts for ts in report.timestamps_ms)

        consumer = IngestConsumer(engine, broker.bootstrap, kafka, ingest, mode="assign", on_commit=on_commit)
        thread = threading.Thread(target=consumer.run, kwargs={"max_seconds": 120}, daemon=True)
        thread.start()
        time.sleep(1.0)
        produce(broker.bootstrap, kafka.topic, stream_msgs, rate=args.latency_rate)
        deadline = time.monotonic() + 60
        while len(latencies) < len(stream_msgs) and time.monotonic() < deadline:
            time.sleep(0.1)
        consumer.stop()
        thread.join(timeout=30)

    lost, duplicated = check(engine, {e["event_id"] for e in bulk + stream})
    result = {
        "events": len(bulk_msgs),
        "database": engine.dialect.name,
        "mean_event_bytes": round(mean_bytes),
        "produce_events_per_s": round(produce_rate),
        "raw_events_per_s": round(raw_rate),
        "raw_passes": [round(r) for r in raw_passes],
        "ingest_events_per_s": round(ingest_rate),
        "ratio": round(ingest_rate / raw_rate, 3),
        "p50_latency_ms": round(float(np.percentile(latencies, 50)), 1) if latencies else None,
        "p99_latency_ms": round(float(np.percentile(latencies, 99)), 1) if latencies else None,
        "latency_events": len(latencies),
        "mean_batch": round(stats.records / max(1, stats.batches), 1),
        "writer": ingest.writer,
        "lost": lost,
        "duplicated": duplicated,
        "note": "absolute rates move with the machine's load; the ratio is measured within one run",
    }
    engine.dispose()
    return result


if __name__ == "__main__":
    main()
