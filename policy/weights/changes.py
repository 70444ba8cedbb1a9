"""A tensor's update as the positions that change and their new bits, and its checksum without
building the tensor.

A delta from the exact base is sparse: a training step moves a few percent of the elements. The
receiver keeps what it decodes in that form (:class:`Changes`, produced by
:func:`policy.weights.codec.decode_changes`), verifies the target checksum chunk by chunk through
one cache-sized buffer (:func:`checksum_changed`) and writes only those positions, instead of
building, hashing and copying a whole new tensor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import xxhash

_local = threading.local()


def _scratch(size: int, dtype: np.dtype) -> np.ndarray:
    """A ``size``-element buffer of ``dtype``, reused by later calls on this thread (not one per tensor)."""
    nbytes = size * np.dtype(dtype).itemsize
    raw: np.ndarray | None = getattr(_local, "buffer", None)
    if raw is None or raw.nbytes < nbytes:
        raw = _local.buffer = np.empty(nbytes, dtype=np.uint8)
    return raw[:nbytes].view(dtype)


@dataclass(frozen=True)
class Changes:
    """One tensor's decoded update against its base, without materializing what it need not.

    ``positions`` (sorted flat indices, int64) and ``words`` (the new words there) for a sparse
    update, an empty ``positions`` when the tensor is unchanged, or ``positions`` None and
    ``words`` the whole new tensor (dense encodings). Not verified: :func:`materialize` builds
    the target words, whose checksum the caller checks.
    """

    encoding: str
    positions: np.ndarray | None
    words: np.ndarray
    old: np.ndarray | None = None
    """The base's words at ``positions`` (sparse: read anyway to decode the XOR; the undo needs them)."""

    @property
    def dense(self) -> bool:
        return self.positions is None


def materialize(base: np.ndarray | None, changes: Changes) -> np.ndarray:
    """The target words: ``changes.words`` when dense, else a copy of ``base`` with the changes written."""
    if changes.positions is None:
        return changes.words
    assert base is not None
    out = base.copy()
    if changes.positions.size:
        out[changes.positions] = changes.words
    return out


def checksum_changed(base: np.ndarray, positions: np.ndarray, words: np.ndarray, chunk: int = 1 << 18) -> str:
    """The checksum of ``base`` with ``words`` written at the sorted ``positions``, without building
    that tensor: chunk by chunk, through one cache-sized buffer (equal to :func:`checksum` of it)."""
    if base.size <= chunk:  # small tensor: one copy, fewer calls
        out = base.copy()
        out[positions] = words
        return str(xxhash.xxh3_128_hexdigest(out.view(np.uint8).data))
    hasher = xxhash.xxh3_128()
    if not positions.size:
        hasher.update(np.ascontiguousarray(base).view(np.uint8).data)
        return hasher.hexdigest()
    buf = _scratch(min(chunk, base.size), base.dtype)
    cuts = np.searchsorted(positions, np.arange(chunk, base.size, chunk)).tolist()
    cuts.append(positions.size)
    lo = 0
    for i, start in enumerate(range(0, base.size, chunk)):
        view = buf[: min(chunk, base.size - start)]
        np.copyto(view, base[start : start + view.size])
        hi = cuts[i]
        if hi > lo:
            view[positions[lo:hi] - start] = words[lo:hi]
        hasher.update(view.view(np.uint8).data)
        lo = hi
    return hasher.hexdigest()
