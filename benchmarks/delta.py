"""Delta size and speed of the weight store against plain XOR + zstd and the order-0 entropy bound.

Consecutive checkpoints come from a tiny Qwen3-MoE (4 layers, 16 experts top-2, hidden 128):
one forward/backward on random tokens from a seeded init, then one real AdamW step (fp32
master weights) per learning rate from the same gradients, stored as bf16 serving weights
(the project's RL trainer is not wired in here: these are plain AdamW steps). For each
learning rate (1e-6 top level, 1e-5 under ``lr_1e-5``):

- ``full_bytes``: the bf16 snapshot; ``xor_zstd_bytes``: XOR of the bit patterns, zstd level 3
  per tensor (the published baseline); ``delta_bytes``: the store's delta file (default
  config); ``entropy_bound_bytes``: order-0 entropy of the whole XOR stream over 16-bit symbols.
- ``encode_mb_s``: ``WeightStore.put`` of the target as a delta (rebuilding the base from its
  snapshot, checksums, layout choice, compression, writing) over the model's bytes.
- ``decode_mb_s``: bytes of reconstructed target tensors per second of decode time, where
  decoding a tensor is: verify the payload checksum, decompress, reconstruct the target from
  the base, verify the target checksum (payloads and bases in memory). Best of repeated runs.
- ``apply_mb_s``: a replica's update end to end from the store directory, as
  :class:`serving.weights.WeightUpdater` runs it on a dict of live tensors: ``prefetch`` (read
  the delta, check base and payload checksums, decode, verify each target checksum) and
  ``apply`` (whole-version hash, in-place writes of the changed positions); the updater is built
  before the clock starts (it hashes the held tensors once, as an engine does at load).
- ``memcpy_mb_s``: copying the same tensors into preallocated buffers, the ceiling.
- ``bitexact``: the live tensors after the apply equal the target bit for bit.
- ``classes_*``: the codec with the opt-in low-magnitude class (smaller, slower decode; bit-exact
  or the run fails).

Timings are wall clock, best of several runs; on a shared machine they are noisy (rerun on
an idle one for figures to quote). Run: ``python benchmarks/delta.py --json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.config import WeightsConfig
from policy.weights import SigningKey, WeightStore
from policy.weights.codec import decode_tensor, encode_tensor
from policy.weights.format import checksum, magnitude_mask, to_words
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.weights import WeightUpdater

LRS = (1e-6, 1e-5)


def checkpoints(
    lrs: tuple[float, ...] = LRS, seed: int = 0
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The bf16 serving state before, and after one AdamW step at each ``lr`` (same init and gradients)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, config.vocab_size, (8, 128))
    model(input_ids=tokens, labels=tokens).loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    after = []
    for lr in lrs:
        model.load_state_dict(initial)
        for name, p in model.named_parameters():
            p.grad = grads[name].clone() if name in grads else None
        torch.optim.AdamW(model.parameters(), lr=lr).step()
        after.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
    return {k: v.to(torch.bfloat16) for k, v in initial.items()}, after


def best_of(fn: Callable[[], object], repeat: int, budget_s: float = 1.0) -> float:
    """Fastest of up to ``repeat`` runs (fewer once ``budget_s`` is spent), in seconds."""
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() - started < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def encode_all(base: dict[str, np.ndarray], target: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, bytes]:
    """Every tensor's payload with the opt-in low-magnitude class."""
    level = WeightsConfig().zstd_level
    return {k: encode_tensor(base[k], target[k], magnitude_mask(dtypes[k]), level=level).payload for k in target}


def decode_seconds(base: dict[str, np.ndarray], target: dict[str, np.ndarray], payloads: dict[str, bytes]) -> float:
    """Best time to decode every tensor from in-memory payloads; raises unless the result is bit-exact.

    Per tensor: verify the payload checksum, decompress, reconstruct from the base, verify the
    target checksum (what a receiver does for each tensor it applies).
    """
    sums = {k: checksum(p) for k, p in payloads.items()}
    expected = {k: checksum(w) for k, w in target.items()}
    decoded: dict[str, np.ndarray] = {}

    def decode() -> None:
        for k, payload in payloads.items():
            if checksum(payload) != sums[k]:
                raise RuntimeError(f"payload of {k} changed")
            decoded[k] = decode_tensor(payload, base[k], base[k].dtype, base[k].size, expected[k])

    seconds = best_of(decode, repeat=100)
    if not all(np.array_equal(decoded[k], target[k]) for k in target):
        raise RuntimeError("decoded tensors differ from the target")
    return seconds


def measure(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, object]:
    base_w = {k: to_words(v) for k, v in base.items()}
    target_w = {k: to_words(v) for k, v in target.items()}
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in target.items()}
    full = sum(w.nbytes for w in target_w.values())
    mb = full / 1e6
    xor = {k: base_w[k] ^ target_w[k] for k in target_w}
    stream = np.concatenate([x.ravel() for x in xor.values()])
    _, counts = np.unique(stream, return_counts=True)
    p = counts / counts.sum()
    bound = float(-(p * np.log2(p)).sum() * stream.size / 8)
    z3 = zstandard.ZstdCompressor(level=3)
    xor_zstd = sum(len(z3.compress(x.tobytes())) for x in xor.values())
    with tempfile.TemporaryDirectory() as tmp:
        signer = SigningKey(Path(tmp) / "keys" / "weights.pem", Path(tmp) / "keys" / "weights.pub")
        store = WeightStore(Path(tmp) / "weights", WeightsConfig(), signer=signer)
        v0 = store.put(base).version
        start = time.perf_counter()
        manifest = store.put(target)
        encode_s = time.perf_counter() - start
        assert manifest.delta is not None
        with store.open_delta(manifest.version) as reader:
            payloads = {k: reader.payload(k) for k in target}
        encodings = sorted({e.encoding for e in manifest.delta.tensors.values()})
        live = {k: v.clone() for k, v in base.items()}
        updater = WeightUpdater.for_dict(live, version=v0, store_url=store.url, public_key=signer.public_path)
        start = time.perf_counter()
        updater.prefetch(PrefetchRequest(to_version=manifest.version, kind="delta"))
        updater.apply(ApplyRequest(to_version=manifest.version, expected_hash=manifest.version_hash))
        updater.settle()
        apply_s = time.perf_counter() - start
    bitexact = all(torch.equal(live[k].view(torch.int16), target[k].view(torch.int16)) for k in target)
    delta_bytes = manifest.delta.bytes
    decode_s = decode_seconds(base_w, target_w, payloads)
    start = time.perf_counter()
    classed = encode_all(base_w, target_w, dtypes)
    classes_encode_s = time.perf_counter() - start
    classes_bytes = sum(len(p) for p in classed.values())
    classes_decode_s = decode_seconds(base_w, target_w, classed)
    buffers = {k: np.empty_like(w) for k, w in target_w.items()}

    def memcpy() -> None:
        for k, w in target_w.items():
            np.copyto(buffers[k], w)

    memcpy_s = best_of(memcpy, repeat=100)
    return {
        "full_bytes": full,
        "xor_zstd_bytes": xor_zstd,
        "delta_bytes": delta_bytes,
        "entropy_bound_bytes": round(bound),
        "changed_fraction": round(float(np.count_nonzero(stream)) / stream.size, 5),
        "ratio": round(full / delta_bytes, 2),
        "xor_zstd_ratio": round(full / xor_zstd, 2),
        "bound_ratio": round(delta_bytes / bound, 3),
        "delta_vs_xor_zstd": round(delta_bytes / xor_zstd, 3),
        "encode_mb_s": round(mb / encode_s, 1),
        "decode_mb_s": round(mb / decode_s, 1),
        "apply_mb_s": round(mb / apply_s, 1),
        "memcpy_mb_s": round(mb / memcpy_s, 1),
        "decode_vs_memcpy": round(memcpy_s / decode_s, 4),
        "bitexact": bitexact,
        "encodings": encodings,
        "classes_delta_bytes": classes_bytes,
        "classes_bound_ratio": round(classes_bytes / bound, 3),
        "classes_encode_mb_s": round(mb / classes_encode_s, 1),
        "classes_decode_mb_s": round(mb / classes_decode_s, 1),
        "classes_decode_vs_memcpy": round(memcpy_s / classes_decode_s, 4),
    }


def run() -> dict[str, object]:
    torch.set_num_threads(2)
    out: dict[str, object] = {"model": "Qwen3-MoE 4 layers, 16 experts top-2, hidden 128; AdamW, fp32 master, bf16"}
    base, targets = checkpoints()
    torch.set_num_threads(1)
    for lr, target in zip(LRS, targets, strict=True):
        result = measure(base, target)
        result["lr"] = lr
        if lr == LRS[0]:
            out.update(result)
        else:
            out[f"lr_{lr:.0e}".replace("e-0", "e-")] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (always printed last)")
    parser.parse_args()
    started = time.perf_counter()
    result = run()
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
