"""Apply a stored version to live weights, in place, tensor by tensor, verified before any write.

This is the API the serving layer calls (the CPU engine on its parameters, the vLLM worker
extension on its host-side copy of the checkpoint's tensors)::

    store = WeightStore(url)
    report = apply_delta_inplace(model_state, store.open_delta("v000042"), held_version="v000041")

``target`` is a ``dict[str, torch.Tensor]`` (a state dict: tensors are overwritten in place with
``copy_``, so a model's parameters change under it) or any object with ``get(name)``,
``set(name, tensor)`` and ``remove(name)`` (:class:`ParamTarget`). Tensors may live on any
device; each is copied to the host one at a time to decode.

With ``verify=True`` (the default) nothing is written until every tensor has been checked:
the receiver's current bits match the base's checksums (so a wrong base version is caught),
every payload matches its checksum, and every decoded tensor matches the target checksum and
hence the whole-version hash. Decoded tensors are kept for the write pass while they fit in
``cache_bytes``; past that they are decoded again, so memory stays bounded by the largest
tensor plus the cache.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from policy.weights.format import Manifest, WeightsError, checksum, dtype_name, from_words, to_words, version_hash
from policy.weights.store import DeltaReader, FullReader


class ParamTarget(Protocol):
    """Live tensors addressed by checkpoint name."""

    def get(self, name: str) -> torch.Tensor | None:
        """The current tensor, or None if the receiver has no such tensor."""
        ...

    def set(self, name: str, value: torch.Tensor) -> None:
        """Make ``name`` hold exactly ``value``'s bits (in place when dtype and shape allow)."""
        ...

    def remove(self, name: str) -> None:
        """Drop a tensor the new version no longer has."""
        ...


class StateDictTarget:
    """A state dict as a :class:`ParamTarget`: in-place ``copy_`` keeps model parameters bound."""

    def __init__(self, state: MutableMapping[str, torch.Tensor]):
        self.state = state

    def get(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        current = self.state.get(name)
        if current is not None and current.dtype == value.dtype and current.shape == value.shape:
            with torch.no_grad():
                current.copy_(value.to(current.device))
        else:
            self.state[name] = value

    def remove(self, name: str) -> None:
        self.state.pop(name, None)


@dataclass
class ApplyReport:
    """What an apply did."""

    version: str
    """The version the target now holds."""
    version_hash: str
    """Its whole-version hash (verified)."""
    tensors: int = 0
    """Tensors written."""
    unchanged: int = 0
    """Tensors whose bits did not change."""
    removed: list[str] = field(default_factory=list)
    """Tensors dropped."""
    bytes_read: int = 0
    """Artifact bytes read."""


def _as_target(target: ParamTarget | MutableMapping[str, torch.Tensor]) -> ParamTarget:
    return StateDictTarget(target) if isinstance(target, MutableMapping) else target


def _current_words(target: ParamTarget, name: str, dtype: str, shape: list[int]) -> np.ndarray | None:
    tensor = target.get(name)
    if tensor is None:
        return None
    if dtype_name(tensor.dtype) != dtype or list(tensor.shape) != shape:
        raise WeightsError(
            f"tensor {name} is {dtype_name(tensor.dtype)}{list(tensor.shape)} here, the base has {dtype}{shape}: "
            "the receiver does not hold the delta's base version"
        )
    return to_words(tensor)


def apply_delta_inplace(
    target: ParamTarget | MutableMapping[str, torch.Tensor],
    delta: DeltaReader,
    *,
    verify: bool = True,
    held_version: str | None = None,
    cache_bytes: int = 1 << 30,
) -> ApplyReport:
    """Move ``target`` from the delta's base version to its version, bit for bit.

    Raises :class:`WeightsError` (and writes nothing, when ``verify``) if the receiver does not
    hold the base (``held_version`` differs, or a tensor's bits do not match the base checksum),
    or any payload or decoded tensor fails its checksum. Without ``verify`` each tensor is still
    checked before it is written, but a failure can leave earlier tensors already updated.
    """
    live = _as_target(target)
    manifest, artifact = delta.manifest, delta.delta
    if held_version is not None and held_version != artifact.base:
        raise WeightsError(
            f"delta {manifest.version} applies to {artifact.base}, but the receiver holds {held_version}; "
            "plan a path with policy.weights.chain"
        )
    if version_hash(manifest.tensors) != manifest.version_hash:
        raise WeightsError(f"manifest of {manifest.version} fails its whole-version hash")
    report = ApplyReport(version=manifest.version, version_hash=manifest.version_hash, removed=list(artifact.removed))

    def decode(name: str) -> np.ndarray | None:
        meta, entry = manifest.tensors[name], artifact.tensors.get(name)
        if entry is None:
            raise WeightsError(f"delta {manifest.version} has no entry for tensor {name}; the delta is malformed")
        base = _current_words(live, name, meta.dtype, meta.shape) if entry.base_checksum is not None else None
        if entry.base_checksum is not None and (base is None or checksum(base) != entry.base_checksum):
            raise WeightsError(
                f"tensor {name} does not match version {artifact.base}: the receiver holds another version; "
                "apply a full snapshot or the right chain"
            )
        report.bytes_read += entry.length
        if entry.encoding == "same" and base is not None:
            delta.payload(name)  # still verified: a truncated or tampered file must not pass
            return None
        return delta.decode(name, base)

    try:
        _apply(live, delta, manifest, decode, verify, cache_bytes, report)
    finally:
        delta.close()
    return report


def _apply(
    live: ParamTarget,
    delta: DeltaReader,
    manifest: Manifest,
    decode: Callable[[str], np.ndarray | None],
    verify: bool,
    cache_bytes: int,
    report: ApplyReport,
) -> None:
    """Decode (and verify) every tensor, then write; decoded tensors are cached for the write pass."""
    cache: dict[str, np.ndarray | None] = {}
    if verify:
        budget = cache_bytes
        for name in manifest.tensors:
            words = decode(name)
            size = 0 if words is None else words.nbytes
            if size <= budget:
                cache[name] = words
                budget -= size
    for name, meta in manifest.tensors.items():
        words = cache.pop(name) if name in cache else decode(name)
        if words is None:
            report.unchanged += 1
            continue
        live.set(name, from_words(words, meta.dtype, meta.shape))
        report.tensors += 1
    for name in delta.delta.removed:
        live.remove(name)


def apply_full_inplace(
    target: ParamTarget | MutableMapping[str, torch.Tensor], snapshot: FullReader, *, verify: bool = True
) -> ApplyReport:
    """Make ``target`` hold a full snapshot (every tensor verified before any is written, with ``verify``).

    Verifying reads the snapshot twice; tensors the target lacks are added, tensors the
    snapshot lacks are removed.
    """
    live = _as_target(target)
    manifest = snapshot.manifest
    if version_hash(manifest.tensors) != manifest.version_hash:
        raise WeightsError(f"manifest of {manifest.version} fails its whole-version hash")
    report = ApplyReport(version=manifest.version, version_hash=manifest.version_hash)
    with snapshot:
        if verify:
            for name in manifest.tensors:
                snapshot.words(name)
        for name, meta in manifest.tensors.items():
            words = snapshot.words(name)
            report.bytes_read += words.nbytes
            live.set(name, from_words(words, meta.dtype, meta.shape))
            report.tensors += 1
    keys = list(getattr(live, "state", {}))
    for name in keys:
        if name not in manifest.tensors:
            live.remove(name)
            report.removed.append(name)
    return report
