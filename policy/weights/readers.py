"""Readers of one stored version's artifacts: a delta's per-tensor payloads and a full snapshot's
tensors, each verified against its checksum before it is returned, and, in a store that verifies
signatures (a replica's), against the SHA-256 digest the signed manifest records (producer of the
files: :class:`policy.weights.store.WeightStore`; consumers: the serving layer's updater, the store
itself when it rebuilds a version along its chain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from policy.weights.changes import Changes
from policy.weights.codec import decode_changes, decode_tensor
from policy.weights.format import DeltaArtifact, Manifest, WeightsError, checksum, digest, word_dtype
from policy.weights.tensors import read_header

if TYPE_CHECKING:
    from policy.weights.store import WeightStore

_READ_BLOCK = 8 << 20
"""Bytes per request when a snapshot is read from a remote store."""


class DeltaReader:
    """One version's delta: its manifest and checksum-verified per-tensor payloads (range reads)."""

    def __init__(self, store: WeightStore, manifest: Manifest):
        if manifest.delta is None:
            raise WeightsError(f"version {manifest.version} has no delta; fetch its full snapshot or another path")
        self.store = store
        self.manifest = manifest
        self.delta: DeltaArtifact = manifest.delta
        self.path = store.path(manifest.version, self.delta.file)
        try:
            size = store.fs.size(self.path)
        except FileNotFoundError as err:
            raise WeightsError(f"delta file of version {manifest.version} is missing; use another path") from err
        if size != self.delta.bytes:
            raise WeightsError(f"delta of version {manifest.version} is truncated or overwritten: size differs")
        self._handle: Any = None
        self._whole: memoryview | None = None

    def load(self) -> DeltaReader:
        """Read the whole delta file in one request (deltas are small); payloads then slice it."""
        if self._whole is None:
            whole = self.store.fs.cat_file(self.path)
            if len(whole) != self.delta.bytes:
                raise WeightsError(f"delta of version {self.manifest.version} changed while it was read; refetch")
            self._whole = memoryview(whole)
        return self

    def payload(self, name: str) -> bytes | memoryview:
        """The encoded payload of ``name``, verified against its checksum (one open file for all tensors)."""
        entry = self.delta.tensors[name]
        if self._whole is not None:
            data: bytes | memoryview = self._whole[entry.offset : entry.offset + entry.length]
        else:
            if self._handle is None:
                self._handle = self.store.fs.open(self.path, "rb")
            self._handle.seek(entry.offset)
            data = self._handle.read(entry.length)
        if len(data) != entry.length:
            raise WeightsError(
                f"delta of {self.manifest.version} is truncated at tensor {name}; refetch or use a snapshot"
            )
        if checksum(data) != entry.payload_checksum or (
            self.store.keyring is not None and digest(data) != entry.sha256
        ):
            raise WeightsError(
                f"delta of {self.manifest.version} is corrupt at tensor {name}; refetch or use a snapshot"
            )
        return data

    def decode(self, name: str, base: np.ndarray | None) -> np.ndarray:
        """Target words of ``name`` from the base's words (verified against the target checksum)."""
        meta = self.manifest.tensors[name]
        return decode_tensor(self.payload(name), base, word_dtype(meta.dtype), meta.numel(), meta.checksum)

    def changes(self, name: str, base: np.ndarray | None) -> Changes:
        """The changes of ``name`` against the base's words (payload verified; the target checksum is the caller's)."""
        meta = self.manifest.tensors[name]
        return decode_changes(self.payload(name), base, word_dtype(meta.dtype), meta.numel())

    def close(self) -> None:
        """Close the delta file (a later read reopens it)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._whole = None

    def __enter__(self) -> DeltaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FullReader:
    """One version's full snapshot, tensor by tensor, each verified against the manifest."""

    def __init__(self, store: WeightStore, manifest: Manifest):
        if manifest.full is None:
            raise WeightsError(f"version {manifest.version} has no full snapshot")
        self.store = store
        self.manifest = manifest
        self.full = manifest.full
        self.path = store.path(manifest.version, manifest.full.file)
        self.index = read_header(store.fs, self.path)
        self._handle: Any = None

    def words(self, name: str) -> np.ndarray:
        """The verified words of ``name`` (read straight into a fresh array; one open file for all tensors)."""
        meta = self.manifest.tensors[name]
        if name not in self.index:
            raise WeightsError(f"snapshot of {self.manifest.version} lacks tensor {name}; the store is corrupt")
        dtype, shape, start, end = self.index[name]
        if dtype != meta.dtype or shape != meta.shape:
            raise WeightsError(f"snapshot of {self.manifest.version} disagrees with its manifest on tensor {name}")
        if self._handle is None:
            # Tensors are read in file order: a remote store (HTTP, object storage) streams the file in
            # large sequential requests instead of one request per read (fsspec's default cache for HTTP).
            self._handle = self.store.fs.open(self.path, "rb", cache_type="readahead", block_size=_READ_BLOCK)
        self._handle.seek(start)
        words = np.empty(meta.numel(), dtype=word_dtype(dtype))
        got = self._handle.readinto(words.view(np.uint8).data) if words.nbytes else 0
        if (
            got != end - start
            or checksum(words) != meta.checksum
            or (self.store.keyring is not None and digest(words) != self.full.sha256.get(name))
        ):
            raise WeightsError(
                f"snapshot of {self.manifest.version} is corrupt at tensor {name}; restore or refetch it"
            )
        return words

    def close(self) -> None:
        """Close the snapshot file (a later read reopens it)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> FullReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
