"""The gateway's on-disk telemetry spool: events Kafka has not acknowledged yet, and how much of
them the disk may hold.

Layout: one directory of JSON-lines segments, ``{time_ns:020d}-{seq:06d}.jsonl``, oldest first by
name (any other ``*.jsonl`` there, such as an older gateway's, is drained the same way). One
process owns a directory.

- :meth:`Spool.append` writes a batch of lines to the open segment with one ``write`` and one
  ``fsync`` (a group commit); a new segment's directory entry is synced too. A write that fails
  (disk full) is cut back, so no torn line is left behind, and raises.
- A segment is sealed at :data:`SEGMENT_BYTES`, or when the sender asks for the oldest segment and
  the open one is all there is (:meth:`Spool.oldest`): later appends go to a new one.
- :meth:`Spool.settle` is called once Kafka has answered for a sealed segment's events: all of
  them acknowledged, the file is deleted; some, it is replaced atomically (temporary file, fsync,
  rename, directory fsync) by the ones still owed; none, it stays. A crash at any point leaves
  either the old file or the new one: events are re-sent, never lost (ingest removes duplicates
  by ``event_id``).
- :meth:`Spool.read` skips a torn last line: a crash during a write, before its fsync, when the
  event was not yet durable (and its emitter not yet told so).

:class:`SpoolBudget` sizes the cap in hours of traffic: ``hours`` x the event rate (configured,
else measured: the busiest minute of the last hour) x the mean event size (measured), never more
than ``max_bytes`` nor more than the disk can give while keeping ``min_free_bytes`` free.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.private import FILE_MODE, private_dir

SEGMENT_BYTES = 1 << 20
"""A segment is sealed once it holds this much; the sender sends a segment in one go."""
MIN_CAP_BYTES = 8 << 20
"""The cap computed from hours is never below this (a quiet hour would otherwise leave no room)."""
MEASURE_AFTER_S = 10.0
"""The event rate is measured once the gateway has run this long; before, ``max_bytes`` applies."""


class Spool:
    """Fsync'd JSON-lines segments, oldest first; thread-safe."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = private_dir(Path(directory))  # 0700, its segments 0600: they hold users' prompts and code
        for stale in self.dir.glob("*.jsonl.tmp"):
            stale.unlink()  # a rewrite cut by a crash: its segment is still there, whole
        self._lock = threading.Lock()
        self._segments: deque[Path] = deque(sorted(self.dir.glob("*.jsonl")))
        self._open: Path | None = None
        self._fd: int | None = None
        self._open_size = 0
        self._seq = 0
        self.bytes = 0
        """Bytes on disk (a plain int: read without the lock, as the gateway's admission does)."""
        self.events = 0
        """Complete lines on disk: events not yet acknowledged by Kafka."""
        for path in self._segments:
            data = path.read_bytes()
            self.bytes += len(data)
            self.events += data.count(b"\n")
        self.torn = 0
        """Torn last lines skipped by :meth:`read` (writes cut by a crash before their fsync)."""

    def has_segments(self) -> bool:
        return bool(self._segments)

    def segments(self) -> int:
        return len(self._segments)

    def append(self, lines: list[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) to the open segment and fsync them."""
        if not lines:
            return
        data = b"".join(lines)
        with self._lock:
            if self._fd is None or self._open_size >= SEGMENT_BYTES:
                self._roll()
            assert self._fd is not None
            start = self._open_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
                os.fsync(self._fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                raise
            self._open_size += len(data)
            self.bytes += len(data)
            self.events += len(lines)

    def oldest(self) -> Path | None:
        """The oldest segment, sealed (the open one is sealed when it is the only one), or None."""
        with self._lock:
            if not self._segments:
                return None
            first = self._segments[0]
            if first == self._open:
                self._seal()
            return first

    def read(self, path: Path) -> list[bytes]:
        """The complete lines of a sealed segment (a torn last line is skipped and counted; a segment someone
        deleted reads as empty, and :meth:`settle` forgets it)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        if lines[-1]:
            self.torn += 1
        return [line for line in lines[:-1] if line]

    def settle(self, path: Path, done: int, owed: list[bytes]) -> None:
        """``done`` lines of the sealed segment ``path`` are finished with (acknowledged by Kafka, or never
        sendable); ``owed`` (complete lines, without newlines) are still to be sent: delete the segment, or
        replace it by what is owed."""
        with self._lock:
            before = path.stat().st_size if path.exists() else 0
            if not owed:
                path.unlink(missing_ok=True)
                if path in self._segments:
                    self._segments.remove(path)
                after = 0
            else:
                data = b"".join(line + b"\n" for line in owed)
                tmp = path.with_name(path.name + ".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
                self._sync_dir()
                after = len(data)
            self.bytes -= before - after
            self.events -= done

    def close(self) -> None:
        with self._lock:
            self._seal()

    def _roll(self) -> None:
        self._seal()
        self._seq += 1
        path = self.dir / f"{time.time_ns():020d}-{self._seq:06d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
        self._sync_dir()
        self._open, self._open_size = path, 0
        self._segments.append(path)

    def _seal(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._open, self._open_size = None, None, 0

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass
class SpoolBudget:
    """How many bytes the spool may hold (see the module docstring)."""

    max_bytes: int
    """Ceiling whatever the hours say."""
    hours: float | None = None
    """Hours of traffic to hold; None: ``max_bytes``."""
    events_per_s: float | None = None
    """The event rate to size for; None: measured."""
    min_free_bytes: int = 0
    """Disk space the spool leaves to others."""
    started: float = field(default_factory=time.monotonic)
    _minutes: dict[int, int] = field(default_factory=dict)
    _mean_bytes: float | None = None

    def observe(self, events: int, sizes: list[int], now: float | None = None) -> None:
        """Count ``events`` handed over now; ``sizes``: the encoded size of some of them."""
        now = time.monotonic() if now is None else now
        minute = int((now - self.started) // 60)
        self._minutes[minute] = self._minutes.get(minute, 0) + events
        for old in [m for m in self._minutes if m < minute - 60]:
            del self._minutes[old]
        for size in sizes:
            self._mean_bytes = size if self._mean_bytes is None else 0.98 * self._mean_bytes + 0.02 * size

    def rate(self, now: float | None = None) -> float | None:
        """Events per second to size for: the configured rate, else the busiest minute of the last hour."""
        if self.events_per_s is not None:
            return self.events_per_s
        now = time.monotonic() if now is None else now
        elapsed = now - self.started
        if elapsed < MEASURE_AFTER_S or not self._minutes:
            return None
        current = int(elapsed // 60)
        best = 0.0
        for minute, count in list(self._minutes.items()):  # the router thread adds minutes meanwhile
            span = 60.0 if minute < current else max(elapsed - 60 * current, MEASURE_AFTER_S)
            best = max(best, count / span)
        return best

    def target(self, now: float | None = None) -> int:
        """The cap the hours ask for (``max_bytes`` until the volume is known)."""
        rate = self.rate(now)
        if self.hours is None or rate is None or self._mean_bytes is None:
            return self.max_bytes
        wanted = int(self.hours * 3600 * rate * self._mean_bytes)
        return min(self.max_bytes, max(MIN_CAP_BYTES, wanted))

    def cap(self, spool_bytes: int, free_bytes: int, now: float | None = None) -> int:
        """The cap now: the target, within what the disk can give beyond ``min_free_bytes``."""
        room = spool_bytes + max(0, free_bytes - self.min_free_bytes)
        return max(0, min(self.target(now), room))

    def describe(self, cap: int) -> dict[str, Any]:
        """What the cap rests on, for the gateway's metrics."""
        rate = self.rate()
        per_hour = rate * 3600 * self._mean_bytes if rate and self._mean_bytes else None
        return {
            "spool_cap_bytes": cap,
            "spool_hours_configured": self.hours,
            "spool_hours_held": round(cap / per_hour, 3) if per_hour else None,
            "events_per_s_sized": round(rate, 3) if rate is not None else None,
            "event_bytes_mean": round(self._mean_bytes) if self._mean_bytes is not None else None,
        }
