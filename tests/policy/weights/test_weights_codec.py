"""The per-tensor codec: bit-exact round trips for every serving dtype, and a decoder that fails safely."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.weights.codec import (
    LOW_DENSE,
    LOW_SPARSE,
    _frames,
    _header,
    _layouts,
    decode_tensor,
    encode_tensor,
    from_planes,
    to_planes,
)
from policy.weights.format import WeightsError, checksum, from_words, magnitude_mask, to_words

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _roundtrip(base: torch.Tensor | None, target: torch.Tensor, **kw: object) -> str:
    name = str(target.dtype).removeprefix("torch.")
    t_words = to_words(target)
    b_words = to_words(base) if base is not None else None
    encoded = encode_tensor(b_words, t_words, magnitude_mask(name), **kw)  # type: ignore[arg-type]
    out = decode_tensor(encoded.payload, b_words, t_words.dtype, t_words.size, checksum(t_words))
    back = from_words(out, name, list(target.shape))
    assert torch.equal(back.view(torch.uint8), target.contiguous().view(torch.uint8))
    return encoded.encoding


def _step(base: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """A small optimizer-like update applied in fp32 and rounded to the base dtype."""
    gen = torch.Generator().manual_seed(seed)
    master = base.float()
    noise = torch.randn(master.shape, generator=gen) * master.abs().mean() * fraction
    return (master + noise).to(base.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_small_update_is_bit_exact(dtype: torch.dtype) -> None:
    base = (torch.randn(64, 96) * 0.05).to(dtype)
    assert _roundtrip(base, _step(base, 0.01)) in ("sparse", "planes", "classed")


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_unchanged_and_fully_changed(dtype: torch.dtype) -> None:
    base = torch.randn(50, 40).to(dtype)
    assert _roundtrip(base, base.clone()) == "same"
    changed = (base.float() * -1.7 + 0.3).to(dtype)
    _roundtrip(base, changed)


def test_roundtrip_new_tensor_and_integers() -> None:
    assert _roundtrip(None, torch.randn(33).to(torch.bfloat16)) == "raw"
    base = torch.arange(100, dtype=torch.int64)
    _roundtrip(base, base * 3)
    flags = torch.rand(77) > 0.5
    _roundtrip(flags, ~flags)


def test_magnitude_classes_are_used_and_exact() -> None:
    torch.manual_seed(0)
    base = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    master = base.float()
    target = (master - 1e-5 * torch.sign(torch.randn_like(master))).to(torch.bfloat16)
    words = to_words(base)
    encoded = encode_tensor(words, to_words(target), magnitude_mask("bfloat16"))
    assert encoded.encoding == "classed", "a magnitude-dependent change should pick the low-magnitude class"
    _roundtrip(base, target)
    plain = encode_tensor(words, to_words(target), None)
    assert plain.encoding == "sparse" and len(encoded.payload) < len(plain.payload)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("fraction", [0.002, 0.05])
def test_classed_roundtrip_every_float_dtype(dtype: torch.dtype, fraction: float) -> None:
    """Both low-class modes (dense and by rank) and every word size decode bit for bit."""
    gen = torch.Generator().manual_seed(1)
    base = (torch.randn(8192, generator=gen) * torch.rand(8192, generator=gen) ** 4).to(dtype)
    master = base.float()
    target = (master + fraction * master.abs().mean() * torch.sign(torch.randn(8192, generator=gen))).to(dtype)
    name = str(dtype).removeprefix("torch.")
    b_words, t_words = to_words(base), to_words(target)
    for mode in (LOW_DENSE, LOW_SPARSE):
        for encoding, low_mode, sections in _layouts(b_words ^ t_words, b_words, magnitude_mask(name)):
            if encoding != "classed" or low_mode != mode:
                continue
            payload = _header(encoding, t_words, low_mode) + _frames(zstandard.ZstdCompressor(), sections)
            out = decode_tensor(payload, b_words, t_words.dtype, t_words.size, checksum(t_words))
            assert np.array_equal(out, t_words)
    _roundtrip(base, target)


def test_sparse_steps_with_escapes_roundtrip() -> None:
    """Changes more than 255 elements apart need escapes; the first and last element change too."""
    base = to_words(torch.randn(100_000).to(torch.bfloat16))
    target = base.copy()
    target[[0, 1, 300, 70_000, 70_001, 99_999]] ^= np.uint16(0x0101)
    encoded = encode_tensor(base, target, None)
    assert encoded.encoding == "sparse"
    assert np.array_equal(decode_tensor(encoded.payload, base, base.dtype, base.size, checksum(target)), target)


def test_decoded_tensor_does_not_alias_the_base() -> None:
    base = to_words(torch.randn(5000).to(torch.bfloat16))
    before = base.copy()
    for target in (base.copy(), base ^ np.uint16(1)):
        encoded = encode_tensor(base, target, 0x7FFF)
        out = decode_tensor(encoded.payload, base, base.dtype, base.size, checksum(target))
        out[:] = 0
        assert np.array_equal(base, before)


def test_planes_roundtrip() -> None:
    words = np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(from_planes(to_planes(words), words.dtype, words.size), words)


def test_decode_refuses_wrong_base() -> None:
    base = torch.randn(1000).to(torch.bfloat16)
    target = _step(base, 0.05)
    encoded = encode_tensor(to_words(base), to_words(target), 0x7FFF)
    other = to_words(_step(base, 0.05, seed=1))
    with pytest.raises(WeightsError, match="checksum"):
        decode_tensor(encoded.payload, other, other.dtype, other.size, checksum(to_words(target)))


_BASE = to_words((torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16))
_TARGET = to_words(from_words(_BASE, "bfloat16", [5000]).float().add(2e-5).to(torch.bfloat16))
_VALID = encode_tensor(_BASE, _TARGET, None).payload
_EXPECTED = checksum(_TARGET)
_CLASSED_TARGET = _BASE ^ np.where((_BASE & 0x7FFF) < 0x3A00, 1, (np.arange(5000) % 97 == 0)).astype(np.uint16)
_CLASSED = encode_tensor(_BASE, _CLASSED_TARGET, 0x7FFF).payload
_CLASSED_EXPECTED = checksum(_CLASSED_TARGET)


_CASES = {"sparse": (_VALID, _TARGET, _EXPECTED), "classed": (_CLASSED, _CLASSED_TARGET, _CLASSED_EXPECTED)}


def test_fuzz_payloads_are_the_intended_layouts() -> None:
    assert _VALID[4] == 3 and _CLASSED[4] == 4  # sparse, classed


@pytest.mark.parametrize("kind", list(_CASES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2000))
def test_fuzz_arbitrary_bytes_only_raise_weights_error(kind: str, data: bytes) -> None:
    valid, _target, expected = _CASES[kind]
    with pytest.raises(WeightsError):
        decode_tensor(data, _BASE, _BASE.dtype, _BASE.size, expected)
    for keep in (16, 32, 40):  # after the header, the counts, the cut
        with pytest.raises(WeightsError):
            decode_tensor(valid[:keep] + data, _BASE, _BASE.dtype, _BASE.size, expected)


@pytest.mark.parametrize("kind", list(_CASES))
@settings(max_examples=200, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=4), data=st.data())
def test_fuzz_mutated_payload_never_returns_wrong_weights(
    kind: str, flips: list[tuple[int, int]], data: st.DataObject
) -> None:
    valid, target, expected = _CASES[kind]
    payload = bytearray(valid)
    for position, xor in flips:
        payload[position % len(payload)] ^= xor
    cut = data.draw(st.integers(0, len(payload)))
    mutated = bytes(payload[:cut]) if data.draw(st.booleans()) else bytes(payload)
    try:
        out = decode_tensor(mutated, _BASE, _BASE.dtype, _BASE.size, expected)
    except WeightsError:
        return
    assert np.array_equal(out, target)


def test_changes_and_chunked_checksum_match_the_materialized_tensor() -> None:
    from policy.weights.changes import checksum_changed, materialize
    from policy.weights.codec import decode_changes, encode_tensor
    from policy.weights.format import checksum

    rng = np.random.default_rng(3)
    for size in (1, 7, 4096, (1 << 18) + 5):
        base = rng.integers(0, 1 << 16, size, dtype=np.uint16)
        target = base.copy()
        moved = rng.choice(size, max(1, size // 25), replace=False)
        target[moved] ^= rng.integers(1, 1 << 16, moved.size, dtype=np.uint16)
        encoded = encode_tensor(base, target, None, level=3)
        changes = decode_changes(encoded.payload, base, base.dtype, size)
        assert np.array_equal(materialize(base, changes), target)
        if changes.positions is not None:
            assert np.all(np.diff(changes.positions) > 0)
            assert checksum_changed(base, changes.positions, changes.words) == checksum(target)
            assert checksum_changed(base, changes.positions, changes.words, chunk=1000) == checksum(target)
