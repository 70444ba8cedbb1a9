"""Weight updates on a running engine from the project's weight store: pull before the pause,
verify, switch in place.

One :class:`WeightUpdater` serves both backends. It holds the live tensors a replica serves
(:mod:`serving.params`: the CPU engine's parameters, or the vLLM worker extension's host shadow),
named as the store names them (the checkpoint's names), and a table of per-tensor checksums, so
the whole-version hash (:func:`policy.weights.format.version_hash` over that table) is recomputed
from the tensors an update touches only. An update is two calls:

1. ``prefetch`` (serving continues): plan the cheapest path in the store from the held version
   (:func:`policy.weights.chain.plan`: a chain of deltas, or a full snapshot), and apply it with
   :func:`policy.weights.apply.apply_delta_inplace` / ``apply_full_inplace`` onto a *staging*
   target that reads the live tensors and keeps every write aside. This is where all reading,
   decoding and checksum verification happens (the held bits against each delta's base
   checksums, every payload, every decoded tensor). An artifact that fails is excluded and
   another path is planned (``kind="delta"`` never falls back to a snapshot: it refuses).
2. ``apply`` (engine paused): the version hash of the held table with the staged tensors'
   checksums must equal the expected hash, else the update is refused and nothing was written;
   then the staged tensors are written in place, read back and checksummed (touched tensors
   only) as a last check. The pause covers only this copy.

After an update the elements it changed and their old values are kept as a sparse *undo*
(computed while pulling), so the usual rollback (back to the version held before) is a local
revert of the same elements, verified like any update, with no store read. Stored tensors are
in the store's dtype (bf16 by default); an fp32 engine holds those values exactly and presents
its tensors cast to the stored dtype when checksumming.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from policy.weights import WeightsError, WeightStore, apply_delta_inplace, apply_full_inplace, plan
from policy.weights.format import Manifest, TensorMeta, checksum, dtype_name, from_words, to_words, version_hash
from serving.params import DictParams, LiveParams, ModelParams, Tensors
from serving.protocol import ApplyRequest, PrefetchRequest, WeightInfo

if TYPE_CHECKING:
    from serving.runner import ModelRunner

log = structlog.get_logger(__name__)

UNDO_MAX_FRACTION = 0.5
"""Keep an update's undo (changed elements and their old values) while it is at most this share of the model."""


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    """The store's description of one tensor's bits (dtype, shape, XXH3-128 checksum)."""
    return TensorMeta(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), checksum=checksum(to_words(tensor)))


class StagingTarget:
    """A :class:`policy.weights.ParamTarget` that reads the live tensors (cast to the stored dtype)
    and keeps every write aside until :meth:`WeightUpdater.apply`."""

    def __init__(self, live: LiveParams, dtypes: dict[str, str]) -> None:
        self.live = live
        self.dtypes = dtypes
        self.staged: Tensors = {}
        self.read: Tensors = {}
        """Live tensors as read (stored dtype), kept to compute the undo without reading them again."""

    def get(self, name: str) -> torch.Tensor | None:
        if name in self.staged:
            return self.staged[name]
        if name not in self.dtypes:
            return None
        if name not in self.read:
            self.read[name] = self.live.get(name).to(_torch_dtype(self.dtypes[name]))
        return self.read[name]

    def set(self, name: str, value: torch.Tensor) -> None:
        if name not in self.dtypes:
            raise WeightsError(f"the update adds tensor {name}, which the served model does not have")
        self.staged[name] = value

    def remove(self, name: str) -> None:
        raise WeightsError(f"the update removes tensor {name}; a running engine cannot drop parameters")


@dataclass
class Staged:
    """An update pulled, decoded and verified, waiting for ``apply``."""

    to_version: str
    base_version: str
    kind: str
    """``delta`` (a chain of deltas), ``snapshot`` or ``undo`` (revert of the last update)."""
    tensors: Tensors
    nbytes: int
    steps: list[str] = field(default_factory=list)
    base: Tensors = field(default_factory=dict)
    """Live values of (some of) the touched tensors as read while pulling."""
    undo: Undo | None = None
    """How to revert this update (computed while pulling, kept after ``apply``)."""


@dataclass
class Undo:
    """The elements an update replaced, sparse: applying them returns to ``version``."""

    version: str
    changes: dict[str, tuple[np.ndarray, np.ndarray]]
    """name -> (flat indices, old words at them)."""

    @property
    def nbytes(self) -> int:
        return sum(idx.nbytes + old.nbytes for idx, old in self.changes.values())

    @classmethod
    def between(cls, version: str, old: Tensors, new: Tensors) -> Undo:
        """What turns ``new`` back into ``old`` (same names, dtypes and shapes)."""
        changes = {}
        for name, value in new.items():
            before, after = to_words(old[name]), to_words(value)
            idx = np.flatnonzero(before != after)
            idx = idx.astype(np.int32) if before.size < 2**31 else idx
            changes[name] = (idx, before[idx].copy())
        return cls(version, changes)

    def tensors(self, live: LiveParams, dtypes: dict[str, str]) -> Tensors:
        """The reverted tensors, from the live ones."""
        out = {}
        for name, (idx, old) in self.changes.items():
            words = to_words(live.get(name).to(_torch_dtype(dtypes[name]))).copy()
            words[idx] = old
            out[name] = from_words(words, dtypes[name], list(live.get(name).shape))
        return out


class WeightUpdater:
    """Pull, verify and switch the weights of one replica (see module docstring)."""

    def __init__(self, live: LiveParams, *, version: str, store_url: str | None) -> None:
        self.live = live
        self.version = version
        self.store = WeightStore(store_url) if store_url else None
        self.staged: Staged | None = None
        self.undo: Undo | None = None
        manifest = self._stored(version)
        if manifest is None:
            if self.store is not None:
                log.warning("weights.version_not_in_store", version=version)
            self.table = {name: tensor_meta(live.get(name)) for name in live.names()}
        else:
            self.table = self._sync(manifest)
        self.hash = version_hash(self.table)

    @classmethod
    def for_runner(cls, runner: ModelRunner, *, version: str, store_url: str | None) -> WeightUpdater:
        """An updater writing into the CPU engine's live parameters (in place, under its lock)."""
        return cls(ModelParams(runner.model, runner.checkpoint, runner.lock), version=version, store_url=store_url)

    @classmethod
    def for_dict(cls, tensors: Tensors, *, version: str, store_url: str | None) -> WeightUpdater:
        """An updater over a plain dict of tensors (tests, tools)."""
        return cls(DictParams(tensors), version=version, store_url=store_url)

    def _stored(self, version: str) -> Manifest | None:
        if self.store is None:
            return None
        try:
            return self.store.manifest(version)
        except WeightsError:
            return None

    def _sync(self, manifest: Manifest) -> dict[str, TensorMeta]:
        """Checksum the live tensors as the store types them; load the stored bits where they differ."""
        names = set(self.live.names())
        if set(manifest.tensors) != names:
            missing, extra = sorted(names - set(manifest.tensors))[:3], sorted(set(manifest.tensors) - names)[:3]
            raise ValueError(
                f"version {manifest.version} in the store names other tensors than the served model "
                f"(model only: {missing}, store only: {extra}); put checkpoints with their checkpoint names"
            )
        table = {n: tensor_meta(self.live.get(n).to(_torch_dtype(m.dtype))) for n, m in manifest.tensors.items()}
        differ = [n for n, m in manifest.tensors.items() if table[n] != m]
        if differ:
            assert self.store is not None
            log.info("weights.load_stored", version=manifest.version, tensors=len(differ))
            stored = dict(self.store.tensors(manifest.version))
            self.live.write({n: stored[n] for n in differ})
            table = {n: tensor_meta(self.live.get(n).to(_torch_dtype(m.dtype))) for n, m in manifest.tensors.items()}
        if version_hash(table) != manifest.version_hash:
            raise ValueError(f"the engine cannot hold version {manifest.version} exactly (its dtype loses bits)")
        return table

    @staticmethod
    def methods() -> tuple[str, ...]:
        from serving.protocol import WEIGHT_RPC_METHODS

        return WEIGHT_RPC_METHODS

    def info(self) -> WeightInfo:
        """The version and hash served now, and what is staged."""
        return WeightInfo(version=self.version, hash=self.hash, staged=self.staged.to_version if self.staged else None)

    def _require_store(self) -> WeightStore:
        if self.store is None:
            raise ValueError("this replica was started without a weight store; restart it with --store URL")
        return self.store

    def prefetch(self, req: PrefetchRequest) -> dict[str, Any]:
        """Pull, decode and verify the update to ``req.to_version`` (serving continues)."""
        start = time.perf_counter()
        self.staged = None
        if req.to_version == self.version:
            return {"kind": "none", "bytes": 0, "seconds": 0.0}
        dtypes = {n: m.dtype for n, m in self.table.items()}
        if self.undo is not None and self.undo.version == req.to_version and req.kind != "snapshot":
            staged = Staged(req.to_version, self.version, "undo", self.undo.tensors(self.live, dtypes), 0)
        else:
            staged = self._pull(self._require_store(), req)
        current = {
            n: staged.base[n] if n in staged.base else self.live.get(n).to(_torch_dtype(dtypes[n]))
            for n in staged.tensors
        }
        staged.base = {}
        undo = Undo.between(self.version, current, staged.tensors)
        total = sum(m.nbytes() for m in self.table.values())
        staged.undo = undo if undo.nbytes <= UNDO_MAX_FRACTION * total else None
        self.staged = staged
        return {
            "kind": staged.kind,
            "bytes": staged.nbytes,
            "tensors": len(staged.tensors),
            "steps": staged.steps,
            "seconds": time.perf_counter() - start,
        }

    def _pull(self, store: WeightStore, req: PrefetchRequest) -> Staged:
        manifests = store.manifests()
        known = {m.version for m in manifests}
        held = self.version if self.version in known else None
        exclude: set[tuple[str, str]] = set()
        if req.kind == "delta":
            exclude |= {("full", m.version) for m in manifests}
        if req.kind == "snapshot":
            exclude |= {("delta", m.version) for m in manifests}
            held = None
        failures: list[str] = []
        for _attempt in range(8):
            try:
                steps = plan(manifests, req.to_version, held, frozenset(exclude))
            except WeightsError as exc:
                raise ValueError(
                    f"cannot pull {req.to_version!r} (kind={req.kind}) from {self.version!r}: {exc}"
                    + (f"; refused artifacts: {failures}" if failures else "")
                ) from exc
            dtypes = {n: m.dtype for n, m in self.table.items()}
            staging = StagingTarget(self.live, dtypes)
            step_held, nbytes = held, 0
            try:
                for step in steps:
                    if step.kind == "full":
                        apply_full_inplace(staging, store.open_full(step.version), verify=False)
                    else:
                        apply_delta_inplace(
                            staging, store.open_delta(step.version), verify=False, held_version=step_held
                        )
                    step_held, nbytes = step.version, nbytes + step.bytes
                    staging.dtypes.update({n: m.dtype for n, m in store.manifest(step.version).tensors.items()})
            except (WeightsError, OSError) as exc:
                exclude.add((step.kind, step.version))
                failures.append(f"{step.kind} {step.version}: {exc}")
                log.warning("weights.artifact_refused", kind=step.kind, version=step.version, error=str(exc))
                continue
            kind = "snapshot" if any(s.kind == "full" for s in steps) else "delta"
            return Staged(
                req.to_version,
                self.version,
                kind,
                staging.staged,
                nbytes,
                [f"{s.kind}:{s.version}" for s in steps],
                staging.read,
            )
        raise ValueError(f"cannot pull {req.to_version!r}: every path failed: {failures}")

    def discard(self) -> None:
        """Forget a staged update."""
        self.staged = None

    def apply(self, req: ApplyRequest) -> WeightInfo:
        """Switch to the staged update if it yields ``req.expected_hash``; else raise and keep serving as before."""
        staged, self.staged = self.staged, None
        if staged is None or staged.to_version != req.to_version:
            raise ValueError(f"nothing staged for version {req.to_version!r}; call undertow_prefetch first")
        if staged.base_version != self.version:
            raise ValueError(
                f"the staged update was pulled against {staged.base_version!r}, the engine now holds {self.version!r}"
            )
        table = dict(self.table)
        table.update({name: tensor_meta(value) for name, value in staged.tensors.items()})
        got = version_hash(table)
        if got != req.expected_hash:
            log.warning("weights.hash_mismatch", to_version=req.to_version, expected=req.expected_hash, got=got)
            raise ValueError(
                f"the update to {req.to_version!r} yields hash {got[:16]}..., expected {req.expected_hash[:16]}...; "
                f"refused, still serving {self.version!r}"
            )
        self.live.write(staged.tensors)
        readback = {n: tensor_meta(self.live.get(n).to(_torch_dtype(table[n].dtype))) for n in staged.tensors}
        bad = [n for n, meta in readback.items() if meta != table[n]]
        self.table.update(readback)
        self.hash, self.version, self.undo = version_hash(self.table), req.to_version, staged.undo
        if bad:
            log.error("weights.readback_mismatch", version=req.to_version, tensors=bad[:5])
            raise ValueError(
                f"tensors {bad[:3]} do not hold the bits written; this replica now reports hash {self.hash[:16]}... "
                "and leaves rotation until reconciled with a snapshot"
            )
        log.info("weights.switched", version=self.version, kind=staged.kind, tensors=len(staged.tensors))
        return self.info()
