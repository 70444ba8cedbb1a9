"""Compact array encodings for the database: int32 token ids, float64 logprobs, ``.npy`` bytes."""

from __future__ import annotations

import array
import base64
import io
import sys

import numpy as np

_LITTLE = sys.byteorder == "little" and array.array("i").itemsize == 4


def pack_ids(ids: list[int] | np.ndarray | None) -> bytes | None:
    """Token ids as little-endian int32 bytes (None stays None)."""
    if ids is None:
        return None
    if isinstance(ids, list) and _LITTLE:  # the common case, without NumPy's per-call overhead
        return array.array("i", ids).tobytes()
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(raw: bytes | None) -> np.ndarray:
    """Inverse of :func:`pack_ids`; an empty array for None."""
    if not raw:
        return np.zeros(0, dtype=np.int32)
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def pack_floats(values: list[float] | np.ndarray | None) -> bytes | None:
    """Floats as little-endian float64 bytes, bit-exact for what JSON carried."""
    if values is None:
        return None
    if isinstance(values, list) and _LITTLE:
        return array.array("d", values).tobytes()
    return np.asarray(values, dtype="<f8").tobytes()


def unpack_floats(raw: bytes | None) -> np.ndarray:
    """Inverse of :func:`pack_floats`; an empty array for None."""
    if not raw:
        return np.zeros(0, dtype=np.float64)
    return np.frombuffer(raw, dtype="<f8").copy()


def npy_from_b64(text: str) -> np.ndarray:
    """Decode vLLM's ``routed_experts`` (base64 of a ``.npy`` file); refuses pickled objects."""
    return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)


def npy_to_b64(array: np.ndarray) -> str:
    """Encode an array the way vLLM sends ``routed_experts``."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def npy_bytes(array: np.ndarray) -> bytes:
    """Raw ``.npy`` bytes of ``array`` (what the sessions table stores)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def npy_load(raw: bytes) -> np.ndarray:
    """Load raw ``.npy`` bytes stored by :func:`npy_bytes`."""
    return np.load(io.BytesIO(raw), allow_pickle=False)
