"""Event builders and the command-line runner shared by the ingest tests (imported as ``ingest_helpers``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import exists, func, select

from ingest.config import KafkaConfig
from ingest.db import transaction
from ingest.producer import TelemetryProducer
from ingest.tables import DuplicateRow, SegmentRow, SessionRow, SignalRow


def session_event(i: int, **over: Any) -> dict[str, Any]:
    """A valid ``session.completed`` envelope; keyword arguments override envelope fields."""
    from ingest.synthetic import flat_session

    event = flat_session(i, seed=7, n_tokens=6)
    event.update(over)
    return event


def signal_event(event_id: str, kind: str, session_id: str | None, payload: dict[str, Any]) -> dict[str, Any]:
    """A valid signal envelope."""
    event: dict[str, Any] = {
        "schema_version": 1,
        "event_id": event_id,
        "type": kind,
        "occurred_at": "2025-01-06T12:05:00+01:00",
        "user_id": "user-1",
        "payload": payload,
    }
    if session_id is not None:
        event["session_id"] = session_id
    return event


def raw(event: dict[str, Any]) -> bytes:
    """Wire bytes of an envelope, as any producer would send them."""
    return json.dumps(event).encode()


def stream_events(n_sessions: int, seed: int = 11) -> list[dict[str, Any]]:
    """``2 * n_sessions`` cheap valid events: a session and a retention signal for each."""
    from ingest.synthetic import flat_session

    events: list[dict[str, Any]] = []
    for i in range(n_sessions):
        session = flat_session(i, seed=seed, n_tokens=4)
        events.append(session)
        events.append(
            signal_event(
                f"ret-{seed}-{i}",
                "code.retained",
                session["session_id"],
                {"horizon_s": 300, "lines_written": 2, "lines_retained": i % 3},
            )
        )
    return events


class TcpProxy:
    """A TCP forwarder on 127.0.0.1 that a test can cut (``stop``) and restore (``start``)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        import socket
        import threading

        self.target = (target_host, target_port)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._listener: Any = None
        self._conns: list[Any] = []
        self._lock = threading.Lock()
        self._generation = 0

    def start(self) -> None:
        import socket
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        with self._lock:
            self._generation += 1
            self._listener = listener
            generation = self._generation
        threading.Thread(target=self._accept, args=(listener, generation), daemon=True).start()

    def _accept(self, listener: Any, generation: int) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if generation != self._generation or self._listener is None:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        import socket

        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def stop(self) -> None:
        """Refuse new connections and reset every open one (the database 'goes away')."""
        import socket

        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            listener.close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


DATA = Path(__file__).parent / "data"
"""Third-party trace slices (with attribution) used by the ingest tests."""


REPO = Path(__file__).resolve().parents[2]


def undertow(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def cli_env(tmp_path: Path, bootstrap: str | None, kafka_cfg: KafkaConfig) -> dict[str, str]:
    env = dict(os.environ, UNDERTOW_HOME=str(tmp_path / "home"))
    env.update(
        UNDERTOW_KAFKA__TOPIC=kafka_cfg.topic,
        UNDERTOW_KAFKA__DLQ_TOPIC=kafka_cfg.dlq_topic,
        UNDERTOW_KAFKA__GROUP_ID=kafka_cfg.group_id,
        UNDERTOW_KAFKA__PARTITIONS=str(kafka_cfg.partitions),
    )
    env.pop("UNDERTOW_DATABASE_URL", None)
    if bootstrap:
        env["UNDERTOW_KAFKA_BOOTSTRAP"] = bootstrap
    else:
        env.pop("UNDERTOW_KAFKA_BOOTSTRAP", None)
    return env


def last_json(out: str) -> Any:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line on stdout, got {out!r}"
    return json.loads(lines[-1])


def stored_ids(engine: Any) -> list[str]:
    with transaction(engine) as s:
        return list(s.scalars(select(SessionRow.event_id))) + list(s.scalars(select(SignalRow.event_id)))


def stored_count(engine: Any) -> int:
    with transaction(engine) as s:
        return int(s.scalar(select(func.count()).select_from(SessionRow)) or 0) + int(
            s.scalar(select(func.count()).select_from(SignalRow)) or 0
        )


def duplicate_count(engine: Any) -> int:
    with transaction(engine) as s:
        return int(s.scalar(select(func.count()).select_from(DuplicateRow)) or 0)


def produce_in_background(
    bootstrap: str, topic: str, events: list[dict[str, Any]], rate: float, client: str = "kafka-python"
) -> threading.Thread:
    """Send ``events`` at about ``rate`` per second from a thread (acks=all, every send checked), with
    kafka-python (the project's producer) or librdkafka (idempotent, lz4-compressed, with headers)."""

    def run() -> None:
        if client == "librdkafka":
            run_librdkafka()
            return
        with TelemetryProducer(bootstrap, topic) as producer:
            started = time.monotonic()
            futures = []
            for i, ev in enumerate(events):
                futures.append(producer.send(ev))
                ahead = i / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
            producer.flush()
            for fut in futures:
                fut.get(timeout=60)

    def run_librdkafka() -> None:
        from confluent_kafka import Producer

        failed: list[Any] = []
        producer = Producer(
            {"bootstrap.servers": bootstrap, "enable.idempotence": True, "compression.type": "lz4", "linger.ms": 20}
        )
        started = time.monotonic()
        for i, ev in enumerate(events):
            headers = [("source", b"editor-plugin"), ("trace-id", str(i).encode())]
            producer.produce(
                topic,
                raw(ev),
                key=(ev.get("session_id") or ev["event_id"]).encode(),
                headers=headers,
                on_delivery=lambda err, _msg: failed.append(err) if err else None,
            )
            producer.poll(0)
            ahead = i / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
        assert producer.flush(60) == 0 and not failed

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


def assert_exactly_once(engine: Any, events: list[dict[str, Any]]) -> None:
    ids = stored_ids(engine)
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} events stored twice"
    missing = {e["event_id"] for e in events} - set(ids)
    assert not missing and len(ids) == len(events), f"{len(missing)} events missing, {len(ids)} stored of {len(events)}"
    assert duplicate_count(engine) == 0, f"{duplicate_count(engine)} deliveries counted as duplicates"
    assert_segments_whole(engine, events)


def assert_segments_whole(engine: Any, events: list[dict[str, Any]]) -> None:
    """Every stored session has each of its segments once, and no segment is without its session
    (segments have no foreign key: the writer's transaction is what keeps them together)."""
    sessions = [e for e in events if e.get("type") == "session.completed"]
    with transaction(engine) as s:
        orphans = s.scalar(
            select(func.count())
            .select_from(SegmentRow)
            .where(~exists().where(SessionRow.session_id == SegmentRow.session_id))
        )
        per_session = dict(
            s.execute(select(SegmentRow.session_id, func.count()).group_by(SegmentRow.session_id)).tuples().all()
        )
    assert orphans == 0, f"{orphans} segments without their session"
    expected = {e["session_id"]: len(e["payload"]["segments"]) for e in sessions}
    wrong = {sid: (per_session.get(sid), n) for sid, n in expected.items() if per_session.get(sid) != n}
    assert not wrong and len(per_session) == len(expected), f"segments (stored, sent) per session: {wrong}"


def reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill and wait for each process of ``procs`` still running (a test's cleanup)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_ingest(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``undertow ingest`` (group mode, until stopped) as a subprocess; its log appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", "from scheduler.cli import main; main()", "ingest"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
