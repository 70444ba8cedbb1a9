"""Weight updates on a running engine: pull before the pause, apply tensor by tensor, verify, switch.

One :class:`WeightUpdater` serves both backends. It holds the named tensors a replica serves
(the CPU engine's live parameters, or the vLLM worker extension's host-side shadow of the Hugging
Face checkpoint) and a per-tensor digest cache, so verifying a delta costs only the tensors it
touches. An update is two steps:

1. ``prefetch``: read what moves the served version to the target (the chain of deltas when
   the store has one from the served version, else the full snapshot) while still serving.
2. ``apply`` (engine paused): decode the new values of the touched tensors into staging
   buffers, compute the version hash from the cached and fresh digests, and only when it equals
   the expected hash hand the staged tensors to ``commit`` (copy in place, or vLLM's
   ``load_weights``). A corrupt or mismatching update raises and leaves the served weights and
   version untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch

from serving import _devstore as store_impl
from serving.protocol import ApplyRequest, PrefetchRequest, WeightInfo

if TYPE_CHECKING:
    from serving.runner import ModelRunner

log = structlog.get_logger(__name__)

Tensors = dict[str, torch.Tensor]


@dataclass
class Staged:
    """An update pulled and waiting for ``apply``."""

    to_version: str
    kind: str
    deltas: list[bytes] = field(default_factory=list)
    snapshot: Tensors | None = None

    @property
    def nbytes(self) -> int:
        if self.snapshot is not None:
            return sum(t.numel() * t.element_size() for t in self.snapshot.values())
        return sum(len(d) for d in self.deltas)


class WeightUpdater:
    """Pull, verify and switch the weights of one replica (see module docstring)."""

    def __init__(
        self,
        tensors: Callable[[], Tensors],
        commit: Callable[[Tensors], None],
        *,
        version: str,
        store_url: str | None,
    ) -> None:
        self._tensors = tensors
        self._commit = commit
        self.version = version
        self.store = store_impl.DevStore(store_url) if store_url else None
        self.digests = {k: store_impl.tensor_digest(v) for k, v in tensors().items()}
        self.hash = store_impl.combine(self.digests)
        self.staged: Staged | None = None

    @classmethod
    def for_runner(cls, runner: ModelRunner, *, version: str, store_url: str | None) -> WeightUpdater:
        """An updater writing into the CPU engine's live parameters (in place, under its lock)."""

        def commit(new: Tensors) -> None:
            live = runner.state()
            with runner.lock, torch.no_grad():
                for name, value in new.items():
                    live[name].copy_(value)

        return cls(runner.state, commit, version=version, store_url=store_url)

    @staticmethod
    def methods() -> tuple[str, ...]:
        from serving.protocol import WEIGHT_RPC_METHODS

        return WEIGHT_RPC_METHODS

    def info(self) -> WeightInfo:
        """The version and hash served now, and what is staged."""
        return WeightInfo(version=self.version, hash=self.hash, staged=self.staged.to_version if self.staged else None)

    def _require_store(self) -> store_impl.DevStore:
        if self.store is None:
            raise ValueError("this replica was started without a weight store; restart it with --store URL")
        return self.store

    def prefetch(self, req: PrefetchRequest) -> dict[str, Any]:
        """Pull the update to ``req.to_version`` (no effect on serving). Returns what was pulled."""
        store = self._require_store()
        start = time.perf_counter()
        if req.to_version == self.version:
            self.staged = None
            return {"kind": "none", "bytes": 0, "seconds": 0.0}
        chain = None
        if req.kind != "snapshot" and req.from_version in (None, self.version):
            chain = store_impl.cheapest_path(store, self.version, req.to_version)
            if (
                chain
                and req.kind == "auto"
                and store_impl.path_bytes(store, chain) >= store_impl.snapshot_bytes(store, req.to_version)
            ):
                chain = None  # a long chain can cost more than the snapshot: take the cheaper path
        if chain:
            staged = Staged(req.to_version, "delta", deltas=[store.read_delta(a, b) for a, b in chain])
        elif req.kind == "delta":
            raise ValueError(
                f"no delta from {self.version!r} to {req.to_version!r} in the store; prefetch kind=snapshot"
            )
        else:
            staged = Staged(req.to_version, "snapshot", snapshot=store.read_snapshot(req.to_version))
        self.staged = staged
        return {"kind": staged.kind, "bytes": staged.nbytes, "seconds": time.perf_counter() - start}

    def discard(self) -> None:
        """Forget a staged update."""
        self.staged = None

    def apply(self, req: ApplyRequest) -> WeightInfo:
        """Apply the staged update if it yields ``req.expected_hash``; else raise and keep serving as before."""
        staged, self.staged = self.staged, None
        if staged is None or staged.to_version != req.to_version:
            raise ValueError(f"nothing staged for version {req.to_version!r}; call undertow_prefetch first")
        live = self._tensors()
        new = self._decode(staged, live)
        digests = dict(self.digests)
        digests.update({k: store_impl.tensor_digest(v) for k, v in new.items()})
        got = store_impl.combine(digests)
        if got != req.expected_hash:
            log.warning("weights.hash_mismatch", to_version=req.to_version, expected=req.expected_hash, got=got)
            raise ValueError(
                f"the update to {req.to_version!r} yields hash {got[:16]}..., expected {req.expected_hash[:16]}...; "
                f"refused, still serving {self.version!r}"
            )
        self._commit(new)
        self.digests, self.hash, self.version = digests, got, req.to_version
        log.info("weights.switched", version=self.version, kind=staged.kind, tensors=len(new))
        return self.info()

    def _decode(self, staged: Staged, live: Tensors) -> Tensors:
        if staged.snapshot is not None:
            snap = staged.snapshot
            if set(snap) != set(live):
                missing, extra = sorted(set(live) - set(snap))[:3], sorted(set(snap) - set(live))[:3]
                raise ValueError(f"snapshot tensors do not match the model (missing {missing}, unexpected {extra})")
            for name, value in snap.items():
                if value.shape != live[name].shape or value.dtype != live[name].dtype:
                    raise ValueError(
                        f"snapshot tensor {name} is {value.dtype}{tuple(value.shape)}, the model holds "
                        f"{live[name].dtype}{tuple(live[name].shape)}"
                    )
            return snap
        overlay: Tensors = {}
        for raw in staged.deltas:
            try:
                overlay.update(store_impl.decode_delta(raw, {**live, **overlay}))
            except Exception as exc:  # any decoding failure of untrusted bytes is a refused update
                raise ValueError(
                    f"the delta to {staged.to_version!r} is corrupt ({exc.__class__.__name__}: {exc})"
                ) from exc
        return overlay
