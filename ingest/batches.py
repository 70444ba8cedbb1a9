"""One polled batch, one transaction: validate the records, then write rows, dead letters and offsets.

The consumer hands each batch to a writer and polls the next one meanwhile. Two writers ship:

- ``process`` (the default): a writer process forked when the consumer starts, before its Kafka
  clients exist. kafka-python decodes records in Python, so a writer *thread* would hold the
  interpreter lock about as long as the consumer itself (validation, row building and the
  driver's binding are Python too) and the two would mostly take turns; a process runs them on
  another core. It inherits the engine (with its listeners and options) and re-creates the pool,
  so no connection is shared. Batches and answers go over a pipe, in order; while one batch
  commits, the process validates and builds the rows of the next (two in flight). After a batch
  that did not commit, it commits none of those sent after it. The process dies with the
  consumer (``PR_SET_PDEATHSIG``): after a ``kill -9`` its open transaction rolls back, exactly as
  in one process. It never logs itself (a lock held by another thread at
  the fork could block it): it reports database retries to the consumer, which logs them.
- ``thread``: the same work in a thread, where a fork cannot share the database (in-memory
  SQLite) or is not wanted.

Either way a non-transient database error is raised in the consumer, and a batch that did not
commit (stopped while the database was away) reports ``None``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from ingest import schemas
from ingest.config import IngestConfig
from ingest.db import transaction
from ingest.fastpath import FastEvent, fast_parse
from ingest.rows import Codec, codec_for
from ingest.writer import (
    DeadLetter,
    Delivery,
    PreparedEvents,
    WriteResult,
    prepare_events,
    store_offsets,
    write_dead_letters,
    write_prepared,
)

RawRecord = tuple[str, int, int, bytes | None, bytes | None]
"""``(topic, partition, offset, key, value)`` of one Kafka record."""
OnRetry = Callable[[str, float], None]
"""Told about each transient database error: the error text and the backoff before the retry."""


@dataclass
class BatchDone:
    """What a committed batch did (sent from the writer to the consumer)."""

    result: WriteResult
    letters: list[DeadLetter]
    committed_at: float
    """``time.time()`` right after the commit."""
    committed_mono: float
    """``time.monotonic()`` right after the commit (one clock for every process on the machine)."""


@dataclass(frozen=True)
class BatchContext:
    """What every batch of one consumer shares."""

    group_id: str
    max_message_bytes: int
    retry_initial_s: float
    retry_max_s: float


class Pending(Protocol):
    """A batch handed to a writer."""

    def done(self) -> bool: ...

    def result(self) -> BatchDone | None: ...


def is_transient(exc: BaseException) -> bool:
    """A database error worth retrying: the connection or the server, not the statement."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def parse_records(records: list[RawRecord], max_bytes: int) -> tuple[list[Delivery], list[DeadLetter]]:
    """Validated deliveries and dead letters: :func:`~ingest.fastpath.fast_parse` first, pydantic for the rest."""
    deliveries: list[Delivery] = []
    letters: list[DeadLetter] = []
    parse = schemas.parse_event
    fast = fast_parse
    for topic, partition, offset, key, value in records:
        value = value if value is not None else b""
        event: schemas.Event | FastEvent | None = fast(value) if len(value) <= max_bytes else None
        if event is not None:
            deliveries.append(Delivery(event, topic, partition, offset))
            continue
        try:  # pydantic decides what the fast path refused, and names the reason
            event = parse(value, max_bytes)
        except schemas.InvalidEvent as exc:
            letters.append(DeadLetter(topic, partition, offset, key, value, exc.reason, exc.detail))
            continue
        deliveries.append(Delivery(event, topic, partition, offset))
    return deliveries, letters


def prepare_batch(codec: Codec, ctx: BatchContext, records: list[RawRecord]) -> tuple[PreparedEvents, list[DeadLetter]]:
    """Validate a batch and build its rows (no database needed)."""
    deliveries, letters = parse_records(records, ctx.max_message_bytes)
    return prepare_events(codec, deliveries), letters


def commit_batch(
    engine: Engine,
    ctx: BatchContext,
    prepared: PreparedEvents,
    letters: list[DeadLetter],
    offsets: dict[tuple[str, int], int],
    cluster: str | None,
    stop: Any,
    on_retry: OnRetry,
) -> BatchDone | None:
    """Write a prepared batch in one transaction; transient errors are retried with backoff.

    ``stop`` is an event (``wait(timeout) -> bool``): set while the database is away, the batch
    gives up uncommitted and ``None`` is returned.
    """
    delay = ctx.retry_initial_s
    while True:
        try:
            with transaction(engine) as session:
                result = write_prepared(session, prepared)
                write_dead_letters(session, letters)
                store_offsets(session, ctx.group_id, offsets, cluster)
            return BatchDone(result, letters, time.time(), time.monotonic())
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            on_retry(str(exc.orig)[:200], delay)
            if stop.wait(delay):
                return None
            delay = min(delay * 2, ctx.retry_max_s)


def write_batch(
    engine: Engine,
    ctx: BatchContext,
    records: list[RawRecord],
    offsets: dict[tuple[str, int], int],
    cluster: str | None,
    stop: Any,
    on_retry: OnRetry,
) -> BatchDone | None:
    """:func:`prepare_batch` then :func:`commit_batch`."""
    prepared, letters = prepare_batch(codec_for(engine.dialect.name), ctx, records)
    return commit_batch(engine, ctx, prepared, letters, offsets, cluster, stop, on_retry)


class ThreadWriter:
    """Batches written by one thread of the consumer's process."""

    depth = 1
    """Batches in flight at most."""

    def __init__(self, engine: Engine, ctx: BatchContext, stop: threading.Event, on_retry: OnRetry) -> None:
        self._args = (engine, ctx)
        self._stop = stop
        self._on_retry = on_retry
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="undertow-ingest-writer")

    def submit(self, records: list[RawRecord], offsets: dict[tuple[str, int], int], cluster: str | None) -> Pending:
        """Start writing a batch."""
        return self._pool.submit(write_batch, *self._args, records, offsets, cluster, self._stop, self._on_retry)

    def close(self) -> None:
        """Wait for the batch in flight (its rows and offsets commit together), then end the thread."""
        self._pool.shutdown(wait=True)


class _ChildPending:
    """The answer to the ``seq``-th batch sent to the writer process."""

    def __init__(self, owner: ProcessWriter, seq: int) -> None:
        self._owner = owner
        self._seq = seq

    def done(self) -> bool:
        self._owner._pump(block=False)
        return self._seq in self._owner._answers

    def result(self) -> BatchDone | None:
        while self._seq not in self._owner._answers:
            self._owner._pump(block=True)
        kind, value = self._owner._answers.pop(self._seq)
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]


class ProcessWriter:
    """Batches written by a forked process (see the module docstring)."""

    depth = 2
    """Batches in flight at most: one committing, the next one being prepared."""

    def __init__(self, engine: Engine, ctx: BatchContext, stop: threading.Event, on_retry: OnRetry) -> None:
        fork = multiprocessing.get_context("fork")
        self._stop = stop
        self._on_retry = on_retry
        self._sent = 0
        self._received = 0
        self._answers: dict[int, tuple[str, Any]] = {}
        self._child_stop = fork.Event()
        self._conn, child_conn = fork.Pipe()
        self._process = fork.Process(
            target=_child_main,
            args=(child_conn, engine, ctx, self._child_stop, os.getpid()),
            name="undertow-ingest-writer",
            daemon=True,
        )
        self._process.start()
        child_conn.close()

    def submit(self, records: list[RawRecord], offsets: dict[tuple[str, int], int], cluster: str | None) -> Pending:
        """Send a batch to the writer process."""
        self._conn.send((records, offsets, cluster))
        self._sent += 1
        return _ChildPending(self, self._sent - 1)

    def _pump(self, block: bool) -> None:
        """Read the answers that arrived (batches answer in order); retries are logged on the way."""
        while True:
            if not self._conn.poll(0.1 if block else 0):
                if self._stop.is_set():
                    self._child_stop.set()  # a batch retrying against an absent database gives up
                if not self._process.is_alive() and not self._conn.poll(0):
                    raise RuntimeError(
                        f"The ingest writer process exited (code {self._process.exitcode}); the database "
                        "holds every batch it committed. Restart the consumer to resume from there."
                    )
                if not block:
                    return
                continue
            kind, value = self._conn.recv()
            if kind == "retry":
                self._on_retry(*value)
                continue
            self._answers[self._received] = (kind, value)
            self._received += 1
            return

    def close(self) -> None:
        """Let the writer process finish and exit (it holds no batch once the consumer drained)."""
        if self._stop.is_set():
            self._child_stop.set()  # a batch retrying against an absent database gives up
        with contextlib.suppress(OSError):  # a writer that is gone has nothing to finish
            self._conn.send(None)
        deadline = time.monotonic() + 30
        while self._process.is_alive() and time.monotonic() < deadline:  # answers left unread: a batch
            with contextlib.suppress(EOFError, OSError):  # after an error the consumer gave up on
                if self._conn.poll(0.1):
                    self._conn.recv()
        self._process.join(timeout=1)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


def make_writer(engine: Engine, cfg: IngestConfig, ctx: BatchContext, stop: threading.Event, on_retry: OnRetry) -> Any:
    """The configured writer; a thread where a forked process could not share the database."""
    url = engine.url
    in_memory = url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")
    if cfg.writer == "process" and not in_memory:
        return ProcessWriter(engine, ctx, stop, on_retry)
    return ThreadWriter(engine, ctx, stop, on_retry)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that forked it ends (Linux); exit now if it already has."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed pipe ends the process instead
        pass
    if os.getppid() != parent:
        os._exit(0)


def _child_main(conn: Any, engine: Engine, ctx: BatchContext, stop: Any, parent: int) -> None:
    """The writer process: prepares each batch here while the one before commits in a second thread."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the consumer decides when to stop, and tells us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine.dispose(close=False)  # the parent's connections stay the parent's
    codec = codec_for(engine.dialect.name)
    # Unbounded (the consumer sends at most ``depth`` batches ahead): this thread always reads the pipe, so
    # the consumer never blocks on a send while the committing thread sends it a large answer.
    jobs: queue.Queue[Any] = queue.Queue()
    committer = threading.Thread(target=_child_commits, args=(conn, engine, ctx, stop, jobs), name="commits")
    committer.start()
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the consumer is gone
            job = None
        if job is None:
            jobs.put(None)
            break
        records, offsets, cluster = job
        try:
            prepared, letters = prepare_batch(codec, ctx, records)
        except BaseException as exc:  # answered in order, by the committing thread
            jobs.put(exc)
            continue
        jobs.put((prepared, letters, offsets, cluster))
    committer.join()


def _child_commits(conn: Any, engine: Engine, ctx: BatchContext, stop: Any, jobs: queue.Queue[Any]) -> None:
    """Commit prepared batches in order and answer each; after one that did not commit, commit no other."""

    def on_retry(error: str, delay: float) -> None:
        conn.send(("retry", (error, delay)))

    failed = False
    while (job := jobs.get()) is not None:
        if failed:
            conn.send(("done", None))
            continue
        try:
            if isinstance(job, BaseException):
                raise job
            prepared, letters, offsets, cluster = job
            done = commit_batch(engine, ctx, prepared, letters, offsets, cluster, stop, on_retry)
            failed = done is None
            conn.send(("done", done))
        except BaseException as exc:  # the consumer raises it
            failed = True
            try:
                conn.send(("error", exc))
            except Exception:  # not picklable: its text is enough
                conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
