"""The verified state of a replica's weights: their bits in the store's dtype, per-tensor checksums,
and the torch version counters that say whether anything wrote them since.

Established once when an engine loads a version (every tensor hashed, and the stored bits
loaded where the checkpoint differs), then carried forward by :class:`serving.weights.WeightUpdater`
with the checksums of what each update wrote (verified before writing). A delta's base
checksums are checked against this table instead of re-hashing the whole model for every
update. :meth:`VerifiedState.refresh` re-hashes a tensor whose version counter moved (an
in-place torch write by any other path), so the table never vouches for bits it has not seen.

The held bits (``held``) are the live tensors themselves when the engine serves the store's
dtype (the vLLM extension's host shadow: a view, no copy); an fp32 engine serving bf16
versions keeps its own bf16 copy, so deltas are decoded against exact stored bits without
casting the model on every update.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import structlog
import torch

from policy.weights import WeightStore
from policy.weights.format import Manifest, TensorMeta, checksum, dtype_name, to_words, version_hash
from serving.params import LiveParams

log = structlog.get_logger(__name__)

_EXACT = {
    ("bfloat16", torch.float32),
    ("bfloat16", torch.float64),
    ("float16", torch.float32),
    ("float16", torch.float64),
    ("float32", torch.float64),
}


def exact_cast(stored: str, live: torch.dtype) -> bool:
    """Whether every value of the stored dtype survives a round trip through the live dtype."""
    return stored == dtype_name(live) or (stored, live) in _EXACT


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    """The store's description of one tensor's bits (dtype, shape, XXH3-128 checksum)."""
    return TensorMeta(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), checksum=checksum(to_words(tensor)))


class Timer:
    """Seconds spent per named phase (``with timer("decode"): ...``), summed over repeats."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}
        self._phase = ""
        self._start = 0.0

    def __call__(self, phase: str) -> Timer:
        self._phase = phase
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.phases[self._phase] = self.phases.get(self._phase, 0.0) + time.perf_counter() - self._start

    def total(self) -> float:
        return time.perf_counter() - self.started


Stamp = tuple[int, int]


def _stamp(tensor: torch.Tensor) -> Stamp:
    """Where the tensor lives and its version counter (bumped by every in-place torch write)."""
    return tensor.data_ptr(), tensor._version


def _is_view(tensor: torch.Tensor, dtype: str) -> bool:
    """Whether :func:`to_words` of ``tensor`` as ``dtype`` is the tensor's own memory."""
    return dtype_name(tensor.dtype) == dtype and tensor.is_contiguous() and tensor.device.type == "cpu"


class VerifiedState:
    """Per-tensor checksums and bits of the held version, valid while the live tensors' stamps hold."""

    def __init__(self, live: LiveParams, manifest: Manifest | None, store: WeightStore | None) -> None:
        self.live = live
        self.table: dict[str, TensorMeta] = {}
        self.held: dict[str, np.ndarray] = {}
        self.stamps: dict[str, Stamp] = {}
        self.views: set[str] = set()
        """Tensors whose held bits are the live tensor itself (the engine serves the stored dtype)."""
        self.lock = threading.RLock()
        """Held by an update from its check to its commit (its own writes are not someone else's)."""
        if manifest is None:
            for name in live.names():
                self._derive(name, dtype_name(live.get(name).dtype))
        else:
            self._sync(manifest, store)
        self.hash = version_hash(self.table)

    @property
    def nbytes(self) -> int:
        """Size of the held version's raw tensors."""
        return sum(meta.nbytes() for meta in self.table.values())

    def _derive(self, name: str, dtype: str) -> None:
        """Read and hash one live tensor as ``dtype`` (a view when it already is; else a cast copy)."""
        tensor = self.live.get(name)
        words = to_words(tensor.to(getattr(torch, dtype)))
        self.held[name] = words
        if _is_view(tensor, dtype):
            self.views.add(name)
        else:
            self.views.discard(name)
        self.table[name] = TensorMeta(dtype=dtype, shape=list(tensor.shape), checksum=checksum(words))
        self.stamps[name] = _stamp(tensor)

    def _sync(self, manifest: Manifest, store: WeightStore | None) -> None:
        """Checksum the live tensors as the store types them; load the stored bits where they differ."""
        names = set(self.live.names())
        if set(manifest.tensors) != names:
            missing, extra = sorted(names - set(manifest.tensors))[:3], sorted(set(manifest.tensors) - names)[:3]
            raise ValueError(
                f"version {manifest.version} in the store names other tensors than the served model "
                f"(model only: {missing}, store only: {extra}); put checkpoints with their checkpoint names"
            )
        for name, meta in manifest.tensors.items():
            self._derive(name, meta.dtype)
        differ = [n for n, m in manifest.tensors.items() if self.table[n] != m]
        if differ:
            assert store is not None
            log.info("weights.load_stored", version=manifest.version, tensors=len(differ))
            stored = dict(store.tensors(manifest.version))
            self.live.write({n: stored[n] for n in differ})
            for name in differ:
                self._derive(name, manifest.tensors[name].dtype)
        if version_hash(self.table) != manifest.version_hash:
            raise ValueError(f"the engine cannot hold version {manifest.version} exactly (its dtype loses bits)")

    def refresh(self, *, blocking: bool = True) -> list[str]:
        """Re-hash tensors written since they were verified (by anything but the updater); returns their names.

        Not ``blocking``: while an update holds the lock, return at once (the state is the one before it).
        """
        if not self.lock.acquire(blocking=blocking):
            return []
        try:
            stale = [name for name in self.table if _stamp(self.live.get(name)) != self.stamps[name]]
            if stale:
                log.warning("weights.written_elsewhere", tensors=stale[:5], count=len(stale))
                for name in stale:
                    self._derive(name, self.table[name].dtype)
                self.hash = version_hash(self.table)
            return stale
        finally:
            self.lock.release()

    def commit(
        self, written: dict[str, tuple[TensorMeta, np.ndarray | None, np.ndarray | None, np.ndarray | None]]
    ) -> Callable[[], None]:
        """Record what an update wrote: per tensor its verified checksum, and its whole new words, or
        (sparse) the positions written and their words.

        The checksums and stamps are recorded now; the sparse words are written into the held bits
        by the returned callable (run it, under no other lock, before the held bits are next read:
        the updater does before its next call), so an engine's pause need not wait for them.
        """
        scatters = []
        for name, (meta, words, positions, values) in written.items():
            tensor = self.live.get(name)
            if _is_view(tensor, meta.dtype):
                self.held[name] = to_words(tensor)
                self.views.add(name)
            elif words is not None:
                self.held[name] = words
                self.views.discard(name)
            else:
                assert positions is not None and values is not None
                scatters.append((name, positions, values))
            self.table[name] = meta
            self.stamps[name] = _stamp(tensor)
        self.hash = version_hash(self.table)

        def settle() -> None:
            with self.lock:
                for name, positions, values in scatters:
                    self.held[name][positions] = values

        return settle

    def forget(self, names: list[str]) -> None:
        """Re-hash tensors whose write did not hold (the table then says what they really are)."""
        for name in names:
            self._derive(name, self.table[name].dtype)
        self.hash = version_hash(self.table)
