"""One polled batch, one transaction: validate the records, then write rows, dead letters and offsets.

The consumer hands each batch to a writer and polls the next one meanwhile. Two writers ship:

- ``process`` (the default): two processes started when the consumer starts, before its Kafka
  clients exist. kafka-python decodes records in Python, so a writer *thread* would hold the
  interpreter lock about as long as the consumer itself (validation, row building and the
  driver's binding are Python too) and they would mostly take turns. The first process
  validates each batch and builds its rows; the second opens its own engine on the same URL and
  writes and commits; three interpreters keep both cores busy. Both come from multiprocessing's
  fork server, never from a fork of the consumer: the consumer usually runs in a thread of a
  process whose other threads use SQLite, and a child forked while one of them held SQLite's
  global mutex would block forever in its first ``connect``. Batches go consumer -> validator
  -> writer and answers writer -> consumer over pipes, in order, each as plain tuples (the
  events themselves stay in the validator: pickling them would cost more than validating).
  Every process always reads its input pipe into a queue, so none blocks on a full pipe while
  another waits on it. After a batch that did not commit, the writer commits none of those sent
  after it. Both processes die with the consumer: the fork server leaves when the consumer's
  process ends and takes them with it (``PR_SET_PDEATHSIG``), and a closed input pipe ends them
  too; after a ``kill -9`` the open transaction rolls back, exactly as in one process. The writer
  reports database retries to the consumer, which logs them.

  On PostgreSQL the writing is the server's (binary ``COPY``, :mod:`ingest.pgcopy`), so one
  process does both: its main thread validates a batch and builds its rows and ``COPY`` streams
  while two *lanes* (threads, each with its own connection) write the two batches before it.
  Waiting on the server releases the interpreter lock, so the server works on two batches, on
  both cores, while the next is built; no rows are pickled between processes. Batches still
  commit in order: a lane writes its batch's rows, leaving out the keys of the batch before it
  (:class:`~ingest.writer.InFlightKeys`: the two never wait on each other's rows), then waits for
  that batch to be answered before it stores its offsets and commits.
- ``thread``: the same work in a thread, where other processes cannot share the database
  (in-memory SQLite) or cannot be started (a daemonic process, such as a pool worker), or are
  not wanted.

Either way a non-transient database error is raised in the consumer, and a batch that did not
commit (stopped while the database was away) reports ``None``.

Signatures (:mod:`ingest.signing`): with ``ingest.signing_keys`` set, the consumer hands over each
record with its headers (:data:`SignedRecord`) and the validating side checks its signature before
validating it (:func:`verify_records`); the keys reach the writer processes in the
:class:`BatchContext`. Without keys, records go without headers and nothing is done per record.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from ingest import schemas
from ingest.config import IngestConfig
from ingest.db import make_engine, transaction
from ingest.fastpath import FastEvent, fast_parse
from ingest.redaction import RedactionSpec, redactor_for
from ingest.rows import Codec, codec_for, redacting
from ingest.signing import SigningKey, verify
from ingest.writer import (
    DeadLetter,
    Delivery,
    InFlightKeys,
    PreparedEvents,
    WriteResult,
    committed_before,
    pack_prepared,
    prepare_events,
    store_offsets,
    unpack_prepared,
    write_dead_letters,
    write_prepared,
)

RawRecord = tuple[str, int, int, bytes | None, bytes | None]
"""``(topic, partition, offset, key, value)`` of one Kafka record."""
Headers = list[tuple[str, bytes | None]]
"""A Kafka record's headers, as kafka-python returns them."""
SignedRecord = tuple[str, int, int, bytes | None, bytes | None, Headers | None]
"""A :data:`RawRecord` with its headers: what the consumer hands over when signing keys are configured."""
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
    gc_threshold: int = 0
    """Young-generation threshold of the writer processes' collector (0: Python's default); see :func:`quiet_gc`."""
    signing_keys: tuple[SigningKey, ...] = ()
    """The keys records must be signed by (``ingest.signing_keys``); empty: nothing is checked. The writer
    processes get them with the context."""
    redaction: RedactionSpec | None = None
    """Secrets redacted from free text before storage (``ingest.redaction``); None: off."""


class Pending(Protocol):
    """A batch handed to a writer."""

    def done(self) -> bool: ...

    def result(self) -> BatchDone | None: ...


def is_transient(exc: BaseException) -> bool:
    """A database error worth retrying: the connection or the server, not the statement."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def verify_records(
    records: Sequence[RawRecord | SignedRecord], keys: Mapping[str, SigningKey]
) -> tuple[list[RawRecord], list[DeadLetter]]:
    """The records signed by one of ``keys`` (headers dropped), and dead letters ``unsigned`` or ``bad_signature``
    for the others (a record without its headers is unsigned)."""
    passed: list[RawRecord] = []
    letters: list[DeadLetter] = []
    for record in records:
        topic, partition, offset, key, value = record[:5]
        failed = verify(value, record[5] if len(record) > 5 else None, keys)
        if failed is None:
            passed.append((topic, partition, offset, key, value))
        else:
            letters.append(DeadLetter(topic, partition, offset, key, value or b"", *failed))
    return passed, letters


def parse_records(
    records: Sequence[RawRecord | SignedRecord], max_bytes: int, keys: Mapping[str, SigningKey] | None = None
) -> tuple[list[Delivery], list[DeadLetter]]:
    """Validated deliveries and dead letters: :func:`~ingest.fastpath.fast_parse` first, pydantic for the rest.

    With ``keys``, each record's signature is checked first (:func:`verify_records`); without, nothing
    is done per record beyond validation.
    """
    deliveries: list[Delivery] = []
    letters: list[DeadLetter] = []
    if keys:
        plain, letters = verify_records(records, keys)
    else:
        plain = cast(list[RawRecord], records)
    parse = schemas.parse_event
    fast = fast_parse
    for topic, partition, offset, key, value in plain:
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


def prepare_batch(
    codec: Codec, ctx: BatchContext, records: Sequence[RawRecord | SignedRecord]
) -> tuple[PreparedEvents, list[DeadLetter]]:
    """Verify (with signing keys), validate a batch and build its rows (no database needed)."""
    keys = {k.key_id: k for k in ctx.signing_keys} if ctx.signing_keys else None
    deliveries, letters = parse_records(records, ctx.max_message_bytes, keys)
    if ctx.redaction is not None:
        codec = redacting(codec, redactor_for(ctx.redaction))
    return prepare_events(codec, deliveries), letters


class _Abandoned(Exception):
    """The batch before did not commit: this one rolls back."""


def commit_batch(
    engine: Engine,
    ctx: BatchContext,
    prepared: PreparedEvents,
    letters: list[DeadLetter],
    offsets: dict[tuple[str, int], int],
    cluster: str | None,
    stop: Any,
    on_retry: OnRetry,
    pending: InFlightKeys | None = None,
    before_committed: Callable[[], bool] | None = None,
) -> BatchDone | None:
    """Write a prepared batch in one transaction; transient errors are retried with backoff.

    ``stop`` is an event (``wait(timeout) -> bool``): set while the database is away, the batch
    gives up uncommitted and ``None`` is returned. With two batches in flight, ``pending`` holds
    the keys of the batch before (see :class:`~ingest.writer.InFlightKeys`) and
    ``before_committed`` waits for it once the rows are written, before the offsets: when it did
    not commit, neither does this one (``None``).

    A retry first asks whether the try before committed after all (the connection lost during ``COMMIT``:
    :func:`~ingest.writer.committed_before`); if so, that commit's result is returned and nothing is written
    again.
    """
    delay = ctx.retry_initial_s
    retrying = False
    while True:
        try:
            with transaction(engine) as session:
                earlier = committed_before(session, prepared, ctx.group_id, offsets, cluster) if retrying else None
                if earlier is not None:  # the last try committed; only its answer was lost
                    return BatchDone(earlier, letters, time.time(), time.monotonic())
                result = write_prepared(session, prepared, pending)
                write_dead_letters(session, letters)
                if before_committed is not None and not before_committed():
                    raise _Abandoned
                store_offsets(session, ctx.group_id, offsets, cluster)
            return BatchDone(result, letters, time.time(), time.monotonic())
        except _Abandoned:
            return None
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            on_retry(str(exc.orig)[:200], delay)
            retrying = True
            if stop.wait(delay):
                return None
            delay = min(delay * 2, ctx.retry_max_s)


def write_batch(
    engine: Engine,
    ctx: BatchContext,
    records: Sequence[RawRecord | SignedRecord],
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

    def submit(
        self, records: Sequence[RawRecord | SignedRecord], offsets: dict[tuple[str, int], int], cluster: str | None
    ) -> Pending:
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
    """Batches validated by one writer process and written by another; on PostgreSQL one process does both,
    writing two batches at once (see the module docstring)."""

    depth = 3
    """Batches in flight at most: one committing, one being prepared, one on its way (PostgreSQL: one
    more on its way and one per lane)."""

    def __init__(self, engine: Engine, ctx: BatchContext, stop: threading.Event, on_retry: OnRetry) -> None:
        mp = server_context()
        self._stop = stop
        self._on_retry = on_retry
        self._sent = 0
        self._received = 0
        self._answers: dict[int, tuple[str, Any]] = {}
        self._child_stop = child_stop = mp.Event()
        jobs_out, self._jobs = mp.Pipe(duplex=False)
        _widen(self._jobs)
        self._conn, answers_in = mp.Pipe(duplex=False)
        ends = [jobs_out, answers_in]
        url = engine.url.render_as_string(hide_password=False)
        if engine.dialect.name == "postgresql":  # one process: the server does the writing (see the docstring)
            self.depth = 3 + LANES  # two on their way, one being prepared, one per lane
            self._preparer = self._committer = mp.Process(
                target=_prepare_commit_main,
                args=(jobs_out, answers_in, url, engine.dialect.name, ctx, child_stop),
                name="undertow-ingest-writer",
                daemon=True,
            )
        else:
            prepared_out, prepared_in = mp.Pipe(duplex=False)
            ends += [prepared_out, prepared_in]
            self._preparer = mp.Process(
                target=_prepare_main,
                args=(jobs_out, prepared_in, engine.dialect.name, ctx),
                name="undertow-ingest-prepare",
                daemon=True,
            )
            self._committer = mp.Process(
                target=_commit_main,
                args=(prepared_out, answers_in, url, ctx, child_stop),
                name="undertow-ingest-writer",
                daemon=True,
            )
        for process in self._processes():
            process.start()
        # The children hold their own copies now; closing ours lets each reader see EOF when its writer is gone.
        for end in ends:
            end.close()

    def _processes(self) -> list[Any]:
        """The writer's processes (one on PostgreSQL), each once."""
        return list(dict.fromkeys((self._preparer, self._committer)))

    def submit(
        self, records: Sequence[RawRecord | SignedRecord], offsets: dict[tuple[str, int], int], cluster: str | None
    ) -> Pending:
        """Send a batch to the validating process."""
        try:
            self._jobs.send((records, offsets, cluster))
        except OSError as exc:  # BrokenPipeError: the validating process is gone
            raise RuntimeError(
                f"The ingest validating process exited (code {self._preparer.exitcode}); the database holds "
                "every batch that was committed. Restart the consumer to resume from there."
            ) from exc
        self._sent += 1
        return _ChildPending(self, self._sent - 1)

    def _pump(self, block: bool) -> None:
        """Read the answers that arrived (batches answer in order); retries are logged on the way."""
        while True:
            if not self._conn.poll(0.1 if block else 0):
                if self._stop.is_set():
                    self._child_stop.set()  # a batch retrying against an absent database gives up
                if not self._committer.is_alive() and not self._conn.poll(0):
                    raise RuntimeError(
                        f"The ingest writer process exited (code {self._committer.exitcode}); the database "
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
        """Let both processes finish and exit (they hold no batch once the consumer drained)."""
        if self._stop.is_set():
            self._child_stop.set()  # a batch retrying against an absent database gives up
        with contextlib.suppress(OSError):  # a preparer that is gone has nothing to finish
            self._jobs.send(None)
        deadline = time.monotonic() + 30
        while self._committer.is_alive() and time.monotonic() < deadline:  # answers left unread: a batch
            with contextlib.suppress(EOFError, OSError):  # after an error the consumer gave up on
                if self._conn.poll(0.1):
                    self._conn.recv()
        for process in self._processes():
            process.join(timeout=1)
            if process.is_alive():
                process.kill()
                process.join()
        self._jobs.close()
        self._conn.close()


_PIPE_BYTES = 1 << 20


def _widen(conn: Any) -> None:
    """Let a pipe hold a whole batch (Linux: 64 KiB by default): its sender then writes it in one or two
    calls instead of waiting on the reader's interpreter for each 64 KiB."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or above the system's limit: the default
        pass


def make_writer(engine: Engine, cfg: IngestConfig, ctx: BatchContext, stop: threading.Event, on_retry: OnRetry) -> Any:
    """The configured writer; a thread where processes cannot share the database (in-memory SQLite)
    or cannot be started (the consumer runs in a daemonic process, such as a pool worker's)."""
    url = engine.url
    in_memory = url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")
    if cfg.writer == "process" and not in_memory and not multiprocessing.current_process().daemon:
        return ProcessWriter(engine, ctx, stop, on_retry)
    return ThreadWriter(engine, ctx, stop, on_retry)


def quiet_gc(young: int) -> None:
    """Keep the cyclic garbage collector from dominating a batch.

    Every batch allocates tens of thousands of containers (token id lists, rows) that die with
    it; with Python's default threshold a young collection runs every 700 of them and each older
    one walks every live object, libraries included. Freezing what exists now (modules, clients,
    compiled validators) takes those out of every walk, and a larger young threshold makes the
    walks rarer; nothing is leaked, batch garbage is reference-counted away.
    """
    gc.collect()
    gc.freeze()
    _, mid, old = gc.get_threshold()
    gc.set_threshold(young, mid, old)


def server_context() -> Any:
    """multiprocessing's fork-server context, its server preloaded with the writer's modules.

    The server is one clean, single-threaded interpreter per consumer process, started on first
    use; each writer process is a fork of it, so none inherits a lock held by another thread of
    the consumer's process."""
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(["ingest.batches"])
    return mp


def _child_setup(ctx: BatchContext) -> None:
    """What both writer processes do first: die with the fork server (it leaves with the consumer's
    process; Linux), ignore the consumer's signals (it decides when to stop, and tells us) and
    tune the collector as the consumer does."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed input pipe ends the process instead
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ctx.gc_threshold:
        quiet_gc(ctx.gc_threshold)


def _drain_into(conn: Any, jobs: queue.Queue[Any], convert: Callable[[Any], Any]) -> threading.Thread:
    """A thread that always reads ``conn`` into the unbounded ``jobs`` queue (``None`` at the end).

    A process that always reads its input never lets its sender block on a full pipe, so no cycle
    of three processes each waiting to send can form; ``convert`` runs on each message here.
    """

    def run() -> None:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the sender is gone
                message = None
            if message is None:
                jobs.put(None)
                return
            jobs.put(convert(message))

    thread = threading.Thread(target=run, name="reader", daemon=True)
    thread.start()
    return thread


def _prepare_main(conn: Any, out: Any, dialect: str, ctx: BatchContext) -> None:
    """The validating process: checks each batch and builds its rows, then hands them to the writer process."""
    _child_setup(ctx)
    codec = codec_for(dialect)
    jobs: queue.Queue[Any] = queue.Queue()
    _drain_into(conn, jobs, lambda message: message)
    while (job := jobs.get()) is not None:
        records, offsets, cluster = job
        try:
            prepared, letters = prepare_batch(codec, ctx, records)
            message: tuple[Any, ...] = ("batch", pack_prepared(prepared), letters, offsets, cluster)
        except BaseException as exc:  # answered in order, by the writer process
            message = ("error", exc)
        try:
            out.send(message)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:  # e.g. an error that does not pickle
            out.send(("error", RuntimeError(f"the batch could not be handed to the writer process: {exc}")))
    out.send(None)


def _unpack_message(message: tuple[Any, ...]) -> Any:
    if message[0] == "error":
        return message[1]
    _, packed, letters, offsets, cluster = message
    return unpack_prepared(packed), letters, offsets, cluster


def _commit_main(conn: Any, out: Any, url: str, ctx: BatchContext, stop: Any) -> None:
    """The writer process: commits the prepared batches in order, on its own engine, and answers the consumer."""
    _child_setup(ctx)
    engine = make_engine(url)
    jobs: queue.Queue[Any] = queue.Queue()
    _drain_into(conn, jobs, _unpack_message)
    try:
        _child_commits(out, engine, ctx, stop, jobs)
    finally:
        engine.dispose()


def _prepare_commit_main(conn: Any, out: Any, url: str, dialect: str, ctx: BatchContext, stop: Any) -> None:
    """PostgreSQL's writer process: validates each batch and builds its rows in the main thread, while two
    lanes (threads, each with its connection) write the batches before it (see :func:`_lane_commits`)."""
    _child_setup(ctx)
    sys.setswitchinterval(0.0005)  # a lane gets the interpreter back soon after each reply of the server
    codec = codec_for(dialect)
    # Two batches in flight never wait on each other's rows (InFlightKeys); between processes, a lock wait
    # that outlasts this is an error, retried like the others, instead of a hang.
    engine = make_engine(url, connect_args={"options": "-c lock_timeout=60s"})
    inbox: queue.Queue[Any] = queue.Queue()
    _drain_into(conn, inbox, lambda message: message)
    prepared: queue.Queue[Any] = queue.Queue()
    committer = threading.Thread(
        target=_lane_commits, args=(out, engine, ctx, stop, prepared), name="lanes", daemon=True
    )
    committer.start()
    try:
        while (job := inbox.get()) is not None:
            records, offsets, cluster = job
            try:
                rows, letters = prepare_batch(codec, ctx, records)
                prepared.put((rows, letters, offsets, cluster))
            except BaseException as exc:  # answered in order, by the lanes
                prepared.put(exc)
        prepared.put(None)
        committer.join()
    finally:
        engine.dispose()


LANES = 2
"""Batches PostgreSQL's writer process writes at once, each in its own transaction."""


def _lane_commits(conn: Any, engine: Engine, ctx: BatchContext, stop: Any, jobs: queue.Queue[Any]) -> None:
    """Write batches on :data:`LANES` connections at once and commit them in order; answer each in order.

    Batch k goes to lane k % LANES. Its rows are written while batch k-1 may still be writing its
    own (the server works on both, on both cores); it leaves out the keys of batch k-1 (so neither
    waits on the other's rows), then waits for batch k-1 to be answered before it stores its offsets
    and commits. As with one writer: after a batch that did not commit, none commits.
    """
    send_lock = threading.Lock()
    failed = threading.Event()

    def send(message: tuple[str, Any]) -> None:
        with send_lock:
            conn.send(message)

    def on_retry(error: str, delay: float) -> None:
        send(("retry", (error, delay)))

    def lane(work: queue.Queue[Any]) -> None:
        while (job := work.get()) is not None:
            batch, pending, before, answered = job

            def before_committed(before: threading.Event = before) -> bool:
                before.wait()
                return not failed.is_set()

            try:
                if isinstance(batch, BaseException):
                    raise batch
                prepared, letters, offsets, cluster = batch
                done = None
                if not failed.is_set():
                    done = commit_batch(
                        engine, ctx, prepared, letters, offsets, cluster, stop, on_retry, pending, before_committed
                    )
                before.wait()  # answers go out in order
                if done is None:
                    failed.set()
                send(("done", done))
            except BaseException as exc:  # the consumer raises it
                before.wait()
                failed.set()
                try:
                    send(("error", exc))
                except Exception:  # not picklable: its text is enough
                    send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
            finally:
                answered.set()

    queues: list[queue.Queue[Any]] = [queue.Queue() for _ in range(LANES)]
    threads = [threading.Thread(target=lane, args=(q,), name=f"lane-{i}", daemon=True) for i, q in enumerate(queues)]
    for thread in threads:
        thread.start()
    before = threading.Event()
    before.set()
    pending: InFlightKeys | None = None
    k = 0
    while (job := jobs.get()) is not None:
        answered = threading.Event()
        queues[k % LANES].put((job, pending, before, answered))
        pending = None if isinstance(job, BaseException) else InFlightKeys.of(job[0])
        before, k = answered, k + 1
    for q in queues:
        q.put(None)
    for thread in threads:
        thread.join()


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
