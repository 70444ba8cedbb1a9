"""Staging memory for weight updates, reserved when an engine starts.

An update stages what it pulls (a delta's changed positions and words, or a whole snapshot)
in fresh memory before the pause. By default glibc's allocator returns large freed blocks to
the kernel (``mmap`` for blocks over its threshold, trimming the top of a heap), so every
update, and above all the first one after a start, faults those pages in again: a few tens of
thousands of page faults per update of a 100M-parameter model, which cost more than the
decode itself where page faults are slow (virtual machines). The engine therefore:

1. tells the allocator to keep freed memory for reuse (:func:`retain_freed_memory`: blocks up
   to 32 MB come from the heap, and free heap memory is not trimmed), and
2. touches, then frees, as much memory as a snapshot of the served version on the thread that
   runs weight updates (:func:`reserve`), so that thread's heap already holds the pages its
   updates will use.

The cost is that resident memory stays at its peak (about one snapshot of the served version
in the stored dtype above the model), which a snapshot update reaches anyway. Outside glibc
(another libc, another OS) both steps are skipped and updates fault pages in as they go.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import numpy as np
import structlog

log = structlog.get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest allowed ``M_MMAP_THRESHOLD`` on 64-bit systems."""
_TRIM_THRESHOLD = 2**31 - 1
"""The largest ``M_TRIM_THRESHOLD`` (a C int): free heap memory under 2 GB is kept."""
_CHUNK = 4 << 20


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it; musl's mallopt ignores these options)
    except (OSError, AttributeError):
        return None
    return libc


def retain_freed_memory() -> bool:
    """Keep freed memory in this process's heaps for reuse (glibc); returns whether it applied."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    if not ok:
        log.warning("memory.mallopt_refused")
    return ok


def reserve(nbytes: int) -> int:
    """Touch and free ``nbytes`` in heap-sized blocks on the calling thread; returns the bytes touched."""
    count = -(-max(0, nbytes) // _CHUNK)  # whole blocks, rounded up
    blocks = [np.empty(_CHUNK, dtype=np.uint8) for _ in range(count)]
    for block in blocks:
        block.fill(0)  # write every page
    del blocks
    return count * _CHUNK
