"""Bit-exact per-tensor delta codec: XOR of bit patterns, sparse positions or byte planes, zstd per section.

Encoding a tensor against its exact base (``x = base_bits ^ target_bits``), the smaller of:

- ``sparse``: the changed elements' positions as one-byte steps (``pos[i] - pos[i-1]``,
  ``pos[-1] = -1``; a step over 255 is a 0 byte plus a uint32 escape), then their XOR words
  as byte planes, most significant first. Ideally this costs ``N H(K/N)`` bits for the
  positions plus the entropy of the nonzero XOR words, which is exactly the order-0 entropy
  of the XOR stream; zstd at level 16 (btopt parsing) with each section its own frame comes
  within ~7% of it on real checkpoints (one frame for all sections: ~15%, level 9: ~15%).
- ``planes``: the whole XOR as byte planes (tried when over a third of the elements changed).
- ``classed`` (opt-in, ``WeightsConfig.magnitude_classes``): an optimizer step of size
  ``lr`` flips a bf16 value only when it crosses a rounding boundary ``2^-8 |w|`` wide, so
  small-magnitude elements change far more often. The receiver holds the base, so both
  sides can mark the elements whose base magnitude is under a cut (sent in the header) and
  code that low class apart (densely, or by rank within the class), the other changes by
  position in the whole tensor. This beats the order-0 bound (~0.9x on a tiny Qwen3-MoE,
  ~15% smaller than ``sparse``) but decoding must find the class's positions, a scan over
  the whole tensor that numpy does at ~0.8 ns/element: ~3x slower decode, under 10% of
  memcpy. The cut minimizes the estimated position bits ``n H(k/n) + N H((K-k)/N)`` (``H``
  the binary entropy), read off cumulative histograms of the base magnitude's top 16 bits.

Tensors whose XOR is all zero are ``same`` (no payload); new tensors or a changed
dtype/shape are ``raw`` (the target's own byte planes).

Payload layout (little-endian): magic ``UWD2``, encoding u8, word size u8, low-class mode u8
(0 none, 1 dense, 2 sparse), reserved u8, element count u64; then per encoding a sequence of
plain headers and sections, each section a u32 length and a zstd frame (length 0: empty):
``raw``/``planes`` one section per byte plane; ``sparse`` change and escape counts (u64 each),
then sections steps, escapes, value planes; ``classed`` the cut (u64), the low class (dense:
value planes; sparse: as ``sparse`` with ranks), then the rest as ``sparse``.

Decoding checks every count against the tensor size before allocating, refuses a frame whose
content size differs from what the counts imply, and checks the target checksum: arbitrary
bytes raise :class:`WeightsError` and never yield wrong weights. Left out: an arithmetic/ANS
coder with adaptive per-element contexts (it would go lower still but needs compiled code).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from policy.weights.changes import Changes, materialize
from policy.weights.format import WeightsError, checksum

MAGIC = b"UWD2"
ENCODINGS = ("same", "raw", "planes", "sparse", "classed")
LOW_NONE, LOW_DENSE, LOW_SPARSE = 0, 1, 2
_HEADER = struct.Struct("<4sBBBBQ")
_COUNTS = struct.Struct("<QQ")
_CUT = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
_MAX_ELEMENTS = 1 << 40
_MIN_CLASSED = 4096
_local = threading.local()


@dataclass(frozen=True)
class Encoded:
    """One tensor's encoded delta."""

    encoding: str
    payload: bytes


def to_planes(words: np.ndarray) -> bytes:
    """Split words into byte planes, most significant byte first (``[hi..., lo...]``)."""
    size = words.dtype.itemsize
    if size == 1:
        return words.tobytes()
    as_bytes = words.astype(words.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, size)
    return np.ascontiguousarray(as_bytes[:, ::-1].T).tobytes()


def from_planes(data: bytes | memoryview, dtype: np.dtype, count: int) -> np.ndarray:
    """Inverse of :func:`to_planes`."""
    size = dtype.itemsize
    if len(data) != size * count:
        raise WeightsError(f"byte planes hold {len(data)} bytes, expected {size * count}")
    planes = np.frombuffer(data, dtype=np.uint8).reshape(size, count)
    if size == 1:
        return planes[0].view(dtype).copy()
    out = planes[0].astype(dtype)
    for plane in planes[1:]:
        out <<= dtype.type(8)
        out |= plane
    return out


# ---- encoding ------------------------------------------------------------------------------


def _planes(words: np.ndarray) -> list[bytes]:
    """Byte planes of ``words``, most significant first, each its own section."""
    data, count = to_planes(words), words.size
    return [data[i * count : (i + 1) * count] for i in range(words.dtype.itemsize)]


def _steps(positions: np.ndarray) -> tuple[bytes, bytes]:
    """Sorted positions as one-byte steps and uint32 escapes (steps over 255, marked by a 0 byte)."""
    steps = np.diff(positions, prepend=-1)
    big = steps > 255
    return np.where(big, 0, steps).astype(np.uint8).tobytes(), to_planes(steps[big].astype(np.uint32))


class _Plain(bytes):
    """Header bytes written as they are between the compressed sections."""


def _sparse_sections(x: np.ndarray, positions: np.ndarray) -> list[bytes]:
    """Counts, then sections (steps, escapes, value planes) of the changes at ``positions`` of ``x``."""
    step_bytes, escapes = _steps(positions)
    counts = _Plain(_COUNTS.pack(positions.size, len(escapes) // 4))
    return [counts, step_bytes, escapes, *_planes(x[positions])]


def _magnitude_key(base: np.ndarray, mask: int) -> tuple[np.ndarray, int]:
    """The base magnitude's top (at most) 16 bits and the shift that drops the rest."""
    shift = max(8 * base.dtype.itemsize - 16, 0)
    mag = np.bitwise_and(base, base.dtype.type(mask))
    key = np.right_shift(mag, base.dtype.type(shift)) if shift else mag
    return key.astype(np.intp, copy=False), shift


def _entropy_bits(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``n H(k/n)``: ideal bits to say which ``k`` of ``n`` elements changed (0 where n is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    return np.asarray(n * h)


def best_cut(base: np.ndarray, changed: np.ndarray, mask: int) -> tuple[int, float]:
    """The magnitude cut that minimizes the estimated position bits, and its estimated saving in bits.

    With ``n(c)``/``k(c)`` elements/changes whose base magnitude is below ``c``, the cost is
    ``n H(k/n) + N H((K-k)/N)`` (the low class by rank, the rest by position in the whole
    tensor) against ``N H(K/N)`` without a class. All cuts are scored from two histograms.
    """
    key, shift = _magnitude_key(base, mask)
    bins = int(mask >> shift) + 1
    n = np.cumsum(np.bincount(key, minlength=bins))
    k = np.cumsum(np.bincount(key[changed], minlength=bins))
    total, changes = base.size, int(k[-1])
    cost = _entropy_bits(n, k) + _entropy_bits(np.full_like(n, total), changes - k)
    best = int(np.argmin(cost[:-1])) if bins > 1 else 0
    plain = float(_entropy_bits(np.array([total]), np.array([changes]))[0])
    return (best + 1) << shift, plain - float(cost[best])


def _layouts(x: np.ndarray, base: np.ndarray, mask: int | None) -> list[tuple[str, int, list[bytes]]]:
    """Candidate layouts ``(encoding, low mode, sections)`` worth compressing."""
    changed = x != 0
    positions = np.flatnonzero(changed)
    out: list[tuple[str, int, list[bytes]]] = []
    if positions.size * 3 > x.size:
        out.append(("planes", LOW_NONE, _planes(x)))
    out.append(("sparse", LOW_NONE, _sparse_sections(x, positions)))
    if mask is None or x.size < _MIN_CLASSED:
        return out
    cut, saving = best_cut(base, changed, mask)
    if saving < 64 * 8:
        return out
    low = np.bitwise_and(base, base.dtype.type(mask)) < base.dtype.type(cut)
    low_x = x[low]
    rest = _sparse_sections(x, np.flatnonzero(changed & ~low))
    head = _Plain(_CUT.pack(cut))
    out.append(("classed", LOW_DENSE, [head, *_planes(low_x), *rest]))
    if np.count_nonzero(low_x) * 2 < low_x.size:
        out.append(("classed", LOW_SPARSE, [head, *_sparse_sections(low_x, np.flatnonzero(low_x)), *rest]))
    return out


def _frames(compressor: zstandard.ZstdCompressor, sections: list[bytes], memo: dict[int, bytes] | None = None) -> bytes:
    """Each section as a u32-length-prefixed zstd frame (an empty one: a zero length, no frame); headers as they are.

    ``memo`` (by object identity) lets layouts that share sections compress them once.
    """
    out: list[bytes] = []
    memo = {} if memo is None else memo
    for section in sections:
        if isinstance(section, _Plain):
            out.append(section)
            continue
        if id(section) not in memo:
            memo[id(section)] = compressor.compress(section) if section else b""
        body = memo[id(section)]
        if len(body) >= 1 << 32:
            raise WeightsError("a tensor's delta section exceeds 4 GiB; split the tensor or store it in full")
        out.append(_LENGTH.pack(len(body)) + body)
    return b"".join(out)


def encode_tensor(base: np.ndarray | None, target: np.ndarray, mask: int | None, level: int = 16) -> Encoded:
    """Encode ``target`` words against ``base`` words (None or a different size: coded ``raw``).

    ``mask`` is the dtype's magnitude mask (:func:`policy.weights.format.magnitude_mask`) to allow
    the low-magnitude class (smaller deltas, slower decode), None for none. Each candidate layout
    is compressed at ``level`` and the smallest is kept.
    """
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    if target.size > _MAX_ELEMENTS:
        raise WeightsError(f"tensor of {target.size} elements is larger than the codec's limit of 2^40")
    if base is None or base.dtype != target.dtype or base.size != target.size:
        return Encoded("raw", _header("raw", target) + _frames(compressor, _planes(target)))
    x = np.bitwise_xor(base, target)
    if not x.any():
        return Encoded("same", _header("same", target))
    best: Encoded | None = None
    layouts = _layouts(x, base, mask)
    memo: dict[int, bytes] = {}
    for encoding, low_mode, sections in layouts:
        payload = _header(encoding, target, low_mode) + _frames(compressor, sections, memo)
        if best is None or len(payload) < len(best.payload):
            best = Encoded(encoding, payload)
    assert best is not None
    return best


def _header(encoding: str, target: np.ndarray, low_mode: int = LOW_NONE) -> bytes:
    return _HEADER.pack(MAGIC, ENCODINGS.index(encoding), target.dtype.itemsize, low_mode, 0, target.size)


# ---- decoding ------------------------------------------------------------------------------


def _decompressor() -> zstandard.ZstdDecompressor:
    """One reusable decompression context per thread (contexts are not thread safe)."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


class _Reader:
    """Bounds-checked cursor over a payload."""

    def __init__(self, data: bytes | memoryview):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise WeightsError(f"delta payload truncated: wanted {n} bytes at offset {self.pos} of {len(self.data)}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def counts(self, limit: int) -> tuple[int, int]:
        """A (changes, escapes) pair, checked against the ``limit`` elements they can index."""
        changes, escapes = _COUNTS.unpack(self.take(_COUNTS.size))
        if changes > limit or escapes > changes:
            raise WeightsError(f"delta payload claims {changes} changes ({escapes} escapes) in {limit} elements")
        return changes, escapes

    def section(self, size: int) -> bytes:
        """The next length-prefixed zstd frame, which must hold exactly ``size`` bytes."""
        (length,) = _LENGTH.unpack(self.take(_LENGTH.size))
        body = self.take(length)
        if not size:
            if length:
                raise WeightsError("delta payload holds a frame where the header implies an empty section")
            return b""
        try:
            claimed = zstandard.frame_content_size(body)
            if claimed != size:
                raise WeightsError(f"delta payload frame claims {claimed} bytes, the header implies {size}")
            out = _decompressor().decompress(body, max_output_size=size)
        except zstandard.ZstdError as err:
            raise WeightsError(f"delta payload holds a corrupt zstd frame: {err}") from err
        if len(out) != size:
            raise WeightsError("delta payload frame decompressed to a different size than its header says")
        return out

    def words(self, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` words from one section per byte plane."""
        if dtype.itemsize == 1:
            return np.frombuffer(self.section(count), dtype=dtype).copy()
        out = np.frombuffer(self.section(count), dtype=np.uint8).astype(dtype)
        for _ in range(dtype.itemsize - 1):
            out <<= dtype.type(8)
            out |= np.frombuffer(self.section(count), dtype=np.uint8)
        return out

    def changes(self, dtype: np.dtype, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """One set of sparse changes: (positions in ``[0, limit)``, XOR words there)."""
        changes, escapes = self.counts(limit)
        positions = _positions(self.section(changes), self.section(4 * escapes), escapes, limit)
        return positions, self.words(dtype, changes)

    def sparse(self, out: np.ndarray, dtype: np.dtype, index: np.ndarray | None = None) -> None:
        """XOR one set of sparse changes into ``out``; positions index ``index`` (then ``out``) if given."""
        positions, values = self.changes(dtype, out.size if index is None else index.size)
        if positions.size:
            where = positions if index is None else index[positions]
            values ^= out.take(where)  # take + assign beats the read-modify-write of ``out[where] ^= values``
            out[where] = values


def _positions(steps: bytes, escapes: bytes, count: int, limit: int) -> np.ndarray:
    """Positions from one-byte steps and ``count`` uint32 escapes; every one checked to lie in ``[0, limit)``."""
    small = np.frombuffer(steps, dtype=np.uint8)
    if not count:
        positions = np.cumsum(small, dtype=np.int64)
    else:
        big = from_planes(escapes, np.dtype(np.uint32), count)
        where = np.flatnonzero(small == 0)
        if where.size != count or float(big.sum(dtype=np.float64)) > limit:
            raise WeightsError("delta payload step escapes do not match their markers or overrun the tensor")
        if big.size and int(big.min()) <= 255:
            raise WeightsError("delta payload escapes a step that fits in one byte; positions would repeat")
        full = small.astype(np.int64)
        full[where] = big
        positions = np.cumsum(full)
    positions -= 1
    if positions.size and (positions[-1] >= limit or positions[0] < 0):
        raise WeightsError("delta payload points outside the tensor")
    return positions


def decode_changes(payload: bytes | memoryview, base: np.ndarray | None, dtype: np.dtype, count: int) -> Changes:
    """Decode one tensor's payload against ``base`` (never modified) into :class:`Changes`.

    Checks the header, every count and frame size, and that the payload is consumed exactly;
    arbitrary bytes raise :class:`WeightsError`. The target checksum is left to the caller.
    """
    if count < 0 or count > _MAX_ELEMENTS:
        raise WeightsError(f"tensor of {count} elements is out of range")
    reader = _Reader(payload)
    magic, code, word, low_mode, _reserved, n = _HEADER.unpack(reader.take(_HEADER.size))
    if magic != MAGIC:
        raise WeightsError("delta payload does not start with the UWD2 magic; it is not an Undertow delta")
    if code >= len(ENCODINGS) or word != dtype.itemsize or n != count:
        raise WeightsError(
            f"delta payload header (encoding {code}, word {word} B, {n} elements) "
            f"does not match the tensor ({dtype.itemsize} B words, {count} elements)"
        )
    encoding = ENCODINGS[code]
    if (encoding == "classed") != (low_mode != LOW_NONE) or low_mode > LOW_SPARSE:
        raise WeightsError(f"delta payload has low-class mode {low_mode} with encoding {encoding}")
    positions: np.ndarray | None = None
    old: np.ndarray | None = None
    if encoding == "raw":
        out = reader.words(dtype, count)
    elif base is None or base.size != count or base.dtype != dtype:
        raise WeightsError("delta payload needs a base tensor of the same dtype and size; the receiver has none")
    elif encoding == "same":
        positions, out = np.empty(0, dtype=np.int64), np.empty(0, dtype=dtype)
    elif encoding == "planes":
        out = reader.words(dtype, count)
        out ^= base
    elif encoding == "sparse":
        positions, out = reader.changes(dtype, count)
        old = base.take(positions)
        out ^= old
    else:
        out = _decode_classed(reader, base, low_mode, dtype)
    if reader.pos != len(reader.data):
        raise WeightsError(f"delta payload has {len(reader.data) - reader.pos} trailing bytes")
    return Changes(encoding, positions, out, old)


def decode_tensor(
    payload: bytes | memoryview, base: np.ndarray | None, dtype: np.dtype, count: int, expected: str
) -> np.ndarray:
    """Decode one tensor's words; raises :class:`WeightsError` unless they hash to ``expected``.

    ``base`` is the receiver's current words for this tensor (None for a new tensor); it is
    never modified. ``dtype``/``count`` come from the target's manifest entry.
    """
    out = materialize(base, decode_changes(payload, base, dtype, count))
    if checksum(out) != expected:
        raise WeightsError("decoded tensor does not match its checksum: the delta or the base is wrong")
    return out


def _decode_classed(reader: _Reader, base: np.ndarray, low_mode: int, dtype: np.dtype) -> np.ndarray:
    """The low class (dense or by rank) at the positions of base magnitudes under the cut, then the rest."""
    (cut,) = _CUT.unpack(reader.take(_CUT.size))
    bits = 8 * dtype.itemsize - 1
    if cut >= 1 << bits:
        raise WeightsError("delta payload has a magnitude cut that its dtype cannot have")
    low = np.flatnonzero(np.less(np.bitwise_and(base, dtype.type((1 << bits) - 1)), dtype.type(cut)))
    out = base.copy()
    if low_mode == LOW_DENSE:
        out[low] ^= reader.words(dtype, low.size)
    else:
        reader.sparse(out, dtype, index=low)
    reader.sparse(out, dtype)
    return out
