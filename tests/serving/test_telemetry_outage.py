"""Telemetry through outages: a sender killed with SIGKILL in the middle of a drain and started again,
Kafka cut under load behind a real gateway, a connect that hangs, a full spool, a slow disk. Every
event is counted on the topic by ``event_id``; duplicates may reach Kafka and ingest stores each once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ingest.embedded import create_topics, read_topic
from ingest.producer import TelemetryProducer
from serving.config import GatewayConfig
from serving.gateway import Gateway, create_gateway_app, static_replicas
from serving.launch import ServerThread
from serving.outage import BrokerBehindRelay
from serving.spool import Spool, SpoolBudget
from serving.telemetry import PRODUCER_OPTIONS, TelemetryEmitter

ROOT = Path(__file__).resolve().parents[2]


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def spooled_lines(spool: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in spool.glob("*.jsonl"))


def thumbs(event_id: str, session_id: str = "s") -> dict[str, Any]:
    return {
        "schema_version": 1,
        "event_id": event_id,
        "type": "feedback.thumbs",
        "occurred_at": "2026-01-01T00:00:00+00:00",
        "session_id": session_id,
        "payload": {"value": 1},
    }


def sender(bootstrap: str, topic: str, spool: Path, events: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "tests/serving/telemetry_sender.py", "--bootstrap", bootstrap, "--topic", topic]
    cmd += ["--spool", str(spool), "--events", str(events)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))


def test_kill_9_during_a_drain_then_restart_loses_nothing(fresh_broker, tmp_path, sqlite_url) -> None:  # type: ignore[no-untyped-def]
    """Kafka down from the start: the sender spools every event; Kafka back, the sender drains the spool and
    is SIGKILLed half way; started again, it sends the rest. Every event reaches the topic; the ones that
    were sent twice are stored once."""
    topic = f"drain-{uuid.uuid4().hex[:8]}"
    create_topics(fresh_broker.bootstrap, {topic: 2})
    fresh_broker.kill()
    spool = tmp_path / "spool"
    n = 6000
    first = sender(fresh_broker.bootstrap, topic, spool, n, tmp_path / "sender.log")
    try:
        wait_for(lambda: spooled_lines(spool) == n, 60, "every event spooled while Kafka is down")
        segments = len(list(spool.glob("*.jsonl")))
        assert segments >= 6, segments
        fresh_broker.start()
        create_topics(fresh_broker.bootstrap, {topic: 2})
        wait_for(lambda: len(list(spool.glob("*.jsonl"))) < segments, 60, "the drain to start")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
    left = spooled_lines(spool)
    assert 0 < left < n, f"the kill came {'before' if left == n else 'after'} the drain ({left} of {n} left)"
    on_topic_at_kill = len(read_topic(fresh_broker.bootstrap, topic))
    assert on_topic_at_kill > 0

    second = sender(fresh_broker.bootstrap, topic, spool, 0, tmp_path / "sender.log")
    try:
        wait_for(lambda: not list(spool.glob("*.jsonl")), 60, "the restarted sender to drain the spool")
    finally:
        second.kill()
        second.wait()

    records = read_topic(fresh_broker.bootstrap, topic)
    ids = [r["event_id"] for r in records]
    assert set(ids) == {f"ev-{i}" for i in range(n)}, f"lost: {n - len(set(ids))}"
    duplicates = len(ids) - len(set(ids))

    from sqlalchemy import func, select

    from ingest.config import IngestConfig, KafkaConfig
    from ingest.consumer import IngestConsumer
    from ingest.db import make_engine, transaction, upgrade
    from ingest.tables import DuplicateRow, SignalRow

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    kafka = KafkaConfig(topic=topic, dlq_topic=f"{topic}.dlq", partitions=2)
    IngestConsumer(engine, fresh_broker.bootstrap, kafka, IngestConfig(), mode="assign").run(once=True)
    with transaction(engine) as s:
        stored = s.scalar(select(func.count(func.distinct(SignalRow.event_id))))
        rows = s.scalar(select(func.count()).select_from(SignalRow))
        dupes = s.scalar(select(func.count()).select_from(DuplicateRow))
    engine.dispose()
    assert stored == rows == n
    assert dupes == duplicates


class Load:
    """A fixed rate of completions through the gateway, each followed by a signal on its session."""

    def __init__(self, url: str, rate: float) -> None:
        self.url, self.rate = url, rate
        self.sessions: list[str] = []
        self.signals: list[str] = []
        self.statuses: list[int] = []
        self.latencies_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            start = time.monotonic()
            i = 0
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = client.post(self.url + "/v1/completions", json={"prompt": "def f", "max_tokens": 2})
                self.latencies_ms.append((time.perf_counter() - t0) * 1000)
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    session = r.json()["choices"][0]["session_id"]
                    self.sessions.append(session)
                    event_id = f"sig-{uuid.uuid4().hex}"
                    s = client.post(
                        self.url + "/v1/signals",
                        json={"event_id": event_id, "type": "edit.accepted", "session_id": session, "payload": {}},
                    )
                    self.statuses.append(s.status_code)
                    if s.status_code == 202:
                        self.signals.append(event_id)
                i += 1
                self._stop.wait(max(0.0, start + i / self.rate - time.monotonic()))


def _emitter(bootstrap: str, topic: str, spool: Path, **kwargs: Any) -> TelemetryEmitter:
    return TelemetryEmitter(
        lambda: TelemetryProducer(bootstrap, topic, **PRODUCER_OPTIONS),
        spool,
        retry_interval_s=0.3,
        send_timeout_s=2.0,
        **kwargs,
    )


def test_kafka_outage_under_load_loses_nothing(one_engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with BrokerBehindRelay() as kafka:
        topic = f"load-{uuid.uuid4().hex[:8]}"
        create_topics(kafka.bootstrap, {topic: 2})
        emitter = _emitter(kafka.bootstrap, topic, tmp_path / "spool")
        gateway = Gateway(static_replicas([one_engine.url], "v0"), emitter, GatewayConfig(), "undertow-policy")
        with ServerThread(create_gateway_app(gateway)) as srv:
            with Load(srv.url, rate=8) as load:
                time.sleep(2)
                kafka.cut()
                time.sleep(4)
                assert emitter.spool.events > 0 and not emitter.connected
                kafka.restore()
                time.sleep(3)
            wait_for(lambda: emitter.pending() == 0, 60, "the spool to drain")
            telemetry = httpx.get(srv.url + "/gateway/metrics", timeout=10).json()["telemetry"]
        records = read_topic(kafka.bootstrap, topic)
    assert set(load.statuses) <= {200, 202}, sorted(set(load.statuses))
    sessions = {r["session_id"] for r in records if r["type"] == "session.completed"}
    signals = {r["event_id"] for r in records if r["type"] == "edit.accepted"}
    assert len(load.sessions) >= 50
    assert set(load.sessions) <= sessions, f"{len(set(load.sessions) - sessions)} sessions lost"
    assert set(load.signals) <= signals, f"{len(set(load.signals) - signals)} signals lost"
    assert telemetry["dropped"] == 0 and telemetry["send_failures"] >= 1
    assert telemetry["spooled"] > 0 and telemetry["resent"] > 0 and telemetry["spool_events"] == 0
    assert max(load.latencies_ms) < 2000, max(load.latencies_ms)


def test_at_the_cap_signals_are_shed_first_and_completions_wait(one_engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with BrokerBehindRelay() as kafka:
        topic = f"cap-{uuid.uuid4().hex[:8]}"
        create_topics(kafka.bootstrap, {topic: 2})
        kafka.cut()
        emitter = _emitter(kafka.bootstrap, topic, tmp_path / "spool", max_spool_bytes=40_000, signal_share=0.5)
        cfg = GatewayConfig(backpressure_retry_after_s=2)
        gateway = Gateway(static_replicas([one_engine.url], "v0"), emitter, cfg, "undertow-policy")
        served: list[str] = []
        kept: list[str] = []
        shed: list[str] = []
        with ServerThread(create_gateway_app(gateway)) as srv, httpx.Client(timeout=30) as client:
            for _ in range(300):
                r = client.post(srv.url + "/v1/completions", json={"prompt": "def f", "max_tokens": 2})
                if r.status_code == 503:
                    break
                assert r.status_code == 200, r.text
                served.append(r.json()["choices"][0]["session_id"])
                event_id = f"sig-{uuid.uuid4().hex}"
                s = client.post(
                    srv.url + "/v1/signals",
                    json={"event_id": event_id, "type": "edit.rejected", "session_id": served[-1], "payload": {}},
                )
                assert s.status_code in (202, 503), s.text
                (kept if s.status_code == 202 else shed).append(event_id)
                if s.status_code == 503:
                    assert s.headers["retry-after"] == "2"
                wait_for(lambda: emitter.pending() == emitter.spool.events, 10, "the events to reach the spool")
            assert r.status_code == 503, "the spool never filled"
            assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "TelemetryBackPressure"
            assert shed and kept and len(served) > len(kept), (len(served), len(kept), len(shed))
            telemetry = client.get(srv.url + "/gateway/metrics").json()["telemetry"]
            assert telemetry["dropped_by_type"] == {"edit.rejected": len(shed)}
            assert telemetry["spool_bytes"] <= 40_000 + 10_000  # sessions of requests in flight may pass the cap
            kafka.restore()
            wait_for(lambda: emitter.pending() == 0, 60, "the spool to drain")
            again = client.post(srv.url + "/v1/completions", json={"prompt": "def f", "max_tokens": 2})
            assert again.status_code == 200
            served.append(again.json()["choices"][0]["session_id"])
            wait_for(lambda: emitter.pending() == 0, 30, "the last session to be sent")
        records = read_topic(kafka.bootstrap, topic)
    assert {r["session_id"] for r in records if r["type"] == "session.completed"} == set(served)
    assert {r["event_id"] for r in records if r["type"] == "edit.rejected"} == set(kept)


def test_a_connect_that_hangs_blocks_neither_emit_nor_the_spool(broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A bootstrap address that accepts TCP and never answers: building a producer there takes about 30 s.
    Events are on disk meanwhile, and the next start sends them."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(128)
    spool = tmp_path / "spool"
    dead = f"127.0.0.1:{hole.getsockname()[1]}"
    emitter = TelemetryEmitter(lambda: TelemetryProducer(dead, "unused", **PRODUCER_OPTIONS), spool)
    slowest = 0.0
    for i in range(300):
        t0 = time.perf_counter()
        assert emitter.emit(thumbs(f"hang-{i}"))
        slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 0.05, slowest
    wait_for(lambda: emitter.spool.events == 300, 5, "the events to be on disk while the connect hangs")
    assert not emitter.connected and emitter.snapshot()["connects"] == 0
    t0 = time.perf_counter()
    emitter.close()
    assert time.perf_counter() - t0 < 3
    hole.close()

    topic = f"hang-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap, {topic: 2})
    after = _emitter(broker.bootstrap, topic, spool)
    wait_for(lambda: after.pending() == 0, 30, "the next start to send the spool")
    after.close()
    assert {r["event_id"] for r in read_topic(broker.bootstrap, topic)} == {f"hang-{i}" for i in range(300)}


def test_a_full_queue_never_touches_the_disk_on_the_event_loop(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A disk whose fsync takes 0.3 s and a queue of 4: emitting from the event loop stays instant, sessions
    wait in memory for the router thread, signals beyond the queue are refused and counted."""
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.3)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    emitter = TelemetryEmitter(None, tmp_path / "spool", queue_size=4)

    async def burst() -> tuple[float, int]:
        slowest, refused = 0.0, 0
        for i in range(60):
            t0 = time.perf_counter()
            emitter.emit({"type": "session.completed", "event_id": f"s-{i}"})
            if not emitter.emit({"type": "feedback.thumbs", "event_id": f"t-{i}"}):
                refused += 1
            slowest = max(slowest, time.perf_counter() - t0)
            await asyncio.sleep(0.005)
        return slowest, refused

    slowest, refused = asyncio.run(burst())
    assert slowest < 0.02, slowest
    assert refused > 0 and not emitter.admits("session.completed")
    wait_for(lambda: emitter.pending() == emitter.spool.events, 30, "the router to write everything")
    assert emitter.stats["dropped_by_type"] == {"feedback.thumbs": refused}
    assert emitter.spool.events == 60 + 60 - refused
    emitter.close()


def test_the_spool_settles_segments_and_skips_a_torn_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spool = Spool(tmp_path)
    spool.append([b'{"n":1}\n', b'{"n":2}\n', b'{"n":3}\n'])
    segment = spool.oldest()
    assert segment is not None
    lines = spool.read(segment)
    spool.settle(segment, 2, [lines[1]])  # Kafka took 1 and 3
    assert segment.read_bytes() == b'{"n":2}\n' and spool.events == 1
    spool.append([b'{"n":4}\n'])  # the sealed segment is not appended to
    spool.close()
    with open(sorted(tmp_path.glob("*.jsonl"))[-1], "ab") as fh:
        fh.write(b'{"n":5,"cut sho')  # a write cut by a crash before its fsync
    again = Spool(tmp_path)
    assert again.events == 2 and again.segments() == 2
    read = [again.read(p) for p in sorted(tmp_path.glob("*.jsonl"))]
    assert read == [[b'{"n":2}'], [b'{"n":4}']] and again.torn == 1


def test_the_cap_is_hours_of_traffic() -> None:
    gib = 1 << 30
    configured = SpoolBudget(max_bytes=100 * gib, hours=2, events_per_s=50, started=0.0)
    configured.observe(10, [1000] * 10, now=1.0)
    assert configured.target(now=1.0) == 2 * 3600 * 50 * 1000
    assert configured.cap(0, free_bytes=500 * gib, now=1.0) == 2 * 3600 * 50 * 1000
    assert SpoolBudget(max_bytes=gib, hours=24, events_per_s=50, started=0.0).target() == gib  # ceiling

    measured = SpoolBudget(max_bytes=100 * gib, hours=1, started=0.0)
    assert measured.target(now=5.0) == 100 * gib  # not measured yet: the ceiling
    measured.observe(1200, [2000], now=30.0)
    assert measured.rate(now=30.0) == 40.0  # 1,200 events in the first 30 s
    measured.observe(600, [2000], now=90.0)  # a quieter second minute: the busiest one counts
    assert measured.rate(now=120.0) == 20.0
    assert measured.target(now=120.0) == 3600 * 20 * 2000

    floor = SpoolBudget(max_bytes=100 * gib, hours=1, events_per_s=1000, min_free_bytes=10 * gib, started=0.0)
    floor.observe(1, [1000], now=1.0)
    assert floor.cap(5 << 20, free_bytes=10 * gib + (3 << 20), now=1.0) == 8 << 20  # what is there, plus 3 MiB
    assert floor.cap(0, free_bytes=gib, now=1.0) == 0


def test_a_client_that_hangs_up_at_done_keeps_its_turn_in_telemetry(one_engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The openai SDK closes the connection as soon as it reads ``data: [DONE]``, while the gateway is still
    closing the engine's stream: every streamed turn is emitted all the same."""
    emitter = TelemetryEmitter(None, tmp_path / "spool")
    gateway = Gateway(static_replicas([one_engine.url], "v0"), emitter, GatewayConfig(), "undertow-policy")
    sessions = []
    with ServerThread(create_gateway_app(gateway)) as srv:
        for i in range(30):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": i, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as resp:
                assert resp.status_code == 200
                sessions.append(resp.headers["x-undertow-session-id"])
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        break  # leaving the block closes the connection with the body unread
        wait_for(lambda: emitter.pending() == emitter.spool.events, 10, "the events to reach the spool")
    emitter.close()
    spooled = [json.loads(line) for p in sorted((tmp_path / "spool").glob("*.jsonl")) for line in p.open()]
    assert sorted(e["session_id"] for e in spooled) == sorted(sessions)
