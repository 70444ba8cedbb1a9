"""The consumer against the embedded broker and both databases: bad input, duplicates, DLQ, replay."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from typing import Any

import pytest
from ingest_helpers import raw, session_event, signal_event, stream_events
from sqlalchemy import func, select

from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import IngestConsumer
from ingest.db import transaction
from ingest.dlq import list_dead_letters, replay
from ingest.stats import stats
from ingest.tables import DeadLetterRow, SessionRow, SignalRow


def consume_once(engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig) -> Any:
    return IngestConsumer(engine, broker.bootstrap, kafka_cfg, ingest_cfg, mode="assign").run(once=True, max_seconds=60)


def dlq_topic_values(bootstrap: str, topic: str, expected: int) -> list[tuple[bytes, dict[str, bytes]]]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=5000)
    out = []
    for rec in consumer:
        out.append((rec.value, dict(rec.headers)))
        if len(out) >= expected:
            break
    consumer.close()
    return out


def test_bad_input_goes_to_dead_letters_and_partition_keeps_flowing(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    mismatch = session_event(1)
    mismatch["payload"]["segments"][0]["logprobs"] = [-0.1]
    missing = session_event(2)
    del missing["payload"]["model"]
    bad: list[tuple[bytes, str]] = [
        (b"{this is not json", "invalid_json"),
        (b"\xff\xfe\x00garbage", "invalid_json"),
        (raw(session_event(3, type="session.exploded")), "unknown_type"),
        (raw(session_event(4, schema_version=2)), "unsupported_schema_version"),
        (raw(missing), "validation_error"),
        (raw(mismatch), "logprobs_length_mismatch"),
        (b'{"pad": "' + b"x" * (1 << 20) + b'"}', "oversized"),
        (b"[1, 2, 3]", "validation_error"),
        (b"", "invalid_json"),
    ]
    # Everything goes to one key, so one partition: valid events before, between and after.
    key = b"one-partition"
    producer.send_raw(raw(session_event(100)), key=key)
    for value, _ in bad:
        producer.send_raw(value, key=key)
        producer.send_raw(raw(session_event(101 + len(value) % 7 + 10 * bad.index((value, _)))), key=key)
    producer.flush()

    result = consume_once(engine, broker, kafka_cfg, ingest_cfg)

    assert result.dead_letters == len(bad)
    assert result.stored == len(bad) + 1
    with transaction(engine) as s:
        letters = s.execute(select(DeadLetterRow).order_by(DeadLetterRow.offset)).scalars().all()
        assert [(dl.value, dl.reason) for dl in letters] == bad
        assert all(dl.topic == kafka_cfg.topic and dl.key == key for dl in letters)
        assert len({dl.partition for dl in letters}) == 1
        assert s.scalar(select(func.count()).select_from(SessionRow)) == len(bad) + 1
    on_topic = dlq_topic_values(broker.bootstrap, kafka_cfg.dlq_topic, len(bad))
    assert sorted(v for v, _ in on_topic) == sorted(v for v, _ in bad)
    assert {h["reason"].decode() for _, h in on_topic} == {r for _, r in bad}


def test_duplicates_and_early_signals(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    retained = signal_event(
        "ret-1", "code.retained", "sess-7-5", {"horizon_s": 300, "lines_written": 4, "lines_retained": 3}
    )
    thumbs = signal_event("thumb-1", "feedback.thumbs", "sess-7-5", {"value": -1})
    for event in (retained, thumbs, retained, session_event(5), session_event(5), thumbs):
        producer.send(event)
    producer.send(signal_event("ghost-1", "edit.accepted", "never-arrives", {"lines": 2}))
    producer.flush()
    first = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (first.stored, first.duplicates) == (4, 3)
    # The same events again, later: still stored once.
    for event in (retained, session_event(5)):
        producer.send(event)
    producer.flush()
    second = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (second.stored, second.duplicates, second.records) == (0, 2, 2)
    data = stats(engine)
    assert data.pop("unreadable_batches")["count"] == 0
    assert data == {
        "events": {"session.completed": 1, "code.retained": 1, "edit.accepted": 1, "feedback.thumbs": 1},
        "sessions": 1,
        "duplicates": 5,
        "dead_letters": 0,
    }
    with transaction(engine) as s:
        row = s.execute(select(SignalRow).where(SignalRow.event_id == "ret-1")).scalar_one()
        assert (row.horizon_s, row.value, row.session_id) == (300, 0.75, "sess-7-5")


def test_replay_after_fix(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    small = kafka_cfg.model_copy(update={"max_message_bytes": 400})
    producer.send(session_event(8))
    producer.send(session_event(9))
    producer.flush()
    first = consume_once(engine, broker, small, ingest_cfg)
    assert (first.stored, first.dead_letters) == (0, 2)
    assert {dl["reason"] for dl in list_dead_letters(engine)} == {"oversized"}

    # The fix: a limit that fits. Replay re-produces the raw bytes; they are stored once.
    replayed = replay(engine, producer, reason="oversized")
    assert len(replayed) == 2
    second = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (second.stored, second.dead_letters) == (2, 0)
    letters = list_dead_letters(engine)
    assert all(dl["replay_count"] == 1 and dl["replayed_at"] for dl in letters)
    assert replay(engine, producer) == []  # nothing pending any more
    # A replay of something already stored counts as a duplicate, never a second row.
    replay(engine, producer, ids=replayed[:1])
    third = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (third.stored, third.duplicates) == (0, 1)


def test_once_on_an_empty_topic_exits(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig
) -> None:
    started = time.monotonic()
    result = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert result.records == 0
    assert time.monotonic() - started < 30


def test_group_consumer_stops_cleanly_and_resumes_from_stored_offsets(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    from ingest.db import make_engine, upgrade

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    for i in range(300):
        producer.send(session_event(1000 + i))
    producer.flush()
    seen: list[int] = []
    consumer = IngestConsumer(
        engine,
        broker.bootstrap,
        kafka_cfg,
        ingest_cfg,
        mode="group",
        on_commit=lambda report: seen.append(report.stored),
    )
    thread = threading.Thread(target=consumer.run, kwargs={"max_seconds": 60})
    thread.start()
    deadline = time.monotonic() + 40
    while sum(seen) < 300 and time.monotonic() < deadline:
        time.sleep(0.1)
    consumer.stop()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert sum(seen) == 300
    for i in range(300, 350):
        producer.send(session_event(1000 + i))
    producer.flush()
    again = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (again.records, again.stored, again.duplicates) == (50, 50, 0)
    engine.dispose()


def test_hostile_payloads_never_crash_the_consumer(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    from ingest.db import make_engine, upgrade

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    hostile = [
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({"schema_version": 1, "event_id": "x" * 10_000, "type": "feedback.thumbs"}).encode(),
        raw(session_event(20, occurred_at=1735689600)),
        raw(signal_event("t-bool", "feedback.thumbs", "s", {"value": True})),
        raw(signal_event("t-big", "user.churned", None, {"inactive_days": 10**40})),
        b'{"schema_version": NaN}',
        raw(session_event(21, session_id="\u0000" * 129)),
    ]
    for value in hostile:
        producer.send_raw(value, key=None)
    producer.send(session_event(22))
    producer.flush()
    result = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (result.dead_letters, result.stored) == (len(hostile), 1)
    engine.dispose()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_each_writer_stores_every_event_once_and_leaves_nothing_running(
    writer: str, engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    events = stream_events(120, seed=21)
    again = events[::7]  # delivered twice: counted, never stored twice
    for ev in events + again:
        producer.send(ev)
    producer.send_raw(b"{not json", key=b"k")
    producer.flush()

    before = set(multiprocessing.active_children())
    result = consume_once(engine, broker, kafka_cfg, ingest_cfg.model_copy(update={"writer": writer}))

    assert (result.stored, result.duplicates, result.dead_letters) == (len(events), len(again), 1)
    assert result.batches > 1  # several batches, so more than one was in flight
    with transaction(engine) as s:
        stored = s.scalar(select(func.count()).select_from(SessionRow)) + s.scalar(
            select(func.count()).select_from(SignalRow)
        )
    assert stored == len(events)
    assert set(multiprocessing.active_children()) <= before  # the writer process ended with the consumer


def test_a_writer_process_that_dies_fails_the_consumer_loudly(engine: Any) -> None:
    import signal

    from ingest.batches import BatchContext, ProcessWriter

    ctx = BatchContext("g", 1 << 20, 0.05, 0.1)
    writer = ProcessWriter(engine, ctx, threading.Event(), lambda error, delay: None)
    record = ("t", 0, 0, None, json.dumps(session_event(1)).encode())
    assert writer.submit([record], {("t", 0): 1}, None).result() is not None  # both processes work
    os.kill(writer._preparer.pid, signal.SIGKILL)  # type: ignore[arg-type]
    writer._preparer.join()
    with pytest.raises(RuntimeError, match="Restart the consumer"):
        writer.submit([record], {("t", 0): 2}, None).result()
    writer._committer.join(10)  # it saw its input end and left
    assert not writer._committer.is_alive()
    writer.close()


def _writer_kind_in_this_process(url: str, out: Any) -> None:
    from ingest.batches import BatchContext, make_writer
    from ingest.db import make_engine

    writer = make_writer(
        make_engine(url), IngestConfig(), BatchContext("g", 1 << 20, 0.05, 0.1), threading.Event(), lambda *a: None
    )
    out.put(type(writer).__name__)
    writer.close()


def test_a_consumer_in_a_daemonic_process_writes_from_a_thread(sqlite_url: str) -> None:
    """Daemonic processes (a pool's workers) may not start children: the writer falls back to a thread."""
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    for daemon, expected in ((True, "ThreadWriter"), (False, "ProcessWriter")):
        child = spawn.Process(target=_writer_kind_in_this_process, args=(sqlite_url, out), daemon=daemon)
        child.start()
        assert out.get(timeout=60) == expected
        child.join(30)
        assert child.exitcode == 0


def test_a_nul_in_an_identifier_is_a_dead_letter_not_a_failed_batch(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    """PostgreSQL cannot store NUL in text: an id holding one used to fail its whole batch there, forever.
    The contract refuses NUL in identifiers, so on both databases the event is a dead letter that names
    the field, and its batch-mates are stored (NUL in free text is kept: see the writer's test)."""
    nul_user = session_event(30, user_id="user\x00one")
    nul_session = signal_event("th-nul", "feedback.thumbs", "sess\x00x", {"value": 1})
    nul_finish = session_event(31)
    nul_finish["payload"]["finish_reason"] = "st\x00p"
    nul_text = session_event(32)
    nul_text["payload"]["prompt"]["text"] = "a\x00b"
    good = [session_event(33), nul_text]
    for event in (good[0], nul_user, nul_session, nul_finish, nul_text):
        producer.send_raw(raw(event), key=b"one-partition")  # one batch, one transaction
    producer.flush()
    result = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (result.stored, result.dead_letters) == (len(good), 3)
    letters = list_dead_letters(engine)
    assert sorted(d["reason"] for d in letters) == ["validation_error"] * 3
    assert all("NUL" in d["detail"] for d in letters), [d["detail"] for d in letters]
    with transaction(engine) as s:
        assert set(s.scalars(select(SessionRow.event_id))) == {e["event_id"] for e in good}
    engine.dispose()


def test_batches_in_flight_together_store_a_key_once(engine: Any) -> None:
    """The process writer has several batches in flight (on PostgreSQL two are written at once, each in
    its own transaction). A session re-sent under a fresh event id in the next batch, and an event
    delivered again in the one after, are duplicates there: every key stored once, offsets in order."""
    from ingest.batches import BatchContext, ProcessWriter
    from ingest.writer import load_offsets

    def record(offset: int, event: dict[str, Any]) -> tuple[str, int, int, None, bytes]:
        return ("t", 0, offset, None, raw(event))

    thumbs = signal_event("th-9", "feedback.thumbs", "sess-7-40", {"value": 1})
    batches = [
        [record(0, session_event(40))],
        [record(1, session_event(40, event_id="resent")), record(2, thumbs)],
        [record(3, thumbs), record(4, session_event(41))],
    ]
    writer = ProcessWriter(engine, BatchContext("g", 1 << 20, 0.05, 0.1), threading.Event(), lambda *a: None)
    try:
        pending = [writer.submit(b, {("t", 0): b[-1][2] + 1}, None) for b in batches]  # all in flight at once
        results = [p.result() for p in pending]
    finally:
        writer.close()
    assert [(r.result.stored, r.result.duplicates) for r in results if r] == [(1, 0), (1, 1), (1, 1)]
    assert results[1] is not None and results[1].result.duplicate_ids == ["resent"]
    with transaction(engine) as s:
        assert set(s.scalars(select(SessionRow.event_id))) == {"ev-7-40", "ev-7-41"}
        assert list(s.scalars(select(SignalRow.event_id))) == ["th-9"]
        assert load_offsets(s, "g", "t") == {0: 5}
