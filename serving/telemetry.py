"""Telemetry emission that never blocks or fails a user request.

The gateway hands each event to :meth:`TelemetryEmitter.emit`, which only puts it on an
in-memory queue (or, when the queue is full, appends it to the spool). A background thread
sends events through :class:`ingest.producer.TelemetryProducer` and waits for each ack; an
event that cannot be sent (broker down, timeout) goes to a bounded on-disk spool of JSON-lines
files, which the thread re-sends, oldest first, once the broker answers again. When the spool
exceeds its bound the oldest file is dropped and its events are counted in ``dropped``.
Re-sending can deliver an event twice; ingest deduplicates on ``event_id``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

SPOOL_FILE_BYTES = 1 << 20


class TelemetryEmitter:
    """Queue -> Kafka, with a bounded disk spool while Kafka is unreachable."""

    def __init__(
        self,
        producer_factory: Callable[[], Any] | None,
        spool_dir: str | Path,
        *,
        max_spool_bytes: int = 64 << 20,
        queue_size: int = 10_000,
        send_timeout_s: float = 5.0,
        retry_interval_s: float = 1.0,
    ) -> None:
        self._factory = producer_factory
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.max_spool_bytes = max_spool_bytes
        self.send_timeout_s = send_timeout_s
        self.retry_interval_s = retry_interval_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self._spool_lock = threading.Lock()
        self._producer: Any = None
        self._down_until = 0.0
        self._seq = 0
        self.stats = {"sent": 0, "spooled": 0, "resent": 0, "dropped": 0, "invalid": 0}
        self._thread = threading.Thread(target=self._run, name="telemetry-emitter", daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def emit(self, event: dict[str, Any]) -> None:
        """Hand over one event; returns at once whatever the state of Kafka."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._spool([event])

    def spool_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.spool_dir.glob("*.jsonl"))

    def pending(self) -> int:
        """Events not yet acknowledged by Kafka (queued plus spooled)."""
        spooled = 0
        with self._spool_lock:
            for p in self.spool_dir.glob("*.jsonl"):
                spooled += sum(1 for _ in p.open())
        return self._queue.qsize() + spooled

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; what is still queued is spooled for the next start."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        rest = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                rest.append(item)
        if rest:
            self._spool(rest)
        if self._producer is not None:
            self._producer.close(timeout=1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._queue.get(timeout=self.retry_interval_s)
            except queue.Empty:
                event = None
            if event is not None and not self._send(event):
                self._spool([event])
            if self._available():
                self._drain_spool()

    def _available(self) -> bool:
        if self._factory is None or time.monotonic() < self._down_until:
            return False
        if self._producer is None:
            try:
                self._producer = self._factory()
            except Exception as exc:  # broker unreachable at connect: back off, spool meanwhile
                log.warning("telemetry.kafka_unavailable", error=str(exc))
                self._down_until = time.monotonic() + self.retry_interval_s
                return False
        return True

    def _send(self, event: dict[str, Any]) -> bool:
        from ingest.schemas import InvalidEvent

        if not self._available():
            return False
        try:
            self._producer.send(event).get(timeout=self.send_timeout_s)
        except InvalidEvent as exc:
            self.stats["invalid"] += 1
            log.error("telemetry.invalid_event", reason=exc.reason, detail=exc.detail)
            return True
        except Exception as exc:  # any delivery failure: spool and retry later with a fresh producer
            log.warning("telemetry.send_failed", error=f"{exc.__class__.__name__}: {exc}")
            producer, self._producer = self._producer, None
            self._down_until = time.monotonic() + self.retry_interval_s
            threading.Thread(target=producer.close, kwargs={"timeout": 0}, daemon=True).start()
            return False
        self.stats["sent"] += 1
        return True

    def _spool(self, events: list[dict[str, Any]]) -> None:
        with self._spool_lock:
            files = sorted(self.spool_dir.glob("*.jsonl"))
            current = files[-1] if files and files[-1].stat().st_size < SPOOL_FILE_BYTES else None
            if current is None:
                self._seq += 1
                current = self.spool_dir / f"{time.time_ns():020d}-{self._seq:06d}.jsonl"
            with current.open("a") as fh:
                for event in events:
                    fh.write(json.dumps(event, separators=(",", ":")) + "\n")
            self.stats["spooled"] += len(events)
            files = sorted(self.spool_dir.glob("*.jsonl"))
            total = sum(p.stat().st_size for p in files)
            while total > self.max_spool_bytes and len(files) > 1:
                oldest = files.pop(0)
                size = oldest.stat().st_size
                self.stats["dropped"] += sum(1 for _ in oldest.open())
                oldest.unlink()
                total -= size
                log.warning("telemetry.spool_full", dropped_file=oldest.name)

    def _drain_spool(self) -> None:
        while True:
            with self._spool_lock:
                files = sorted(self.spool_dir.glob("*.jsonl"))
                if not files:
                    return
                oldest = files[0]
                lines = oldest.read_text().splitlines()
                oldest.unlink()
            for i, line in enumerate(lines):
                if not self._send(json.loads(line)):
                    with self._spool_lock:
                        back = self.spool_dir / f"{0:020d}-{self._seq:06d}-retry.jsonl"
                        self._seq += 1
                        back.write_text("".join(rest + "\n" for rest in lines[i:]))
                    return
                self.stats["resent"] += 1
