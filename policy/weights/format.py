"""The weight store's on-disk format: dtypes, checksums, manifests and the one error type.

Every version directory holds its artifacts (a full snapshot ``full.safetensors``, a delta
``delta.bin``, or both) and a ``manifest.json`` written last, by atomic rename, as the marker
that the version is complete (producer: :class:`policy.weights.store.WeightStore`; consumers:
the store, the CLI, the serving layer's delta deployment).

Per-tensor checksums are XXH3-128 of the tensor's raw little-endian bytes (fast enough to check
every tensor on every apply); the whole-version hash is BLAKE2b over the canonical list of
``(name, dtype, shape, checksum)``, so two versions with the same hash hold the same bits.

A manifest is signed by the trainer (:mod:`policy.weights.signing`) and carries SHA-256 digests of
what a replica reads (each delta payload, each snapshot tensor): XXH3 detects accidents, not a
forger, so the signature vouches for the bits through those digests.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from policy.weights.signing import Keyring

FORMAT = "undertow.weights/1"
MANIFEST = "manifest.json"
FULL_FILE = "full.safetensors"
DELTA_FILE = "delta.bin"
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MANIFEST_MAX_BYTES = 64 << 20
"""A manifest larger than this is refused unread (one of a 40,000-tensor model is about 30 MB)."""


class WeightsError(Exception):
    """Anything wrong with stored weights: corrupt, truncated, tampered, missing or mismatched."""


# torch dtype name -> (torch dtype, unsigned word dtype of the same width, sign-bit-free magnitude mask or None)
_DTYPES: dict[str, tuple[torch.dtype, type[np.unsignedinteger[Any]], int | None]] = {
    "bfloat16": (torch.bfloat16, np.uint16, 0x7FFF),
    "float16": (torch.float16, np.uint16, 0x7FFF),
    "float32": (torch.float32, np.uint32, 0x7FFFFFFF),
    "float64": (torch.float64, np.uint64, 0x7FFFFFFFFFFFFFFF),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.uint8, 0x7F),
    "float8_e5m2": (torch.float8_e5m2, np.uint8, 0x7F),
    "int64": (torch.int64, np.uint64, None),
    "int32": (torch.int32, np.uint32, None),
    "int16": (torch.int16, np.uint16, None),
    "int8": (torch.int8, np.uint8, None),
    "uint8": (torch.uint8, np.uint8, None),
    "bool": (torch.bool, np.uint8, None),
}
_SIGNED_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SAFETENSORS_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises for dtypes the store cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WeightsError(f"dtype {name} is not supported by the weight store; use one of {sorted(_DTYPES)}")
    return name


def word_dtype(name: str) -> np.dtype[Any]:
    """The unsigned integer dtype whose values are the bit patterns of ``name``."""
    return np.dtype(_entry(name)[1])


def magnitude_mask(name: str) -> int | None:
    """Mask that clears the sign bit of a float dtype's bit pattern (None for integer dtypes)."""
    return _entry(name)[2]


def _entry(name: str) -> tuple[torch.dtype, type[np.unsignedinteger[Any]], int | None]:
    if name not in _DTYPES:
        raise WeightsError(f"unknown dtype {name!r} in stored weights")
    return _DTYPES[name]


def to_words(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat unsigned numpy array (a CPU copy only when needed)."""
    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    signed = flat.view(_SIGNED_VIEW[flat.element_size()])
    return signed.numpy().view(word_dtype(name))


def from_words(words: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`to_words`: a CPU tensor of ``dtype`` and ``shape`` holding these bits."""
    torch_dtype = _entry(dtype)[0]
    signed = torch.from_numpy(np.ascontiguousarray(words).view(f"i{words.itemsize}" if words.itemsize > 1 else "u1"))
    return signed.view(torch_dtype).reshape(shape)


def checksum(data: bytes | memoryview | np.ndarray) -> str:
    """XXH3-128 hex digest of raw bytes (a tensor's bits or a stored payload)."""
    return xxhash.xxh3_128_hexdigest(
        np.ascontiguousarray(data).view(np.uint8).data if isinstance(data, np.ndarray) else data
    )


def digest(data: bytes | memoryview | np.ndarray) -> str:
    """SHA-256 hex digest of raw bytes: what a signed manifest vouches for a payload or a tensor with."""
    return hashlib.sha256(
        np.ascontiguousarray(data).view(np.uint8).data if isinstance(data, np.ndarray) else data
    ).hexdigest()


class TensorMeta(BaseModel):
    """One tensor of a version: what its bits are."""

    model_config = ConfigDict(extra="forbid")

    dtype: str
    """Torch dtype name, e.g. ``bfloat16``."""
    shape: list[int]
    """Tensor shape."""
    checksum: str
    """XXH3-128 of the tensor's raw little-endian bytes."""

    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def nbytes(self) -> int:
        """Size of the raw tensor in bytes."""
        return self.numel() * word_dtype(self.dtype).itemsize


class DeltaTensor(BaseModel):
    """Where one tensor's encoded delta lies in ``delta.bin`` and what it must decode to."""

    model_config = ConfigDict(extra="forbid")

    encoding: str
    """``same``, ``raw``, ``planes`` or ``sparse`` (informational; the payload header is authoritative)."""
    offset: int = Field(ge=0)
    """Byte offset of the payload in the delta file."""
    length: int = Field(ge=0)
    """Payload length in bytes."""
    payload_checksum: str
    """XXH3-128 of the payload bytes."""
    base_checksum: str | None
    """Checksum of the base tensor the XOR is taken against (None: a new tensor, coded in full)."""
    sha256: str | None = None
    """SHA-256 of the payload bytes (what the signature vouches for them with)."""


class DeltaArtifact(BaseModel):
    """A delta from the exact parent version."""

    model_config = ConfigDict(extra="forbid")

    file: str = DELTA_FILE
    """File name inside the version directory."""
    base: str
    """Version the delta applies to."""
    base_hash: str
    """Whole-version hash of the base."""
    bytes: int
    """Size of the delta file."""
    tensors: dict[str, DeltaTensor]
    """Every tensor of the target, in apply order."""
    removed: list[str] = []
    """Tensors of the base that the target no longer has."""


class FullArtifact(BaseModel):
    """A full snapshot (safetensors)."""

    model_config = ConfigDict(extra="forbid")

    file: str = FULL_FILE
    """File name inside the version directory."""
    bytes: int
    """Size of the file."""
    sha256: dict[str, str] = {}
    """SHA-256 of each tensor's raw bytes in the snapshot (what the signature vouches for them with)."""


class ManifestSignature(BaseModel):
    """The trainer's signature over the rest of the manifest (:func:`policy.weights.signing.canonical`)."""

    model_config = ConfigDict(extra="forbid")

    alg: Literal["ed25519"] = "ed25519"
    """Signature algorithm."""
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    """First 16 hex digits of the SHA-256 of the signer's raw public key."""
    value: str = Field(max_length=200)
    """Base64 of the 64-byte signature."""


class Manifest(BaseModel):
    """The completion marker and index of one version."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["undertow.weights/1"] = "undertow.weights/1"
    """Format tag; readers refuse anything else."""
    version: str
    """Version id."""
    seq: int
    """Position in the store's history (monotonic)."""
    parent: str | None
    """Version this one was trained from (the base of its delta)."""
    created_at: str
    """UTC ISO-8601 time the version was written."""
    version_hash: str
    """BLAKE2b over the tensor table: equal hashes, equal bits."""
    tensors: dict[str, TensorMeta]
    """Every tensor of the version."""
    full: FullArtifact | None = None
    """The full snapshot, when this version has one."""
    delta: DeltaArtifact | None = None
    """The delta from ``parent``, when this version has one."""
    meta: dict[str, Any] = {}
    """Free-form provenance (trainer step, source checkpoint)."""
    signature: ManifestSignature | None = None
    """The trainer's signature; replicas refuse a version without a valid one from a key they trust."""

    def total_bytes(self) -> int:
        """Size of the version's raw tensors."""
        return sum(t.nbytes() for t in self.tensors.values())


@dataclass(frozen=True)
class ArtifactHead:
    """An artifact's size (and, for a delta, its base version), as planning needs it."""

    bytes: int
    base: str = ""


@dataclass(frozen=True)
class VersionHead:
    """What :func:`policy.weights.chain.plan` needs of a version, read from its manifest without
    validating the tensor table (a planned step's full manifest is validated before it is used)."""

    version: str
    seq: int
    full: ArtifactHead | None
    delta: ArtifactHead | None


def manifest_json(raw: bytes, version: str) -> dict[str, Any]:
    """A manifest's bytes as a JSON object; raises :class:`WeightsError` for anything else (oversized,
    not JSON, nested beyond the parser)."""
    if len(raw) > MANIFEST_MAX_BYTES:
        raise WeightsError(f"manifest of version {version} is over {MANIFEST_MAX_BYTES} bytes; refusing to parse it")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise WeightsError(f"manifest of version {version} is not valid JSON: {str(err)[:200]}") from err
    if not isinstance(data, dict):
        raise WeightsError(f"manifest of version {version} is not a JSON object")
    return data


def parse_head(raw: bytes, version: str) -> VersionHead:
    """The planning fields of a manifest's JSON; raises :class:`WeightsError` when they are missing."""
    data = manifest_json(raw, version)
    try:
        full, delta = data.get("full"), data.get("delta")
        head = VersionHead(
            version=str(data["version"]),
            seq=int(data["seq"]),
            full=ArtifactHead(int(full["bytes"])) if full else None,
            delta=ArtifactHead(int(delta["bytes"]), str(delta["base"])) if delta else None,
        )
    except (ValueError, KeyError, TypeError) as err:
        raise WeightsError(f"manifest of version {version} is not valid: {err}") from err
    if head.version != version:
        raise WeightsError(f"manifest in directory {version} names version {head.version}; the store is tampered")
    return head


def version_hash(tensors: dict[str, TensorMeta]) -> str:
    """BLAKE2b-256 over the sorted ``(name, dtype, shape, checksum)`` table."""
    table = [[name, t.dtype, list(t.shape), t.checksum] for name, t in sorted(tensors.items())]
    return hashlib.blake2b(json.dumps(table, separators=(",", ":")).encode(), digest_size=32).hexdigest()


def parse_manifest(raw: bytes, version: str, keyring: Keyring | None = None) -> Manifest:
    """Validate a manifest's JSON, its version id and its whole-version hash; with ``keyring``, first its
    signature (the object validated is the one whose signature was checked), then that it carries the
    digests of everything a replica reads."""
    data = manifest_json(raw, version)
    if keyring is not None:
        keyring.verify(data, version)
    try:
        manifest = Manifest.model_validate(data)
    except (ValueError, RecursionError) as err:
        raise WeightsError(f"manifest of version {version} is not valid: {str(err)[:500]}") from err
    if manifest.version != version:
        raise WeightsError(f"manifest in directory {version} names version {manifest.version}; the store is tampered")
    if version_hash(manifest.tensors) != manifest.version_hash:
        raise WeightsError(f"manifest of version {version} fails its whole-version hash; the store is tampered")
    if keyring is not None and not has_digests(manifest):
        raise WeightsError(
            f"version {version} is signed but lacks the SHA-256 digests of its artifacts; publish it again"
        )
    return manifest


def has_digests(manifest: Manifest) -> bool:
    """Whether every payload and snapshot tensor a replica may read has its SHA-256 in the manifest."""
    full_ok = manifest.full is None or set(manifest.full.sha256) >= set(manifest.tensors)
    delta_ok = manifest.delta is None or all(entry.sha256 for entry in manifest.delta.tensors.values())
    return full_ok and delta_ok


def check_version_id(version: str) -> str:
    """Reject ids that are not safe as a single path component."""
    if not VERSION_RE.match(version):
        raise WeightsError(f"version id {version!r} is invalid: use 1-128 of [A-Za-z0-9._-], not starting with . - _")
    return version
