"""The per-tensor codec: bit-exact round trips for every serving dtype, and a decoder that fails safely."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.weights.codec import decode_tensor, encode_tensor, from_planes, to_planes
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
    assert _roundtrip(base, _step(base, 0.01)) in ("sparse", "planes")


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
    assert encoded.payload[6] == 2, "a magnitude-dependent change should pick two classes"
    _roundtrip(base, target)
    plain = encode_tensor(words, to_words(target), None)
    assert len(encoded.payload) < len(plain.payload)


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


_BASE = to_words((torch.randn(5000) * 0.02).to(torch.bfloat16))
_TARGET = to_words(from_words(_BASE, "bfloat16", [5000]).float().add(1e-4).to(torch.bfloat16))
_VALID = encode_tensor(_BASE, _TARGET, 0x7FFF).payload
_EXPECTED = checksum(_TARGET)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000))
def test_fuzz_arbitrary_bytes_only_raise_weights_error(data: bytes) -> None:
    with pytest.raises(WeightsError):
        decode_tensor(data, _BASE, _BASE.dtype, _BASE.size, _EXPECTED)
    with pytest.raises(WeightsError):
        decode_tensor(_VALID[:24] + data, _BASE, _BASE.dtype, _BASE.size, _EXPECTED)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4), st.data())
def test_fuzz_mutated_payload_never_returns_wrong_weights(flips: list[tuple[int, int]], data: st.DataObject) -> None:
    payload = bytearray(_VALID)
    for position, xor in flips:
        payload[position] ^= xor
    cut = data.draw(st.integers(0, len(payload)))
    mutated = bytes(payload[:cut]) if data.draw(st.booleans()) else bytes(payload)
    try:
        out = decode_tensor(mutated, _BASE, _BASE.dtype, _BASE.size, _EXPECTED)
    except WeightsError:
        return
    assert np.array_equal(out, _TARGET)
