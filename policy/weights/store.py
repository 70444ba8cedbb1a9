"""The versioned weight store: full snapshots and bit-exact deltas on any fsspec filesystem.

Layout under the store root::

    versions/<version>/full.safetensors   a full snapshot (every ``snapshot_every`` versions)
    versions/<version>/delta.bin          XOR delta from the parent (every version with a parent)
    versions/<version>/manifest.json      written last, by atomic rename: the version is complete

Every manifest is signed with the trainer's key (``signer``, :mod:`policy.weights.signing`); a store
opened with a ``keyring`` (a replica's) verifies the signature of every manifest it reads and the
SHA-256 digests of every payload and snapshot tensor, and refuses what fails.

Writing streams tensor by tensor: the parent's tensors are rebuilt one at a time from the
nearest full snapshot and the deltas after it, so memory stays bounded by the largest tensor.
Producer: the trainer (``put``); consumers: the serving layer (``open_delta``/``open_full``, in
:mod:`serving.weights`), the API, the CLI and GC.

Where the store is comes from ``PolicyConfig.weights_url``: :func:`resolve_store_url` is the one
place that turns it into a URL (a relative path lives under the Undertow home), and
:func:`open_store` opens the store a configuration points at.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import structlog
import torch

from policy.config import PolicyConfig, WeightsConfig, resolve_store_url
from policy.weights.codec import encode_tensor
from policy.weights.format import (
    DELTA_FILE,
    FULL_FILE,
    MANIFEST,
    MANIFEST_MAX_BYTES,
    DeltaArtifact,
    DeltaTensor,
    FullArtifact,
    Manifest,
    TensorMeta,
    VersionHead,
    WeightsError,
    check_version_id,
    checksum,
    digest,
    dtype_name,
    from_words,
    magnitude_mask,
    parse_head,
    parse_manifest,
    to_words,
    version_hash,
)
from policy.weights.readers import DeltaReader, FullReader
from policy.weights.signing import Keyring, SigningKey
from policy.weights.tensors import TensorSource, cast_for_serving, source_from, write_safetensors

log = structlog.get_logger(__name__)

_PARSED_MAX = 256
"""Parsed manifests a store object keeps (cleared beyond)."""


class WeightStore:
    """A store of policy versions at a local path or any fsspec URL.

    ``signer``: the key :meth:`put` signs manifests with (the trainer's; without one, ``put`` refuses).
    ``keyring``: the public keys every manifest read must be signed by (a replica's; None: not checked).
    """

    def __init__(
        self,
        url: str | Path,
        config: WeightsConfig | None = None,
        *,
        signer: SigningKey | None = None,
        keyring: Keyring | None = None,
    ):
        self.config = config or WeightsConfig()
        self.url = str(url)
        self.signer = signer
        self.keyring = keyring
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/") or root  # "http://host:port/" and "/" keep one separator
        self._parsed: dict[tuple[str, str, object], Manifest] = {}
        """Validated manifests by (version, checksum of their bytes, trusted keys): a manifest is read on every
        call, parsed (its signature and whole-version hash checked) only when its bytes or the keys are new.
        Shared: do not modify."""
        self._heads: dict[str, VersionHead] = {}
        """Planning heads by version id: a complete version never changes (its manifest is written
        last, once), so each is read once; ids gone from the listing are forgotten."""
        self.fs.makedirs(f"{self.root}/versions", exist_ok=True)

    @property
    def is_local(self) -> bool:
        """Whether the store is a directory on this machine (fsspec's local filesystem)."""
        protocol = self.fs.protocol
        return protocol in ("file", "local") or "file" in tuple(protocol)

    def path(self, version: str, file: str = "") -> str:
        """Path of a version directory or a file in it."""
        base = f"{self.root}/versions/{check_version_id(version)}"
        return f"{base}/{file}" if file else base

    # ---- reading -------------------------------------------------------------------------

    def manifest(self, version: str) -> Manifest:
        """The validated manifest of a complete version."""
        raw = self._manifest_bytes(version)
        if raw is None:
            raise WeightsError(f"version {version} is not in the store (or its write never completed)")
        return self._validated(version, raw)

    def _validated(self, version: str, raw: bytes) -> Manifest:
        """Parse and check a manifest's bytes (once per content and set of trusted keys)."""
        key = (version, checksum(raw), self.keyring.stamp if self.keyring is not None else None)
        manifest = self._parsed.get(key)
        if manifest is None:
            if len(self._parsed) >= _PARSED_MAX:
                self._parsed.clear()
            manifest = self._parsed[key] = parse_manifest(raw, version, self.keyring)
        return manifest

    def _manifest_bytes(self, version: str) -> bytes | None:
        """A version's manifest (at most one byte past the size limit, which parsing refuses), or None while
        it has none (one read: no existence check first)."""
        try:
            with self.fs.open(self.path(version, MANIFEST), "rb") as handle:
                raw: bytes = handle.read(MANIFEST_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        return raw

    def heads(self) -> list[VersionHead]:
        """What planning needs of every complete version, oldest first (cheap: a listing, and a read of
        each version not seen before; no tensor table is validated). The artifacts a plan picks are
        read through :meth:`manifest`, which validates them."""
        ids = self.version_ids()
        for gone in set(self._heads) - set(ids):
            del self._heads[gone]
        out = []
        for version in ids:
            head = self._heads.get(version)
            if head is None:
                raw = self._manifest_bytes(version)
                if raw is None:
                    continue
                try:
                    head = self._heads[version] = parse_head(raw, version)
                except WeightsError as err:
                    log.warning("weights.manifest_unreadable", version=version, error=str(err))
                    continue
            out.append(head)
        return sorted(out, key=lambda h: h.seq)

    def version_ids(self) -> list[str]:
        """Every version directory, complete or not."""
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.root}/versions", detail=False))

    def manifests(self) -> list[Manifest]:
        """Manifests of every complete version, oldest first. Corrupt manifests are skipped with a warning."""
        out = []
        for version in self.version_ids():
            raw = self._manifest_bytes(version)
            if raw is None:
                continue
            try:
                out.append(self._validated(version, raw))
            except WeightsError as err:
                log.warning("weights.manifest_unreadable", version=version, error=str(err))
        return sorted(out, key=lambda m: m.seq)

    def latest(self) -> str | None:
        """The newest complete version."""
        manifests = self.manifests()
        return manifests[-1].version if manifests else None

    def open_delta(self, version: str) -> DeltaReader:
        """The delta that turns the version's parent into it."""
        return DeltaReader(self, self.manifest(version))

    def open_full(self, version: str) -> FullReader:
        """The version's full snapshot."""
        return FullReader(self, self.manifest(version))

    def chain(self, version: str) -> list[Manifest]:
        """Manifests from the nearest full snapshot at or before ``version`` to it, oldest first."""
        out = [self.manifest(version)]
        while out[-1].full is None:
            parent = out[-1].parent
            if parent is None or out[-1].delta is None:
                raise WeightsError(
                    f"version {out[-1].version} has neither a snapshot nor a delta; the store is corrupt"
                )
            out.append(self.manifest(parent))
        return out[::-1]

    def words(self, version: str, name: str, chain: list[Manifest] | None = None) -> np.ndarray:
        """One tensor of ``version`` as verified words, rebuilt along its chain."""
        chain = chain or self.chain(version)
        start = max((i for i, m in enumerate(chain) if m.full and name in m.tensors), default=0)
        words = None
        if name in chain[start].tensors:
            with FullReader(self, chain[start]) as reader:
                words = reader.words(name)
        for previous, manifest in zip(chain[start:], chain[start + 1 :], strict=False):
            if name not in manifest.tensors:
                words = None
                continue
            with DeltaReader(self, manifest) as reader:
                words = reader.decode(name, words if name in previous.tensors else None)
        if words is None:
            raise WeightsError(f"version {version} has no tensor {name}")
        return words

    def tensors(self, version: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every tensor of ``version`` (CPU), one at a time."""
        chain = self.chain(version)
        for name, meta in chain[-1].tensors.items():
            yield name, from_words(self.words(version, name, chain), meta.dtype, meta.shape)

    def state_dict(self, version: str) -> dict[str, torch.Tensor]:
        """The whole version in memory (tests and small models)."""
        return dict(self.tensors(version))

    # ---- writing -------------------------------------------------------------------------

    def put(
        self,
        source: TensorSource | Mapping[str, torch.Tensor] | str | Path,
        *,
        version: str | None = None,
        parent: str | None = "latest",
        full: bool | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Manifest:
        """Add a version: a delta from ``parent`` (default: the latest version) and, every
        ``snapshot_every`` versions or when ``full`` is true, a full snapshot. Returns its (signed) manifest."""
        self._signer().key()  # no key, or an unreadable one, fails here: before any file is written
        src = source_from(source)
        existing = self.manifests()
        parent_id = (existing[-1].version if existing else None) if parent == "latest" else parent
        parent_manifest = self.manifest(parent_id) if parent_id else None
        seq = max((m.seq for m in existing), default=0) + 1
        version = check_version_id(version or f"v{seq:06d}")
        if self.fs.exists(self.path(version, MANIFEST)):
            raise WeightsError(f"version {version} already exists; versions are immutable, choose a new id")
        if full is None:
            full = (
                parent_manifest is None
                or self._deltas_since_snapshot(parent_manifest) + 1 >= self.config.snapshot_every
            )
        if parent_manifest is None:
            full = True
        directory = self.path(version)
        if self.fs.exists(directory):
            self.fs.rm(directory, recursive=True)
        self.fs.makedirs(directory, exist_ok=True)
        chain = self.chain(parent_manifest.version) if parent_manifest else []
        tensors: dict[str, TensorMeta] = {}
        entries: dict[str, DeltaTensor] = {}
        digests: dict[str, str] = {}
        level = self.config.zstd_level
        delta_handle = self.fs.open(self.path(version, DELTA_FILE), "wb") if parent_manifest else None
        offset = 0

        def words_of(name: str) -> np.ndarray:
            nonlocal offset
            tensor = cast_for_serving(src.get(name), self.config.serving_dtype)
            target = to_words(tensor)
            dtype = dtype_name(tensor.dtype)
            tensors[name] = TensorMeta(dtype=dtype, shape=list(tensor.shape), checksum=checksum(target))
            if full:
                digests[name] = digest(target)
            if parent_manifest is not None and delta_handle is not None:
                old = parent_manifest.tensors.get(name)
                same_layout = old is not None and old.dtype == dtype and old.shape == list(tensor.shape)
                base = self.words(parent_manifest.version, name, chain) if same_layout else None
                mask = magnitude_mask(dtype) if self.config.magnitude_classes else None
                encoded = encode_tensor(base, target, mask, level=level)
                delta_handle.write(encoded.payload)
                entries[name] = DeltaTensor(
                    encoding=encoded.encoding,
                    offset=offset,
                    length=len(encoded.payload),
                    payload_checksum=checksum(encoded.payload),
                    sha256=digest(encoded.payload),
                    base_checksum=old.checksum if same_layout and old is not None else None,
                )
                offset += len(encoded.payload)
            return target

        started = time.perf_counter()
        try:
            full_artifact = None
            if full:
                layout = {name: self._serving_layout(src, name) for name in src.names()}
                size = write_safetensors(self.fs, self.path(version, FULL_FILE), layout, words_of, {"version": version})
                full_artifact = FullArtifact(bytes=size, sha256=digests)
            else:
                for name in src.names():
                    words_of(name)
        finally:
            if delta_handle is not None:
                delta_handle.close()
        delta_artifact = None
        if parent_manifest is not None:
            delta_artifact = DeltaArtifact(
                base=parent_manifest.version,
                base_hash=parent_manifest.version_hash,
                bytes=offset,
                tensors=entries,
                removed=[n for n in parent_manifest.tensors if n not in tensors],
            )
        manifest = Manifest(
            version=version,
            seq=seq,
            parent=parent_manifest.version if parent_manifest else None,
            created_at=datetime.now(UTC).isoformat(),
            version_hash=version_hash(tensors),
            tensors=tensors,
            full=full_artifact,
            delta=delta_artifact,
            meta=meta or {},
        )
        manifest = self._write_manifest(manifest)
        log.info(
            "weights.put",
            version=version,
            parent=manifest.parent,
            full_bytes=full_artifact.bytes if full_artifact else None,
            delta_bytes=offset if delta_artifact else None,
            seconds=round(time.perf_counter() - started, 3),
        )
        return manifest

    def _serving_layout(self, src: TensorSource, name: str) -> tuple[str, list[int]]:
        meta = getattr(src, "index", None)
        if meta is not None and not self.config.serving_dtype:
            _file, dtype, shape, _s, _e = meta[name]
            return dtype, shape
        tensor = cast_for_serving(src.get(name), self.config.serving_dtype)
        return dtype_name(tensor.dtype), list(tensor.shape)

    def _deltas_since_snapshot(self, manifest: Manifest) -> int:
        return len(self.chain(manifest.version)) - 1

    def sign(self, version: str, *, trusted: Keyring | None = None) -> Manifest:
        """Sign a complete version again with this store's key: after a key rotation, or to vouch for a
        version nobody signed. Every artifact is read and checked first (a snapshot tensor by tensor, a
        delta by rebuilding each tensor along its chain) and the SHA-256 digests are taken of what was
        read; a digest the manifest already records must match. With ``trusted``, the version's current
        signature must verify against those keys, so a manifest changed since it was signed is never
        signed again; without, the caller vouches for the version."""
        signer = self._signer()
        raw = self._manifest_bytes(version)
        if raw is None:
            raise WeightsError(f"version {version} is not in the store (or its write never completed)")
        manifest = parse_manifest(raw, version, trusted)
        full, delta = manifest.full, manifest.delta
        if full is not None:
            with FullReader(self, manifest) as reader:
                sums = {name: digest(reader.words(name)) for name in manifest.tensors}
            _same_digests(version, full.sha256, sums)
            full = full.model_copy(update={"sha256": sums})
        if delta is not None:
            chain = [*self.chain(delta.base), manifest]
            for name in manifest.tensors:
                self.words(version, name, chain)
            with DeltaReader(self, manifest).load() as delta_reader:
                payloads = {name: digest(delta_reader.payload(name)) for name in delta.tensors}
            _same_digests(version, {n: e.sha256 for n, e in delta.tensors.items() if e.sha256}, payloads)
            entries = {n: e.model_copy(update={"sha256": payloads[n]}) for n, e in delta.tensors.items()}
            delta = delta.model_copy(update={"tensors": entries})
        signed = self._write_manifest(manifest.model_copy(update={"full": full, "delta": delta}))
        log.info("weights.signed", version=version, key_id=signer.key_id)
        return signed

    def _signer(self) -> SigningKey:
        if self.signer is None:
            raise WeightsError(
                "this store has no signing key and replicas refuse unsigned versions: open it with open_store "
                "(the trainer's key, policy.weights.signing_key) or pass signer=SigningKey(path)"
            )
        return self.signer

    def _write_manifest(self, manifest: Manifest) -> Manifest:
        """Sign the manifest and write it last and atomically: a temporary name, then rename (one PUT on object
        stores). Returns the signed manifest."""
        final = self.path(manifest.version, MANIFEST)
        data = manifest.model_dump(mode="json", exclude={"signature"})
        data["signature"] = self._signer().sign(data)
        signed = Manifest.model_validate(data)
        raw = json.dumps(data, indent=1).encode()
        if self.is_local:
            tmp = f"{final}.{uuid.uuid4().hex}.tmp"
            with self.fs.open(tmp, "wb") as handle:
                handle.write(raw)
            Path(tmp).replace(final)
        else:
            with self.fs.open(final, "wb") as handle:
                handle.write(raw)
        return signed

    def delete(self, version: str) -> None:
        """Remove a version: its manifest first (it stops being complete), then its files."""
        manifest_path = self.path(version, MANIFEST)
        if self.fs.exists(manifest_path):
            self.fs.rm(manifest_path)
        if self.fs.exists(self.path(version)):
            self.fs.rm(self.path(version), recursive=True)

    def modified_at(self, version: str) -> float:
        """Newest modification time (epoch s) of a version directory's files (0 when unknown)."""
        newest = 0.0
        for info in [self.fs.info(self.path(version)), *self.fs.ls(self.path(version), detail=True)]:
            stamp = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
            newest = max(newest, stamp.timestamp() if isinstance(stamp, datetime) else float(stamp))
        return newest


def _same_digests(version: str, recorded: dict[str, str], computed: dict[str, str]) -> None:
    """Refuse to sign again a version whose artifact no longer has the digest its manifest records."""
    changed = sorted(name for name, value in recorded.items() if computed.get(name) != value)
    if changed:
        raise WeightsError(
            f"version {version} changed after it was signed (the SHA-256 of {changed[0]} differs); not signing it"
        )


def open_store(config: PolicyConfig, home: Path) -> WeightStore:
    """The weight store ``config.weights_url`` points at (resolved against ``home``), with ``config.weights``,
    signing with the trainer's key (``weights.signing_key`` under ``home``, created on the first put)."""
    return WeightStore(
        resolve_store_url(config.weights_url, home),
        config.weights,
        signer=SigningKey.from_config(config.weights, home),
    )
