"""Signals whose session never arrives: kept and joined while the session may still come, then moved to the
dead letters (``unknown_session``) in one transaction, and stored again, joined, when replayed after it came.

The sweep runs on SQLite and PostgreSQL; the consumer runs it from its loop; ``undertow ingest sweep --json``
runs it by hand. Every sent event ends up stored or dead-lettered, exactly once.
"""

from __future__ import annotations

import base64
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import cli_env, last_json, session_event, signal_event, stored_ids, wait_for
from sqlalchemy import select, update

from ingest import schemas
from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import ConsumerStats, IngestConsumer
from ingest.db import make_engine, transaction, upgrade
from ingest.dlq import list_dead_letters, replay
from ingest.joins import signals_by_session
from ingest.stats import stats
from ingest.tables import DeadLetterRow, SignalRow
from ingest.unmatched import UnmatchedSweeper, sweep_unmatched
from ingest.writer import write_events

DAY = 86400.0


def thumbs(event_id: str, session_id: str | None) -> dict[str, Any]:
    return signal_event(event_id, "feedback.thumbs", session_id, {"value": 1})


def store(engine: Any, events: list[dict[str, Any]], received_at: datetime) -> None:
    with transaction(engine) as s:
        write_events(s, [schemas.validate_event(e) for e in events], received_at=received_at)


def dead_letter_envelopes(engine: Any) -> dict[str, dict[str, Any]]:
    """``{event_id: dead letter}`` of the dead letters, each with its value decoded as ``envelope``."""
    out = {}
    for d in list_dead_letters(engine):
        d["envelope"] = json.loads(base64.b64decode(d["value_b64"]))
        out[d["envelope"]["event_id"]] = d
    return out


def signal_ids(engine: Any) -> set[str]:
    with transaction(engine) as s:
        return set(s.scalars(select(SignalRow.event_id)))


def test_the_sweep_moves_only_waited_out_signals_without_their_session(engine: Any) -> None:
    """Long-waiting signals stay when their session (or, for a whole agent session, a turn of it) is stored;
    fresh ones and ``user.churned`` stay; the rest move once, as replayable envelopes, and stats count them."""
    now = datetime.now(UTC)
    old, fresh = now - timedelta(days=2), now - timedelta(minutes=5)
    churned = signal_event("churn-1", "user.churned", None, {"inactive_days": 30})
    store(engine, [thumbs("early", "sess-7-1"), thumbs("whole-agent", "agent-9"), churned], old)
    store(engine, [thumbs("orphan-a", "gone-a"), thumbs("orphan-b", "gone-b")], old)
    store(engine, [thumbs("fresh", "gone-c")], fresh)
    store(engine, [session_event(1), session_event(2, session_id="agent-9.t0", event_id="turn-0")], now)

    result = sweep_unmatched(engine, DAY, "telemetry")

    assert sorted(m.event_id for m in result.moved) == ["orphan-a", "orphan-b"]
    assert result.examined == 5 and result.caught_up
    assert signal_ids(engine) == {"early", "whole-agent", "churn-1", "fresh"}
    letters = dead_letter_envelopes(engine)
    assert set(letters) == {"orphan-a", "orphan-b"}
    letter = letters["orphan-a"]
    assert letter["reason"] == "unknown_session" and letter["key"] == "gone-a"
    assert "'gone-a'" in letter["detail"] and "had not arrived 172800 s" in letter["detail"]
    replayable = schemas.parse_event(base64.b64decode(letter["value_b64"]), 1 << 20)  # the wire contract
    assert (replayable.event_id, replayable.session_id, replayable.user_id) == ("orphan-a", "gone-a", "user-1")
    assert replayable.occurred_at == datetime(2025, 1, 6, 11, 5, tzinfo=UTC)
    assert letter["envelope"]["payload"] == {"value": 1}
    assert [m.waited_s for m in result.moved] == [pytest.approx(2 * DAY)] * 2

    assert sweep_unmatched(engine, DAY, "telemetry").moved == []  # never moved twice
    data = stats(engine)
    assert (data["dead_letters"], data["unknown_session_dead_letters"]) == (2, 2)
    assert data["events"]["feedback.thumbs"] == 3


def test_a_sweep_that_dies_midway_moves_nothing(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delete and the dead letters are one transaction: a failure after the delete leaves the signal in place."""
    import ingest.unmatched as unmatched

    store(engine, [thumbs("orphan", "gone")], datetime.now(UTC) - timedelta(days=2))

    def die(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("killed between the delete and the dead letter")

    monkeypatch.setattr(unmatched, "DeadLetterRow", die)
    with pytest.raises(RuntimeError, match="killed"):
        sweep_unmatched(engine, DAY, "telemetry")
    monkeypatch.undo()
    assert signal_ids(engine) == {"orphan"} and list_dead_letters(engine) == []
    assert [m.event_id for m in sweep_unmatched(engine, DAY, "telemetry").moved] == ["orphan"]
    assert signal_ids(engine) == set() and len(list_dead_letters(engine)) == 1


def test_each_sweep_is_bounded_and_resumes_from_its_cursor(sqlite_url: str) -> None:
    """The consumer's sweeper examines at most ``max_rows`` signals a sweep and carries on from there; it stops
    at the first signal not waited out yet and takes it up once it is."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    now = datetime.now(UTC)
    store(engine, [thumbs(f"old-{i}", f"gone-{i}") for i in range(7)], now - timedelta(hours=3))
    store(engine, [thumbs("recent", "gone-r")], now - timedelta(minutes=30))
    store(engine, [thumbs("old-7", "gone-7")], now - timedelta(hours=3))  # after a recent one
    sweeper = UnmatchedSweeper(engine, 3600, "telemetry", chunk=2, max_rows=3)
    rounds = []
    while True:
        result = sweeper.sweep(now)
        rounds.append((len(result.moved), result.caught_up))
        if result.caught_up:
            break
    assert rounds == [(3, False), (3, False), (1, True)]
    assert signal_ids(engine) == {"recent", "old-7"}
    later = sweeper.sweep(now + timedelta(hours=1))  # "recent" is waited out now, and "old-7" behind it
    assert sorted(m.event_id for m in later.moved) == ["old-7", "recent"]
    assert signal_ids(engine) == set() and len(list_dead_letters(engine)) == 9
    engine.dispose()


def consume_once(engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig) -> ConsumerStats:
    return IngestConsumer(engine, broker.bootstrap, kafka_cfg, ingest_cfg, mode="assign").run(once=True, max_seconds=60)


def test_the_consumer_sweeps_and_a_replay_after_the_session_joins_it(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    """Over the broker and the consumer: an early signal joins its session; one whose session has not come
    within the TTL is moved by the consumer's own sweep (table and dead-letter topic); replayed once its
    session arrived, it is stored again (not swallowed as a duplicate) and joined. Each event lands once."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    early, lost = thumbs("th-early", "sess-7-1"), thumbs("th-lost", "sess-7-2")
    sent = [early, lost, session_event(1)]
    for event in sent:
        producer.send(event)
    producer.flush()
    assert consume_once(engine, broker, kafka_cfg, ingest_cfg).stored == 3
    with transaction(engine) as s:  # both signals were received two days ago
        s.execute(update(SignalRow).values(received_at=datetime.now(UTC) - timedelta(days=2)))

    swept = consume_once(engine, broker, kafka_cfg, ingest_cfg)  # the sweep runs as the loop starts

    assert swept.unknown_session == 1 and swept.records == 0
    assert signals_by_session(engine, ["sess-7-1"])["sess-7-1"].arrived
    assert set(stored_ids(engine)) == {"th-early", "ev-7-1"} and set(dead_letter_envelopes(engine)) == {"th-lost"}
    from kafka import KafkaConsumer

    dlq = KafkaConsumer(
        kafka_cfg.dlq_topic, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=5000
    )
    on_topic = []
    for record in dlq:
        on_topic.append((json.loads(record.value)["event_id"], dict(record.headers)["reason"]))
        break  # one expected; a second would be read first, in order
    dlq.close()
    assert on_topic == [("th-lost", b"unknown_session")]

    producer.send(session_event(2))  # the session comes after all; the signal is replayed
    producer.flush()
    assert len(replay(engine, producer, reason="unknown_session")) == 1
    third = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (third.stored, third.duplicates, third.dead_letters) == (2, 0, 0)
    joined = signals_by_session(engine, ["sess-7-2"])["sess-7-2"]
    assert joined.arrived and [s.event_id for s in joined.signals] == ["th-lost"]
    ids = stored_ids(engine)
    assert sorted(ids) == sorted({e["event_id"] for e in sent} | {"ev-7-2"})  # each once
    engine.dispose()


def test_a_running_consumer_sweeps_on_its_interval(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    """A tiny TTL on a running consumer: the signal whose session follows at once is joined and stays; the one
    whose session never comes is a dead letter within a few sweeps; nothing is both stored and dead-lettered."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    cfg = ingest_cfg.model_copy(update={"unmatched_signal_ttl_s": 1.5, "unmatched_sweep_interval_s": 0.2})
    consumer = IngestConsumer(engine, broker.bootstrap, kafka_cfg, cfg, mode="assign")
    runner = threading.Thread(target=consumer.run, kwargs={"max_seconds": 60}, daemon=True)
    runner.start()
    try:
        sent = [thumbs("th-joins", "sess-7-3"), session_event(3), thumbs("th-alone", "nobody")]
        for event in sent:
            producer.send(event)
        producer.flush()
        wait_for(lambda: consumer.stats.unknown_session == 1, 30, "the sweep to move the lone signal")
    finally:
        consumer.stop()
        runner.join(30)
    assert not runner.is_alive()
    stored, dead = set(stored_ids(engine)), set(dead_letter_envelopes(engine))
    assert stored == {"th-joins", "ev-7-3"} and dead == {"th-alone"}
    assert stored | dead == {e["event_id"] for e in sent} and not stored & dead
    engine.dispose()


def test_cli_sweep_prints_what_it_moved(tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig) -> None:
    """``undertow ingest sweep --json`` moves waited-out signals, mirrors them on the dead-letter topic, and
    ``undertow stats --json`` counts them in an added field."""
    from typer.testing import CliRunner

    from scheduler.cli import app

    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env["UNDERTOW_DATABASE_URL"] = url
    upgrade(url)
    engine = make_engine(url)
    store(engine, [thumbs("th-gone", "gone")], datetime.now(UTC) - timedelta(days=3))
    engine.dispose()
    runner = CliRunner()
    out = last_json(runner.invoke(app, ["ingest", "sweep", "--json"], env=env, catch_exceptions=False).stdout)
    assert (out["moved"], out["published"], out["caught_up"]) == (1, 1, True)
    assert out["signals"][0]["event_id"] == "th-gone" and out["signals"][0]["session_id"] == "gone"
    counts = last_json(runner.invoke(app, ["stats", "--json"], env=env, catch_exceptions=False).stdout)
    assert (counts["dead_letters"], counts["unknown_session_dead_letters"]) == (1, 1)
    again = last_json(runner.invoke(app, ["ingest", "sweep", "--json"], env=env, catch_exceptions=False).stdout)
    assert again["moved"] == 0
    engine = make_engine(url)
    with transaction(engine) as s:
        assert s.scalar(select(DeadLetterRow.reason)) == "unknown_session"
    engine.dispose()
