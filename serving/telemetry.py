"""Telemetry emission that never blocks or fails a user request, and outlives Kafka outages and
gateway crashes (at least once; ingest keeps each ``event_id`` once).

The path of an event: :meth:`TelemetryEmitter.emit`, on the request's event loop, puts it on a
bounded in-memory queue and does nothing else (no disk, no network). A *router* thread takes it
from there: to the sender's in-memory batch while a Kafka producer is connected and the batch has
room, else to the disk spool (:mod:`serving.spool`: fsync'd segments). A *sender* thread sends
its batch and the spool's oldest segment side by side (``acks=all``) and waits for Kafka's
answer: an event leaves memory, or its segment, only once Kafka acknowledged it; what Kafka did
not acknowledge in ``send_timeout_s`` goes (back) to the spool, and the producer is replaced.
A *connector* thread makes producers: building one against an unreachable broker can take tens
of seconds, and meanwhile the router spools and the sender waits, so neither the request path
nor the sender ever waits on a connect.

The cap (:class:`serving.spool.SpoolBudget`) is hours of traffic. When the spool is fuller than
``signal_share`` of it, signals (every type but ``session.completed``) are shed: :meth:`emit`
refuses them (the gateway answers 503 with ``Retry-After``, so the client can send them again).
``session.completed`` is never shed silently: at the cap the gateway refuses new completions with
503 (:meth:`admits`, ``full_policy="backpressure"``), and the sessions of requests already in
flight are still written; ``full_policy="drop"`` keeps serving and drops them instead, counted
and logged. Every event not kept is counted by type (``dropped_by_type``).

What a ``kill -9`` can lose: events Kafka had not yet acknowledged that were still in memory (the
queue, the sender's batch: at most ``direct_size`` plus ``batch_size`` events while Kafka
answers, the last milliseconds of traffic; while Kafka is down, what was not yet fsync'd). What
is on disk is re-sent at the next start. Left out: writing every event to disk before sending
it (a write-ahead log), which would close that window at the price of a disk write and an fsync
for all telemetry, outage or not.
"""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import structlog

from serving.spool import Spool, SpoolBudget

log = structlog.get_logger(__name__)

CRITICAL_TYPES = frozenset({"session.completed"})
"""Never shed silently: the rollouts training learns from. Every other type is a signal, shed first."""
PRODUCER_OPTIONS: dict[str, int] = {
    "max_block_ms": 3000,
    "request_timeout_ms": 5000,
    "delivery_timeout_ms": 15000,
    "reconnect_backoff_max_ms": 1000,
}
"""kafka-python options for the gateway's producer. ``reconnect_backoff_max_ms``: kafka-python backs off up
to 30 s between reconnects by default, which after a 20 s outage held the drain back 17 s (0.5 s at 1 s);
``delivery_timeout_ms``: records a replaced producer still owes expire, so it closes (:func:`_retire`)."""
SIZE_SAMPLE = 16
"""One event in this many is encoded by the router to measure the mean event size."""


class _Permanent(Exception):
    """An event Kafka will never take (invalid, too large): dropped and counted, never retried."""


def _permanent(exc: BaseException) -> str | None:
    """The counter of an error that no retry can fix (None: retry)."""
    from kafka import errors

    from ingest.schemas import InvalidEvent

    if isinstance(exc, InvalidEvent):
        return "invalid"
    record_level = (
        errors.MessageSizeTooLargeError,
        errors.RecordListTooLargeError,
        errors.InvalidRecordError,
        errors.CorruptRecordError,
    )
    return "rejected" if isinstance(exc, record_level) else None


class TelemetryEmitter:
    """Queue -> Kafka, through an fsync'd disk spool whenever Kafka does not acknowledge."""

    def __init__(
        self,
        producer_factory: Callable[[], Any] | None,
        spool_dir: str | Path,
        *,
        max_spool_bytes: int = 64 << 20,
        queue_size: int = 10_000,
        send_timeout_s: float = 5.0,
        retry_interval_s: float = 1.0,
        spool_hours: float | None = None,
        events_per_s: float | None = None,
        min_free_bytes: int = 0,
        signal_share: float = 0.8,
        full_policy: Literal["backpressure", "drop"] = "backpressure",
        batch_size: int = 256,
        direct_size: int = 512,
    ) -> None:
        self._factory = producer_factory
        self.spool = Spool(spool_dir)
        self.spool_dir = self.spool.dir
        self.budget = SpoolBudget(max_spool_bytes, spool_hours, events_per_s, min_free_bytes)
        self.signal_share = signal_share
        self.full_policy = full_policy
        self.send_timeout_s = send_timeout_s
        self.retry_interval_s = retry_interval_s
        self.batch_size = batch_size
        self.direct_size = direct_size
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=queue_size)
        self._overflow: deque[dict[str, Any]] = deque()
        """``session.completed`` events that found the queue full (bounded by the gateway's back-pressure)."""
        self._direct: deque[dict[str, Any]] = deque()
        """Events for the sender while a producer is connected (at most ``direct_size``)."""
        self._wake = threading.Condition()
        self._producer: Any = None
        self._routing = 0
        self._sending = 0
        self._cap = self._measure_cap()
        self._observed = 0
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = {
            "sent": 0,
            "spooled": 0,
            "resent": 0,
            "dropped": 0,
            "invalid": 0,
            "rejected": 0,
            "send_failures": 0,
            "connects": 0,
            "dropped_by_type": Counter(),
        }
        self._stop_router = threading.Event()
        self._stop_sender = threading.Event()
        self._closed = threading.Event()
        self._need_producer = threading.Event()
        self._need_producer.set()
        self._threads = [
            threading.Thread(target=self._route, name="telemetry-router", daemon=True),
            threading.Thread(target=self._send_loop, name="telemetry-sender", daemon=True),
            threading.Thread(target=self._connect_loop, name="telemetry-connector", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the request path (event loop): no I/O, no waiting -------------------------------------

    def admits(self, kind: str) -> bool:
        """Whether an event of type ``kind`` would be kept now. The gateway asks before serving a completion
        (``session.completed``) and before accepting a signal."""
        if self._queue.full() or self._overflow:
            return False
        used = self.spool.bytes
        if used == 0 and self._producer is not None:
            return True
        limit = self._cap if kind in CRITICAL_TYPES else self.signal_share * self._cap
        return used < limit

    def emit(self, event: dict[str, Any]) -> bool:
        """Hand over one event; returns at once whatever the state of Kafka. False: not kept (a signal shed
        at the cap, or any event when the queue is full), counted in ``dropped_by_type``. A ``session.completed``
        is always kept under ``full_policy="backpressure"`` (the gateway stopped taking new requests)."""
        kind = str(event.get("type"))
        critical = kind in CRITICAL_TYPES
        if not (critical and self.full_policy == "backpressure") and not self.admits(kind):
            self._drop(kind, 1, "shed")
            return False
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            if not critical or self.full_policy == "drop":
                self._drop(kind, 1, "queue_full")
                return False
            self._overflow.append(event)
        return True

    # -- state -------------------------------------------------------------------------------------

    def spool_bytes(self) -> int:
        return self.spool.bytes

    def pending(self) -> int:
        """Events not yet acknowledged by Kafka (in memory plus spooled)."""
        return self._in_memory() + self.spool.events

    def _in_memory(self) -> int:
        return self._queue.qsize() + len(self._overflow) + self._routing + len(self._direct) + self._sending

    @property
    def connected(self) -> bool:
        return self._producer is not None

    def snapshot(self) -> dict[str, Any]:
        """Counters and spool state, for the gateway's metrics."""
        with self._lock:
            out = {**self.stats, "dropped_by_type": dict(self.stats["dropped_by_type"])}
        out.update(
            connected=self.connected,
            in_memory=self._in_memory(),
            spool_bytes=self.spool.bytes,
            spool_events=self.spool.events,
            spool_segments=self.spool.segments(),
            spool_torn_lines=self.spool.torn,
            **self.budget.describe(self._cap),
        )
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: what is in memory is sent if Kafka answers within the timeouts, else spooled for the next start."""
        self._stop_router.set()
        self._threads[0].join(timeout_s)
        self._stop_sender.set()
        with self._wake:
            self._wake.notify_all()
        self._threads[1].join(self.send_timeout_s + timeout_s)
        with self._wake:
            rest = list(self._direct)
            self._direct.clear()
            producer, self._producer = self._producer, None
        rest += list(self._overflow)
        self._overflow.clear()
        while not self._queue.empty():
            rest.append(self._queue.get_nowait())
        self._spill(rest)
        self.spool.close()
        self._closed.set()
        self._need_producer.set()
        if producer is not None:
            with contextlib.suppress(Exception):  # records still owed are in the spool already
                producer.close(timeout=1)

    # -- router: queue -> sender batch or disk -------------------------------------------------

    def _route(self) -> None:
        refreshed = time.monotonic()
        while True:
            batch = self._take()
            if time.monotonic() - refreshed >= 1.0:
                refreshed = time.monotonic()
                try:
                    self._cap = self._measure_cap()
                except OSError as exc:  # the spool's disk: keep the last cap
                    log.error("telemetry.disk_usage_failed", error=str(exc))
            if not batch:
                if self._stop_router.is_set() and self._queue.empty() and not self._overflow:
                    return
                continue
            self._observe(batch)
            with self._wake:
                room = self.direct_size - len(self._direct) if self._producer is not None else 0
                room = max(0, min(room, len(batch)))
                self._direct.extend(batch[:room])
                self._routing -= room
                if room:
                    self._wake.notify_all()
            self._spill(batch[room:])
            self._routing = 0

    def _take(self) -> list[dict[str, Any]]:
        """Up to ``batch_size`` events, overflow first (counted in ``_routing`` as they leave the queue)."""
        batch: list[dict[str, Any]] = []
        while self._overflow and len(batch) < self.batch_size:
            batch.append(self._overflow.popleft())
            self._routing += 1
        if not batch:
            try:
                batch.append(self._queue.get(timeout=0.1))
                self._routing += 1
            except queue.Empty:
                return batch
        while len(batch) < self.batch_size:
            try:
                batch.append(self._queue.get_nowait())
                self._routing += 1
            except queue.Empty:
                break
        return batch

    def _observe(self, batch: list[dict[str, Any]]) -> None:
        sizes = []
        for i, event in enumerate(batch):
            if (self._observed + i) % SIZE_SAMPLE == 0:
                with contextlib.suppress(TypeError, ValueError):  # not JSON: dropped when spilled or sent
                    sizes.append(len(_encode(event)))
        self._observed += len(batch)
        self.budget.observe(len(batch), sizes)

    def _measure_cap(self) -> int:
        free = shutil.disk_usage(self.spool.dir).free
        return self.budget.cap(self.spool.bytes, free)

    def _spill(self, events: list[dict[str, Any]]) -> None:
        """Write ``events`` to the spool with one fsync. Everything :meth:`emit` accepted is written: the cap is
        kept at the door (:meth:`admits`), so it may be passed by what was already accepted (the queue, the
        sender's batch), never by more."""
        if not events:
            return
        lines: list[bytes] = []
        kinds: list[str] = []
        for event in events:
            kind = str(event.get("type"))
            try:
                lines.append(_encode(event))
            except (TypeError, ValueError) as exc:
                self._drop(kind, 1, f"not JSON: {exc}")
                continue
            kinds.append(kind)
        try:
            self.spool.append(lines)
        except OSError as exc:
            for kind, n in Counter(kinds).items():
                self._drop(kind, n, f"spool_write_failed: {exc}")
            return
        self._count("spooled", len(lines))
        with self._wake:
            self._wake.notify_all()  # a connected sender drains it

    # -- sender: batch and oldest segment -> Kafka, acknowledged ----------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop_sender.is_set() and not (
                    self._producer is not None and (self._direct or self.spool.has_segments())
                ):
                    self._wake.wait(self.retry_interval_s)
                stopping = self._stop_sender.is_set()
                producer = self._producer
                if producer is None:
                    return
                batch = [self._direct.popleft() for _ in range(min(len(self._direct), self.batch_size))]
                self._sending = len(batch)
            if stopping and not batch:
                return
            try:
                segment = None if stopping else self.spool.oldest()
                lines = self.spool.read(segment) if segment is not None else []
                self._deliver(producer, batch, segment, lines)
            except Exception as exc:  # the disk (a segment gone, a failed rewrite): keep the events, try again
                log.error("telemetry.sender_error", error=f"{exc.__class__.__name__}: {exc}")
                self._sending = 0
                self._spill(batch)
                self._stop_sender.wait(self.retry_interval_s)

    def _deliver(self, producer: Any, batch: list[dict[str, Any]], segment: Path | None, lines: list[bytes]) -> None:
        """Send the batch and the segment's lines together, wait for Kafka's answers, then settle each event:
        acknowledged, dropped for good (invalid, too large, a corrupt line) or still owed."""
        events: list[dict[str, Any] | None] = list(batch)
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                events.append(None)
                log.error("telemetry.spool_corrupt_line", segment=str(segment), line=line[:200])
        state = ["owed"] * len(events)
        futures: list[tuple[int, Any]] = []
        transient: BaseException | None = None
        for i, event in enumerate(events):
            if event is None:
                state[i] = "dropped"
                self._drop("<corrupt spool line>", 1, "corrupt")
                continue
            try:
                futures.append((i, producer.send(event)))
            except Exception as exc:
                if _permanent(exc) is None:
                    transient = exc
                    break
                state[i] = "dropped"
                self._reject(event, exc)
        deadline = time.monotonic() + self.send_timeout_s
        for i, future in futures:
            try:
                future.get(timeout=max(0.0, deadline - time.monotonic()))
                state[i] = "acked"
            except Exception as exc:
                if _permanent(exc) is None:
                    transient = transient or exc
                else:
                    state[i] = "dropped"
                    self._reject(events[i] or {}, exc)
        first = len(batch)
        self._count("sent", state[:first].count("acked"))
        if segment is not None:
            owed = [line for line, st in zip(lines, state[first:], strict=True) if st == "owed"]
            self.spool.settle(segment, len(lines) - len(owed), owed)
            self._count("resent", state[first:].count("acked"))
        unacked = [event for event, st in zip(batch, state, strict=False) if st == "owed"]
        if transient is not None:
            self._lost_producer(producer, transient, unacked)
        elif unacked:
            self._spill(unacked)
        self._sending = 0

    def _lost_producer(self, producer: Any, exc: BaseException, unacked: list[dict[str, Any]]) -> None:
        """Kafka did not answer: spool what it owes (and what waited for it), replace the producer."""
        log.warning("telemetry.send_failed", error=f"{exc.__class__.__name__}: {exc}", spooled=len(unacked))
        with self._wake:
            if self._producer is producer:
                self._producer = None
                self._need_producer.set()
            waiting = list(self._direct)
            self._direct.clear()
            self._sending += len(waiting)
        self._count("send_failures", 1)
        _retire(producer)
        self._spill(unacked + waiting)

    def _reject(self, event: dict[str, Any], exc: BaseException) -> None:
        kind = str(event.get("type"))
        counter = _permanent(exc) or "rejected"
        self._count(counter, 1)
        self._drop(kind, 1, f"{counter}: {exc.__class__.__name__}: {str(exc)[:200]}")

    # -- connector ------------------------------------------------------------------------------

    def _connect_loop(self) -> None:
        if self._factory is None:
            return
        first = True
        while True:
            self._need_producer.wait()
            if self._closed.is_set():
                return
            if not first and self._closed.wait(self.retry_interval_s):
                return
            first = False
            producer = None
            try:
                producer = self._factory()
                _wait_for_topic(producer)
            except Exception as exc:  # unreachable, or the topic not there yet: spool meanwhile, try again
                log.warning("telemetry.kafka_unavailable", error=f"{exc.__class__.__name__}: {exc}")
                if producer is not None:
                    _retire(producer)
                continue
            with self._wake:
                if self._closed.is_set() or self._stop_sender.is_set():
                    _retire(producer)
                    return
                self._producer = producer
                self._need_producer.clear()
                self._wake.notify_all()
            self._count("connects", 1)
            log.info("telemetry.kafka_connected", spooled_events=self.spool.events)

    # -- counters ---------------------------------------------------------------------------------

    def _count(self, key: str, n: int) -> None:
        if n:
            with self._lock:
                self.stats[key] += n

    def _drop(self, kind: str, n: int, why: str) -> None:
        with self._lock:
            self.stats["dropped"] += n
            self.stats["dropped_by_type"][kind] += n
        if kind in CRITICAL_TYPES or not why.startswith(("shed", "queue_full")):
            log.error("telemetry.dropped", type=kind, events=n, reason=why)


def _retire(producer: Any, give_up_s: float = 300.0) -> None:
    """Close a producer Kafka stopped answering, on a thread of its own. kafka-python's ``close`` flushes first
    and, while records are still owed, raises without stopping its I/O thread; so it is tried again until
    they expire (the producer's ``delivery_timeout_ms``) and the close goes through."""

    def run() -> None:
        deadline = time.monotonic() + give_up_s
        while True:
            try:
                producer.close(timeout=2)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    log.warning("telemetry.producer_not_closed", error=f"{exc.__class__.__name__}: {exc}")
                    return

    threading.Thread(target=run, name="telemetry-retire", daemon=True).start()


def _encode(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def _wait_for_topic(producer: Any) -> None:
    """Wait, on the connector's thread, for the partitions of the producer's topic, so that the sender's
    first send does not wait for them (kafka-python's ``partitions_for``; other producers: nothing)."""
    kafka = getattr(producer, "_producer", producer)
    topic = getattr(producer, "topic", None)
    partitions_for = getattr(kafka, "partitions_for", None)
    if topic and callable(partitions_for):
        partitions_for(topic)
