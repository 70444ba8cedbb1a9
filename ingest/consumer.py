"""The ingest consumer: poll a batch, validate, write idempotently, store offsets, then commit.

One batch is one database transaction holding the stored events, the duplicates, the dead
letters and the next offset of every partition in the batch (``consumer_offsets``). The database
is the source of truth for where to resume: on every partition assignment the consumer seeks to
the stored offset, so a consumer killed at any point re-reads exactly what it had not committed,
and nothing is stored twice. Kafka's group offsets are committed afterwards for lag tools only.

Faults:
- bad input: a dead letter (table, then the ``dlq`` topic) with raw bytes, topic, partition,
  offset and reason; the partition keeps flowing.
- database unavailable: the batch is retried with exponential backoff; nothing is committed
  anywhere until it succeeds, so nothing is lost. When the connection drops during ``COMMIT``
  after the server committed, the retry finds the batch's offsets stored and reports what that
  commit did (:func:`ingest.writer.committed_before`): nothing is written again, and the batch's
  own events are not counted as duplicates of themselves.
- broker restart (the embedded broker keeps topics in memory): the client reconnects and the
  topics are created again. Offsets are stored with the Kafka cluster id, which the embedded
  broker draws fresh at every start: a new id means a new log, read from its beginning (records
  read twice around the switch are counted as duplicates, never stored twice or lost).
- ``SIGTERM`` or ``SIGINT``: the batches in hand are finished and committed, then the consumer
  exits (``tests/ingest/test_ingest_signals.py``: within 10 s, under a steady stream).
- a batch that cannot be read (its codec's library missing here, or its bytes corrupt;
  :mod:`ingest.unreadable`): logged with what to do and recorded in the database (``undertow
  stats --json``, ``/metrics``); its partition is paused at the batch's offset (nothing after it
  is stored or skipped) while the others flow, and read again after a back-off that doubles from
  ``unreadable_retry_initial_s`` to ``unreadable_retry_max_s``. With ``once`` it is not read again:
  the consumer catches up with every other partition, then raises :class:`UnreadableBatches`.

Pipelining: batches are validated, written and committed by a writer (:mod:`ingest.batches`: a
validating and a writing process by default, else a thread) while the consumer polls the next
ones. The writer commits them in order, and commits none after a batch that did not commit, so
stored offsets only ever move forward over rows that are stored; Kafka's commit, the dead-letter
topic and ``on_commit`` follow each database commit, in order. The process
writer takes up to three batches (one committing, one being validated, one on its way; on
PostgreSQL five, two of them being written at once); the thread writer one. Before any seek
(partition assignment, revocation, a new cluster) every batch in flight is finished.

Producers: any Kafka client. Batches compressed with gzip, snappy, lz4 or zstd are decoded;
idempotent producers need nothing; transactional ones are read with read-committed isolation, so
records of an aborted transaction are never stored (the embedded broker already withholds them;
a Kafka cluster hands them to clients that read uncommitted).

Validation: :func:`ingest.fastpath.fast_parse` (msgspec) first; what it refuses goes through
:func:`ingest.schemas.parse_event` (pydantic), which accepts it or names the dead-letter reason.
With ``ingest.signing_keys`` set, each record's signature is checked before (:mod:`ingest.signing`):
dead letters ``unsigned`` and ``bad_signature``.

Signals whose session never arrives: every ``unmatched_sweep_interval_s`` the loop moves those
waiting longer than ``unmatched_signal_ttl_s`` to the dead letters (:mod:`ingest.unmatched`: table,
then the dead-letter topic), a bounded amount of work per sweep.

Two modes: ``group`` (subscribe; a consumer group spreads partitions over processes) and
``assign`` (every partition of the topic, no group join: immediate, used by ``--once``).
"""

from __future__ import annotations

import gc
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from kafka import ConsumerRebalanceListener
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from ingest.batches import BatchContext, Pending, RawRecord, SignedRecord, make_writer, quiet_gc
from ingest.config import IngestConfig, KafkaConfig
from ingest.db import transaction
from ingest.dlq import topic_headers
from ingest.redaction import spec_of
from ingest.signing import keyring
from ingest.unmatched import UnmatchedSweeper
from ingest.unreadable import UnreadableBatch, classify
from ingest.unreadable import record as record_unreadable
from ingest.writer import load_offsets

log = structlog.get_logger(__name__)


class UnreadableBatches(RuntimeError):
    """Partitions wait at batches this consumer cannot read (with ``once``: caught up with all the others)."""


@dataclass
class BatchReport:
    """What one committed batch contained (passed to ``on_commit``)."""

    records: int
    stored: int
    duplicates: int
    dead_letters: int
    committed_at: float
    """``time.time()`` right after the database commit."""
    timestamps_ms: list[int] = field(default_factory=list)
    """Kafka record timestamps (producer create time) of the batch."""
    stored_ids: list[str] = field(default_factory=list)


@dataclass
class ConsumerStats:
    """Totals since the consumer started."""

    records: int = 0
    stored: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    batches: int = 0
    db_retries: int = 0
    unknown_session: int = 0
    """Signals moved to the dead letters by the sweep (their session never arrived; :mod:`ingest.unmatched`)."""
    first_record_s: float | None = None
    """``time.monotonic()`` when the first records arrived (rates exclude connection set-up)."""
    last_commit_s: float | None = None
    """``time.monotonic()`` after the last committed batch."""


@dataclass
class _Held:
    """A partition paused at a batch that could not be read, and when to read it again."""

    batch: UnreadableBatch
    delay: float
    """The back-off before this retry (doubles while the same offset keeps failing)."""
    retry_at: float
    """``time.monotonic()`` when to resume the partition (infinite with ``once``)."""
    paused: bool = True


@dataclass
class _InFlight:
    """A batch handed to the writer, and what to do once its transaction committed."""

    future: Pending
    records: int
    offsets: dict[tuple[str, int], int]
    timestamps_ms: list[int]


class IngestConsumer:
    """Consume telemetry into the database (see the module docstring for guarantees)."""

    def __init__(
        self,
        engine: Engine,
        bootstrap: str,
        kafka: KafkaConfig,
        ingest: IngestConfig,
        *,
        mode: str = "group",
        on_commit: Callable[[BatchReport], None] | None = None,
    ) -> None:
        if mode not in ("group", "assign"):
            raise ValueError(f"mode must be 'group' or 'assign', not {mode!r}")
        self.engine = engine
        self.bootstrap = bootstrap
        self.kafka = kafka
        self.cfg = ingest
        self.mode = mode
        self.on_commit = on_commit
        self.stats = ConsumerStats()
        self._stop = threading.Event()
        self._consumer: Any = None
        self._dlq: Any = None
        self._cluster: str | None = None
        self._committed: dict[tuple[str, int], int] = {}
        self._writer: Any = None
        self._in_flight: deque[_InFlight] = deque()
        """Batches handed to the writer, oldest first (at most its ``depth``)."""
        self._failed = False
        """A batch did not commit (stopped while the database was away): nothing after it may commit."""
        self._held: dict[Any, _Held] = {}
        """Partitions at a batch that could not be read (paused, or being read again)."""
        self._signing_keys = tuple(keyring(ingest.signing_keys).values())
        """Keys every record must be signed by (empty: nothing is checked, and headers are not even read)."""
        self._sweeper = UnmatchedSweeper(engine, ingest.unmatched_signal_ttl_s, kafka.topic)
        self._next_sweep = 0.0
        """``time.monotonic()`` when the next sweep of signals whose session never arrived is due."""

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand, commit it and return."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """Stop cleanly on SIGTERM and SIGINT (main thread only)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def _ensure_topics(self) -> None:
        from ingest.embedded import create_topics

        if self.cfg.create_topics:
            create_topics(self.bootstrap, {self.kafka.topic: self.kafka.partitions, self.kafka.dlq_topic: 1})

    def _open(self) -> None:
        from kafka import KafkaConsumer, KafkaProducer

        self._ensure_topics()
        self._consumer = KafkaConsumer(
            group_id=self.kafka.group_id,
            client_id="undertow-ingest",
            session_timeout_ms=self.kafka.session_timeout_ms,
            heartbeat_interval_ms=self.kafka.heartbeat_interval_ms,
            metadata_max_age_ms=5000,
            **fetch_options(self.bootstrap, self.kafka, self.cfg),
        )
        self._dlq = KafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            enable_idempotence=False,
            linger_ms=5,
            max_request_size=max(2 * self.kafka.max_message_bytes, 16 << 20),
            client_id="undertow-ingest-dlq",
        )
        self._consumer.topics()  # first metadata: the cluster id
        self._cluster = self._cluster_now()
        if self.mode == "group":
            self._consumer.subscribe([self.kafka.topic], listener=_SeekToStored(self))
        else:
            self._assign_all()

    def _cluster_now(self) -> str | None:
        """The cluster id in the client's latest metadata."""
        return self._consumer._client.cluster.cluster_id  # type: ignore[no-any-return]

    def _check_cluster(self) -> None:
        """A new cluster id: the broker restarted with an empty log; read it from the beginning."""
        now = self._cluster_now()
        if not now or now == self._cluster:
            return
        log.warning("ingest.new_cluster", old=self._cluster, new=now, topic=self.kafka.topic)
        self._drain()
        self._cluster = now
        self._ensure_topics()
        if self.mode == "assign":
            self._assign_all()
        self._rewind(list(self._consumer.assignment()))

    def _rewind(self, tps: list[Any]) -> None:
        """Seek to the offsets stored for the current cluster, else to the beginning (a new log)."""
        if not tps:
            return
        with transaction(self.engine) as session:
            stored = load_offsets(session, self.kafka.group_id, self.kafka.topic, cluster_id=self._cluster)
        for tp in tps:
            if tp.partition in stored:
                self._consumer.seek(tp, stored[tp.partition])
            else:
                self._consumer.seek_to_beginning(tp)

    def _partitions(self) -> list[Any]:
        from kafka import TopicPartition

        deadline = time.monotonic() + 20
        while True:
            parts = self._consumer.partitions_for_topic(self.kafka.topic)
            if parts:
                return [TopicPartition(self.kafka.topic, p) for p in sorted(parts)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"Topic {self.kafka.topic!r} has no partitions on {self.bootstrap}.")
            self._ensure_topics()
            self._consumer.topics()  # refresh metadata
            time.sleep(0.2)

    def _assign_all(self) -> None:
        tps = self._partitions()
        self._held.clear()  # a new assignment is not paused
        self._consumer.assign(tps)
        self.seek_to_stored(tps)

    def seek_to_stored(self, tps: list[Any]) -> None:
        """Position each partition at the offset stored with the rows (else Kafka's, else earliest)."""
        self._drain()
        now = self._cluster_now()
        if now and now != self._cluster:  # the broker restarted: offsets stored before point into a gone log
            log.warning("ingest.new_cluster", old=self._cluster, new=now, topic=self.kafka.topic)
            self._cluster = now
        with transaction(self.engine) as session:
            every = load_offsets(session, self.kafka.group_id, self.kafka.topic)
            stored = load_offsets(session, self.kafka.group_id, self.kafka.topic, cluster_id=self._cluster)
        for tp in tps:
            if tp.partition in stored:
                self._consumer.seek(tp, stored[tp.partition])
            elif tp.partition in every:  # stored against a log that is gone
                self._consumer.seek_to_beginning(tp)
        log.info("ingest.assigned", partitions=[tp.partition for tp in tps], stored=stored, cluster=self._cluster)

    def close(self) -> None:
        """Close the Kafka clients; the database already holds every batch, Kafka gets a final sync commit."""
        if self._consumer is not None:
            if self._committed:
                self._commit_kafka(dict(self._committed), final=True)
            self._consumer.close(autocommit=False)
            self._consumer = None
        if self._dlq is not None:
            self._dlq.close(timeout=5)
            self._dlq = None

    # -- the loop ----------------------------------------------------------------------------

    def run(self, once: bool = False, max_seconds: float | None = None) -> ConsumerStats:
        """Consume until stopped (or, with ``once``, until caught up with every partition)."""
        from kafka.errors import KafkaError

        thresholds = gc.get_threshold()
        if self.cfg.gc_threshold:
            quiet_gc(self.cfg.gc_threshold)
        ctx = BatchContext(
            self.kafka.group_id,
            self.kafka.max_message_bytes,
            self.cfg.retry_initial_s,
            self.cfg.retry_max_s,
            self.cfg.gc_threshold,
            self._signing_keys,
            spec_of(self.cfg.redaction),
        )
        try:
            # Before the Kafka clients start their threads: the writer processes start here.
            self._writer = make_writer(self.engine, self.cfg, ctx, self._stop, self._on_db_retry)
            self._open()
        except BaseException:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self.cfg.gc_threshold:
                gc.set_threshold(*thresholds)
                gc.unfreeze()
            raise
        started = time.monotonic()
        last_topic_check = time.monotonic()
        broker_delay = self.cfg.retry_initial_s
        try:
            while not self._stop.is_set():
                if max_seconds is not None and time.monotonic() - started > max_seconds:
                    break
                try:
                    if time.monotonic() >= self._next_sweep:
                        self._sweep_unmatched()
                    if self._step(once, time.monotonic() - last_topic_check > self.cfg.topic_check_s):
                        break
                    broker_delay = self.cfg.retry_initial_s
                except KafkaError as exc:  # the broker is away: the client reconnects by itself
                    log.warning("ingest.broker_unavailable", error=str(exc)[:200], retry_in_s=round(broker_delay, 2))
                    self._stop.wait(broker_delay)
                    broker_delay = min(broker_delay * 2, self.cfg.retry_max_s)
                if time.monotonic() - last_topic_check > self.cfg.topic_check_s:
                    last_topic_check = time.monotonic()
            self._drain()
        finally:
            if self._writer is not None:
                self._writer.close()  # a write in flight finishes (its rows and offsets commit together)
                self._writer = None
            self._in_flight.clear()
            self.close()
            if self.cfg.gc_threshold:
                gc.set_threshold(*thresholds)
                gc.unfreeze()
        log.info("ingest.stopped", **vars(self.stats))
        if once and self._held and not self._stop.is_set():
            raise UnreadableBatches("; ".join(held.batch.advice() for held in self._held.values()))
        return self.stats

    def _step(self, once: bool, check_topics: bool) -> bool:
        """One poll and its batch; True when ``once`` is done."""
        while self._in_flight and self._in_flight[0].future.done():
            self._finish(self._in_flight.popleft())
        if self._failed:
            self._stop.set()
            return True
        self._check_cluster()
        self._retry_held()
        cluster = self._cluster
        try:
            batch = self._consumer.poll(timeout_ms=self.cfg.poll_timeout_ms, max_records=self.cfg.batch_size)
        except Exception as exc:  # a batch that cannot be read: hold its partition; anything else propagates
            if not self._hold_unreadable(exc, once):
                raise
            return False
        if self._held:
            for tp in batch:  # read past the batch that failed
                self._held.pop(tp, None)
        records = [r for part in batch.values() for r in part]
        if records and (self._cluster != cluster or (self._cluster_now() or cluster) != cluster):
            # The cluster changed during the poll: these records may come from either log. Drop
            # them (nothing of them is committed) and read the new log from the stored offsets.
            self._check_cluster()
            self._rewind(list(self._consumer.assignment()))
            return False
        if records:
            if self.stats.first_record_s is None:
                self.stats.first_record_s = time.monotonic()
            self._process(records, cluster)
            return False
        self._drain()
        if once and self._caught_up():
            return True
        if check_topics:
            self._recover_topics()
        return False

    def _caught_up(self) -> bool:
        """True when every assigned partition's position has reached its end offset (or waits at a batch
        that could not be read)."""
        assigned = list(self._consumer.assignment())
        if not assigned:
            return False
        readable = [tp for tp in assigned if tp not in self._held]
        if not readable:
            return True
        ends = self._consumer.end_offsets(readable)
        return all(self._consumer.position(tp) >= ends[tp] for tp in readable)

    def _hold_unreadable(self, exc: BaseException, once: bool) -> bool:
        """A poll failed: when on a batch's bytes, pause its partition there, log and record it; else False."""
        reason = classify(exc)
        if reason is None:
            return False
        failed = _forget_failed_fetch(self._consumer)
        if failed is None:  # not where this code knows to find it: stop, rather than spin inside the client
            raise UnreadableBatches(f"a batch could not be read ({exc}) and the Kafka client cannot skip it") from exc
        tp, offset = failed
        batch = UnreadableBatch(tp.topic, tp.partition, offset, reason, str(exc)[:500])
        before = self._held.get(tp)
        delay = self.cfg.unreadable_retry_initial_s
        if before is not None and before.batch.offset == offset:
            delay = min(before.delay * 2, self.cfg.unreadable_retry_max_s)
        self._consumer.pause(tp)
        self._held[tp] = _Held(batch, delay, math.inf if once else time.monotonic() + delay)
        log.error(
            "ingest.unreadable_batch",
            topic=tp.topic,
            partition=tp.partition,
            offset=offset,
            reason=reason,
            retry_in_s=None if once else delay,
            advice=batch.advice(),
        )
        try:
            record_unreadable(self.engine, self.kafka.group_id, batch)
        except DBAPIError as exc2:  # the database is away too: the next failed read records it
            log.warning("ingest.unreadable_not_recorded", error=str(exc2.orig)[:200])
        return True

    def _retry_held(self) -> None:
        """Resume the held partitions whose back-off is over, at the batch that failed."""
        now = time.monotonic()
        for tp, held in self._held.items():
            if held.paused and now >= held.retry_at:
                held.paused = False
                if tp in self._consumer.assignment():
                    self._consumer.resume(tp)
                    self._consumer.seek(tp, held.batch.offset)

    def forget_held(self, tps: list[Any]) -> None:
        """Partitions revoked by a rebalance: their next owner reads them again."""
        for tp in tps:
            self._held.pop(tp, None)

    def _recover_topics(self) -> None:
        """After a broker restart the topics may be gone: create them and re-assign if needed."""
        if self.kafka.topic in self._consumer.topics():
            return
        log.warning("ingest.topic_missing", topic=self.kafka.topic, bootstrap=self.bootstrap)
        self._ensure_topics()
        if self.mode == "assign":
            self._assign_all()

    def _process(self, records: list[Any], cluster: str | None) -> None:
        """Hand a batch to the writer (which validates and writes it) once it has room for it."""
        raw: list[RawRecord] | list[SignedRecord] = []
        offsets: dict[tuple[str, int], int] = {}
        if self._signing_keys:  # the headers travel with the records: the validating process checks signatures
            signed: list[SignedRecord] = []
            for rec in records:
                offsets[(rec.topic, rec.partition)] = rec.offset + 1
                signed.append((rec.topic, rec.partition, rec.offset, rec.key, rec.value, rec.headers))
            raw = signed
        else:
            plain: list[RawRecord] = []
            for rec in records:
                offsets[(rec.topic, rec.partition)] = rec.offset + 1
                plain.append((rec.topic, rec.partition, rec.offset, rec.key, rec.value))
            raw = plain
        if self._writer is None:
            return
        self._drain(keep=self._writer.depth - 1)
        if self._failed:  # a batch before did not commit: neither may this one
            return
        future = self._writer.submit(raw, offsets, cluster)
        self._in_flight.append(_InFlight(future, len(records), offsets, [r.timestamp for r in records]))

    def _drain(self, keep: int = 0) -> None:
        """Wait for the batches in flight, oldest first, until ``keep`` are left."""
        while len(self._in_flight) > keep:
            self._finish(self._in_flight.popleft())

    def _finish(self, batch: _InFlight) -> None:
        """After a batch's commit: dead-letter topic, Kafka commit, stats, ``on_commit``."""
        done = batch.future.result()  # a non-transient database error is raised here
        if done is None:  # stopped while the database was away: nothing committed, nothing lost
            self._failed = True
            return
        result, letters = done.result, done.letters
        self.stats.last_commit_s = done.committed_mono
        self.stats.records += batch.records
        self.stats.stored += result.stored
        self.stats.duplicates += result.duplicates
        self.stats.dead_letters += len(letters)
        self.stats.batches += 1
        for dl in letters:
            self._dlq.send(self.kafka.dlq_topic, key=dl.key, value=dl.value, headers=topic_headers(dl))
        self._commit_kafka(batch.offsets)
        if self.on_commit is not None:
            self.on_commit(
                BatchReport(
                    records=batch.records,
                    stored=result.stored,
                    duplicates=result.duplicates,
                    dead_letters=len(letters),
                    committed_at=done.committed_at,
                    timestamps_ms=batch.timestamps_ms,
                    stored_ids=result.stored_ids,
                )
            )

    def _sweep_unmatched(self) -> None:
        """Move signals whose session did not arrive within the TTL to the dead letters (table, then topic).

        Bounded per call (:class:`~ingest.unmatched.UnmatchedSweeper`); while it has not caught up, the
        next call comes after a second instead of ``unmatched_sweep_interval_s``. A database error is
        logged and the sweep tried again at the next interval: batches are never held up by it.
        """
        interval = self.cfg.unmatched_sweep_interval_s
        try:
            result = self._sweeper.sweep()
        except DBAPIError as exc:
            log.warning("ingest.sweep_failed", error=str(exc.orig)[:200], retry_in_s=interval)
            self._next_sweep = time.monotonic() + interval
            return
        self._next_sweep = time.monotonic() + (interval if result.caught_up else min(interval, 1.0))
        if not result.moved:
            return
        self.stats.unknown_session += len(result.moved)
        log.info(
            "ingest.unknown_session",
            moved=len(result.moved),
            ttl_s=self.cfg.unmatched_signal_ttl_s,
            event_ids=[m.event_id for m in result.moved[:20]],
        )
        for dl in result.letters:
            self._dlq.send(self.kafka.dlq_topic, key=dl.key, value=dl.value, headers=topic_headers(dl))

    def _on_db_retry(self, error: str, delay: float) -> None:
        """A transient database error: the writer retries the batch after ``delay`` seconds."""
        self.stats.db_retries += 1
        log.warning("ingest.db_unavailable", error=error, retry_in_s=round(delay, 2))

    def _commit_kafka(self, offsets: dict[tuple[str, int], int], final: bool = False) -> None:
        """Mirror the stored offsets to Kafka's group offsets (best effort: the database is the truth)."""
        from kafka import OffsetAndMetadata, TopicPartition
        from kafka.errors import KafkaError

        self._committed.update(offsets)
        commit = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        try:
            if final:
                self._consumer.commit(commit)
            else:
                self._consumer.commit_async(commit, callback=_log_commit_failure)
        except KafkaError as exc:
            log.warning("ingest.kafka_commit_failed", error=str(exc)[:200])


def fetch_options(bootstrap: str, kafka: KafkaConfig, ingest: IngestConfig) -> dict[str, Any]:
    """``KafkaConsumer`` options for how the consumer fetches (shared with the benchmark's baseline)."""
    # Records are decoded in the polling thread, as polls take them, not when a fetch arrives; a record
    # larger than the limit still arrives (brokers return the first batch whole).
    fetch_bytes = ingest.fetch_partition_bytes
    return {
        "bootstrap_servers": bootstrap,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        # A transactional producer's aborted records are never read, its open transactions wait.
        "isolation_level": "read_committed",
        "max_poll_records": ingest.batch_size,
        "max_partition_fetch_bytes": fetch_bytes,
        "fetch_max_bytes": 4 * fetch_bytes,
        "receive_message_max_bytes": max(8 * fetch_bytes, 4 * kafka.max_message_bytes, 104857600),
    }


def _forget_failed_fetch(consumer: Any) -> tuple[Any, int] | None:
    """The partition and offset of the batch a poll just failed on, forgotten by the client (else None).

    kafka-python keeps that batch's record iterator, dead after the error, as the next in line: every
    later poll goes back to it and loops over it forever inside the client (a core at 100 %, signals
    never handled). Dropping it lets the partition be paused, then fetched again from that offset.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    part = getattr(fetcher, "_next_partition_records", None)
    tp = getattr(part, "topic_partition", None)
    offset = getattr(part, "next_fetch_offset", None)
    if part is None or tp is None or offset is None:
        return None
    part.drain()
    fetcher._next_partition_records = None  # type: ignore[union-attr]
    return tp, int(offset)


def _log_commit_failure(offsets: Any, response: Any) -> None:
    if isinstance(response, Exception):
        log.warning("ingest.kafka_commit_failed", error=str(response)[:200])


class _SeekToStored(ConsumerRebalanceListener):  # type: ignore[misc]
    """Rebalance listener: on assignment, seek to the offsets stored with the rows."""

    def __init__(self, owner: IngestConsumer) -> None:
        self.owner = owner

    def on_partitions_revoked(self, revoked: Any) -> None:
        """Finish the batch in flight, so the next owner starts from offsets that include it."""
        self.owner._drain()
        self.owner.forget_held(list(revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            self.owner.seek_to_stored(list(assigned))
