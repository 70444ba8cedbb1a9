"""Weight updates on a running engine from the project's weight store: pull before the pause,
verify, switch in place.

One :class:`WeightUpdater` serves both backends. It holds the live tensors a replica serves
(:mod:`serving.params`: the CPU engine's parameters, or the vLLM worker extension's host shadow),
named as the store names them (the checkpoint's names), and the *verified state* of those
tensors (:class:`serving.verified.VerifiedState`): their bits in the store's dtype and their
per-tensor checksums, established once when the engine loads a version (every tensor hashed)
and carried forward by every update (the checksums of what it wrote, which it verified). An
update is two calls:

1. ``prefetch`` (serving continues): check that the target version is signed by a key the replica
   trusts (its ``public_key`` file; an unsigned or foreign-signed version is refused with the reason,
   and nothing is staged), plan the cheapest path in the store from the held version
   (:func:`policy.weights.chain.plan`: a chain of deltas, or a full snapshot) and stage it.
   A delta's base checksums are checked against the verified state (no re-hashing of the held
   weights); each payload is checked against its checksum and decoded into the changed
   positions and their new bits; the target tensor (held bits with the changes written) is
   built and hashed against the target checksum. A snapshot is read tensor by tensor and each
   tensor hashed. An artifact that fails is excluded and another path is planned
   (``kind="delta"`` never falls back to a snapshot: it refuses). The replica's store checks the
   signature of every manifest it reads and the SHA-256 digest of every payload and snapshot tensor.
2. ``apply`` (engine paused): the version hash of the verified table with the staged
   checksums must equal the expected hash, and the live tensors must not have been written
   since the prefetch, else the update is refused and nothing was written; then a delta's
   changed positions only (a snapshot: every tensor) are written in place. The pause covers
   only these writes: the verified state's copy of a sparse update's bits is written after the
   apply answers (:meth:`WeightUpdater.settle`). When the engine's dtype cannot hold the stored
   dtype exactly (say fp16 serving bf16), what was written is read back and compared.

The verified state is only trusted while nothing else writes the live tensors: it records
each live tensor's torch version counter (shared by a parameter, its views and detached
aliases, bumped by every in-place torch write) and re-hashes any tensor whose counter moved
before it is used, so a foreign write shows up as a new hash (``hash_mismatch`` in the fleet)
and a delta whose base it no longer is gets refused. Writes that bypass torch's counter
(``.data``, a numpy view) are not seen; nothing in the project writes weights that way.

After an update the positions it changed and their old bits are kept as a sparse *undo*, so
the usual rollback (back to the version held before) is a local revert, verified like any
update, with no store read. A snapshot update keeps none (computing it would compare every
element): rolling it back goes through the store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from policy.weights import DeltaReader, Keyring, WeightsError, WeightStore, plan
from policy.weights.changes import checksum_changed, materialize
from policy.weights.format import Manifest, TensorMeta, checksum, from_words, to_words, version_hash
from serving.params import DictParams, LiveParams, ModelParams, Tensors, scatter_into
from serving.protocol import ApplyRequest, ApplyResult, PrefetchRequest, WeightInfo
from serving.staged import UNDO_MAX_FRACTION, Staged, Undo, Update
from serving.verified import Timer, VerifiedState, exact_cast, tensor_meta

if TYPE_CHECKING:
    from serving.runner import ModelRunner

__all__ = ["Staged", "Undo", "Update", "WeightUpdater", "tensor_meta"]

log = structlog.get_logger(__name__)


class WeightUpdater:
    """Pull, verify and switch the weights of one replica (see module docstring).

    ``public_key``: the file of public keys versions must be signed by (None: every version is refused).
    """

    def __init__(
        self, live: LiveParams, *, version: str, store_url: str | None, public_key: str | Path | None = None
    ) -> None:
        self.live = live
        self.version = version
        self.store = WeightStore(store_url, keyring=Keyring(public_key)) if store_url else None
        self.staged: Staged | None = None
        self.undo: Undo | None = None
        self._unsettled: Callable[[], None] | None = None
        """The held-bits writes of the last apply, left for after the pause (see :meth:`settle`)."""
        manifest = self._stored(version)
        self.state = VerifiedState(live, manifest, self.store)

    @property
    def table(self) -> dict[str, TensorMeta]:
        """The verified per-tensor checksums of the held version."""
        return self.state.table

    @property
    def hash(self) -> str:
        """The whole-version hash of what the engine serves (re-hashes tensors written by anything else first)."""
        self.state.refresh(blocking=False)
        return self.state.hash

    @classmethod
    def for_runner(
        cls, runner: ModelRunner, *, version: str, store_url: str | None, public_key: str | Path | None = None
    ) -> WeightUpdater:
        """An updater writing into the CPU engine's live parameters (in place, under its lock)."""
        params = ModelParams(runner.model, runner.checkpoint, runner.lock)
        return cls(params, version=version, store_url=store_url, public_key=public_key)

    @classmethod
    def for_dict(
        cls, tensors: Tensors, *, version: str, store_url: str | None, public_key: str | Path | None = None
    ) -> WeightUpdater:
        """An updater over a plain dict of tensors (tests, tools)."""
        return cls(DictParams(tensors), version=version, store_url=store_url, public_key=public_key)

    def _stored(self, version: str) -> Manifest | None:
        """The held version's verified manifest, or None (the state is then the loaded checkpoint's own)."""
        if self.store is None:
            return None
        try:
            return self.store.manifest(version)
        except WeightsError as err:
            log.warning("weights.held_version_not_verified", version=version, error=str(err))
            return None

    @staticmethod
    def methods() -> tuple[str, ...]:
        from serving.protocol import WEIGHT_RPC_METHODS

        return WEIGHT_RPC_METHODS

    def info(self) -> WeightInfo:
        """The version and hash served now, and what is staged."""
        return WeightInfo(version=self.version, hash=self.hash, staged=self.staged.to_version if self.staged else None)

    def warm_up(self) -> None:
        """Run what an update runs once, small, on the calling thread (the engine's weight thread, at
        start): the store's listing and the versions' heads, and the casts and scatters, whose first
        call on a thread costs more than the update itself."""
        if self.store is not None:
            self.store.heads()
        name = next(iter(self.live.names()), None)
        if name is not None:
            live, stored = self.live.get(name), self.state.table[name].dtype
            words = to_words(live.reshape(-1)[:64].to(getattr(torch, stored)))
            values = from_words(words, stored, [words.size]).to(live.dtype)
            scatter_into(values.clone(), torch.arange(values.numel()), values)

    def _require_store(self) -> WeightStore:
        if self.store is None:
            raise ValueError("this replica was started without a weight store; restart it with --store URL")
        return self.store

    def settle(self) -> None:
        """Write the last apply's changes into the held bits (the engine runs this right after the
        apply answers, outside the pause; every other call runs it first if it is still due)."""
        pending, self._unsettled = self._unsettled, None
        if pending is not None:
            pending()

    def prefetch(self, req: PrefetchRequest) -> dict[str, Any]:
        """Pull, decode and verify the update to ``req.to_version`` (serving continues)."""
        self.settle()
        timer = Timer()
        self.staged = None
        self.state.refresh()
        if req.to_version == self.version:
            return {"kind": "none", "bytes": 0, "seconds": 0.0, "timings": {}}
        if self.undo is not None and self.undo.version == req.to_version and req.kind != "snapshot":
            staged = self._revert(self.undo, timer)
        else:
            staged = self._pull(self._require_store(), req, timer)
        if staged.kind != "snapshot":
            with timer("undo"):
                staged.undo = self._undo_of(staged)
        with timer("prepare"):
            self._prepare(staged)
        self.staged = staged
        return {
            "kind": staged.kind,
            "bytes": staged.nbytes,
            "tensors": len(staged.updates),
            "changed": sum(
                u.meta.numel() if u.positions is None else int(u.positions.size) for u in staged.updates.values()
            ),
            "steps": staged.steps,
            "seconds": timer.total(),
            "timings": timer.phases,
        }

    def _prepare(self, staged: Staged) -> None:
        """Build the sparse writes' values in the live dtype before the pause: one cast for all tensors."""
        groups: dict[tuple[str, torch.dtype], list[Update]] = {}
        for name, update in staged.updates.items():
            if update.sparse():
                groups.setdefault((update.meta.dtype, self.live.get(name).dtype), []).append(update)
        for (stored, live_dtype), members in groups.items():
            words = np.concatenate([u.new_values() for u in members])
            values = from_words(words, stored, [words.size]).to(live_dtype)
            sizes = [int(u.positions.size) for u in members]  # type: ignore[union-attr]
            for update, part in zip(members, torch.split(values, sizes), strict=True):
                assert update.positions is not None
                update.prepared = (torch.from_numpy(update.positions.astype(np.int64, copy=False)), part)

    def _revert(self, undo: Undo, timer: Timer) -> Staged:
        """Stage the undo of the last update: the held bits with the old words written back, verified."""
        updates = {}
        for name, (positions, old) in undo.changes.items():
            with timer("verify_target"):
                if checksum_changed(self.state.held[name], positions, old) != undo.table[name].checksum:
                    raise ValueError(
                        f"the undo of tensor {name} does not restore {undo.version}; pull it from the store"
                    )
            updates[name] = Update(undo.table[name], None, positions, old)
        return Staged(undo.version, self.version, "undo", updates, 0, [f"undo:{undo.version}"])

    def _undo_of(self, staged: Staged) -> Undo | None:
        """The positions the update changes and the held bits there (None when too large to be worth keeping)."""
        changes, old_table = {}, {}
        for name, update in staged.updates.items():
            held = self.state.held[name]
            if update.positions is None:
                assert update.words is not None
                update.positions = np.flatnonzero(held != update.words)
            old = update.old if update.old is not None else held.take(update.positions)
            changes[name] = (update.positions, old)
            old_table[name] = self.state.table[name]
        undo = Undo(staged.base_version, old_table, changes)
        return undo if undo.nbytes <= UNDO_MAX_FRACTION * self.state.nbytes else None

    def _pull(self, store: WeightStore, req: PrefetchRequest, timer: Timer) -> Staged:
        with timer("plan"):
            try:
                store.manifest(req.to_version)  # its signature first: a refused version stages nothing
            except WeightsError as exc:
                raise ValueError(f"refusing version {req.to_version!r}: {exc}") from exc
            manifests = store.heads()
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
                with timer("plan"):
                    steps = plan(manifests, req.to_version, held, frozenset(exclude))
            except WeightsError as exc:
                raise ValueError(
                    f"cannot pull {req.to_version!r} (kind={req.kind}) from {self.version!r}: {exc}"
                    + (f"; refused artifacts: {failures}" if failures else "")
                ) from exc
            updates: dict[str, Update] = {}
            step_held, nbytes = held, 0
            try:
                for step in steps:
                    manifest = store.manifest(step.version)
                    if step.kind == "full":
                        self._stage_full(store, manifest, updates, timer)
                    else:
                        self._stage_delta(store, manifest, step_held, updates, timer)
                    step_held, nbytes = step.version, nbytes + step.bytes
            except (WeightsError, OSError) as exc:
                exclude.add((step.kind, step.version))
                failures.append(f"{step.kind} {step.version}: {exc}")
                log.warning("weights.artifact_refused", kind=step.kind, version=step.version, error=str(exc))
                continue
            kind = "snapshot" if any(s.kind == "full" for s in steps) else "delta"
            steps_text = [f"{s.kind}:{s.version}" for s in steps]
            return Staged(req.to_version, self.version, kind, updates, nbytes, steps_text)
        raise ValueError(f"cannot pull {req.to_version!r}: every path failed: {failures}")

    def _check_names(self, manifest: Manifest, removed: list[str] | None = None) -> None:
        extra = sorted(set(manifest.tensors) - set(self.state.table))
        if extra:
            raise WeightsError(f"the update adds tensor {extra[0]}, which the served model does not have")
        reshaped = [n for n, m in manifest.tensors.items() if m.shape != self.state.table[n].shape]
        if reshaped:
            raise WeightsError(f"the update changes the shape of tensor {reshaped[0]}; a running engine cannot")
        gone = sorted(set(removed or []) | (set(self.state.table) - set(manifest.tensors)))
        if gone:
            raise WeightsError(f"the update removes tensor {gone[0]}; a running engine cannot drop parameters")

    def _stage_full(self, store: WeightStore, manifest: Manifest, updates: dict[str, Update], timer: Timer) -> None:
        """Read and verify every tensor of a snapshot (each hashed against its manifest checksum)."""
        self._check_names(manifest)
        updates.clear()
        with store.open_full(manifest.version) as reader:
            for name, meta in manifest.tensors.items():
                with timer("read_verify"):
                    updates[name] = Update(meta, reader.words(name), None)

    def _stage_delta(
        self, store: WeightStore, manifest: Manifest, held: str | None, updates: dict[str, Update], timer: Timer
    ) -> None:
        """Decode one delta onto the held bits (or the previous step's staged ones) and verify each target."""
        artifact = manifest.delta
        if artifact is None or held != artifact.base:
            raise WeightsError(f"delta of {manifest.version} does not apply to {held}; plan another path")
        self._check_names(manifest, artifact.removed)
        reader = store.open_delta(manifest.version)
        try:
            with timer("read"):
                reader.load()
            self._decode_delta(manifest, reader, updates, timer)
        finally:
            reader.close()

    def _decode_delta(self, manifest: Manifest, reader: DeltaReader, updates: dict[str, Update], timer: Timer) -> None:
        artifact = manifest.delta
        assert artifact is not None
        for name, meta in manifest.tensors.items():
            entry = artifact.tensors.get(name)
            if entry is None:
                raise WeightsError(f"delta {manifest.version} has no entry for tensor {name}; the delta is malformed")
            prev = updates.get(name)
            base_meta = prev.meta if prev is not None else self.state.table[name]
            if (
                entry.base_checksum is None
                or entry.base_checksum != base_meta.checksum
                or base_meta.dtype != meta.dtype
            ):
                raise WeightsError(
                    f"tensor {name} does not match version {artifact.base}: the receiver holds another version; "
                    "apply a full snapshot or the right chain"
                )
            held_words = self.state.held[name]
            base = held_words if prev is None else prev.target(held_words)
            with timer("decode"):
                changes = reader.changes(name, base)
            if changes.positions is not None and not changes.positions.size:
                if meta.checksum != base_meta.checksum:
                    raise WeightsError(f"delta {manifest.version} marks tensor {name} unchanged, its checksum differs")
                continue
            if prev is None and changes.positions is not None:
                # Sparse onto the held bits: hash the target chunk by chunk, keep only the changes.
                with timer("verify_target"):
                    got = checksum_changed(base, changes.positions, changes.words)
                update = Update(meta, None, changes.positions, changes.words, changes.old)
            else:
                with timer("materialize"):
                    target = materialize(base, changes)
                with timer("verify_target"):
                    got = checksum(target)
                positions = changes.positions
                if prev is not None:
                    both = positions is not None and prev.positions is not None
                    positions = np.union1d(prev.positions, positions) if both else None  # type: ignore[arg-type]
                update = Update(meta, target, positions)
            if got != meta.checksum:
                raise WeightsError(
                    f"decoded tensor {name} does not match its checksum: the delta of {manifest.version} is corrupt"
                )
            updates[name] = update

    def discard(self) -> None:
        """Forget a staged update."""
        self.settle()
        self.staged = None

    def apply(self, req: ApplyRequest) -> ApplyResult:
        """Switch to the staged update if it yields ``req.expected_hash``; else raise and keep serving as before."""
        self.settle()
        timer = Timer()
        staged, self.staged = self.staged, None
        if staged is None or staged.to_version != req.to_version:
            raise ValueError(f"nothing staged for version {req.to_version!r}; call undertow_prefetch first")
        if staged.base_version != self.version:
            raise ValueError(
                f"the staged update was pulled against {staged.base_version!r}, the engine now holds {self.version!r}"
            )
        with self.state.lock:
            return self._switch(staged, req, timer)

    def _switch(self, staged: Staged, req: ApplyRequest, timer: Timer) -> ApplyResult:
        """Check, write and commit (the verified state's lock held: no refresh sees a half-written update)."""
        with timer("check"):
            written = self.state.refresh()
            if written:
                raise ValueError(
                    f"tensors {written[:3]} were written since the update was pulled; pull it again "
                    f"(still serving {self.version!r}, hash {self.state.hash[:16]}...)"
                )
            table = dict(self.state.table)
            table.update({name: update.meta for name, update in staged.updates.items()})
            got = version_hash(table)
        if got != req.expected_hash:
            log.warning("weights.hash_mismatch", to_version=req.to_version, expected=req.expected_hash, got=got)
            raise ValueError(
                f"the update to {req.to_version!r} yields hash {got[:16]}..., expected {req.expected_hash[:16]}...; "
                f"refused, still serving {self.version!r}"
            )
        sparse = {n: u for n, u in staged.updates.items() if u.sparse()}
        dense = {n: u for n, u in staged.updates.items() if n not in sparse}
        with timer("write"):
            self.live.scatter({n: _prepared(u) for n, u in sparse.items()})
            self.live.write(
                {n: from_words(u.target(self.state.held[n]), u.meta.dtype, u.meta.shape) for n, u in dense.items()}
            )
        with timer("readback"):
            bad = [n for n, u in staged.updates.items() if not self._holds(n, u, n in sparse)]
        with timer("commit"):
            self._unsettled = self.state.commit(
                {
                    n: (u.meta, None, u.positions, u.new_values())
                    if n in sparse
                    else (u.meta, u.target(self.state.held[n]), None, None)
                    for n, u in staged.updates.items()
                }
            )
        self.version, self.undo = req.to_version, staged.undo
        if bad:
            self.settle()
            self.state.forget(bad)
            log.error("weights.readback_mismatch", version=req.to_version, tensors=bad[:5])
            raise ValueError(
                f"tensors {bad[:3]} do not hold the bits written; this replica now reports hash {self.hash[:16]}... "
                "and leaves rotation until reconciled with a snapshot"
            )
        log.info("weights.switched", version=self.version, kind=staged.kind, tensors=len(staged.updates))
        return ApplyResult(**self.info().model_dump(), kind=staged.kind, timings=timer.phases)

    def _holds(self, name: str, update: Update, sparse: bool) -> bool:
        """Whether the live tensor holds what was written (read back only when its dtype may lose bits)."""
        live = self.live.get(name)
        if exact_cast(update.meta.dtype, live.dtype):
            return True
        stored = getattr(torch, update.meta.dtype)
        if sparse:
            assert update.positions is not None
            got = live.reshape(-1)[torch.from_numpy(update.positions)].to(stored)
            want = from_words(update.new_values(), update.meta.dtype, [-1])
            return bool(torch.equal(got, want))
        return tensor_meta(live.to(stored)).checksum == update.meta.checksum


def _prepared(update: Update) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse update's positions and live-dtype values, built by ``prefetch`` before the pause."""
    assert update.prepared is not None, "every staged sparse update is prepared by prefetch"
    return update.prepared
