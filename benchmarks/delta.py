"""Delta size and speed of the weight store against plain XOR + zstd and the order-0 entropy bound.

Consecutive checkpoints come from a tiny Qwen3-MoE (4 layers, 16 experts top-2, hidden 128)
trained with real AdamW steps on random tokens, fp32 master weights, stored as bf16 serving
weights (the project's RL trainer is not wired in here yet: these are plain AdamW steps).
For each learning rate (1e-6 top level, 1e-5 under ``lr_1e-5``), from the first step:

- ``full_bytes``: the bf16 snapshot; ``xor_zstd_bytes``: XOR of the bit patterns, zstd level 3
  per tensor (the published baseline); ``delta_bytes``: the store's delta file;
  ``entropy_bound_bytes``: order-0 entropy of the whole XOR stream over 16-bit symbols.
- ``encode_mb_s`` / ``decode_mb_s``: codec throughput over the model's bytes (decode includes
  the checksum check); ``apply_mb_s``: ``apply_delta_inplace`` end to end from the store
  (verify, then write); ``memcpy_mb_s``: copying the same bytes, the ceiling.
- ``plain_*``: the same without magnitude classes (smaller is the classes' gain).

Run: ``python benchmarks/delta.py --json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.config import WeightsConfig
from policy.weights import WeightStore, apply_delta_inplace
from policy.weights.codec import decode_tensor, encode_tensor
from policy.weights.format import checksum, magnitude_mask, to_words


def checkpoints(lr: float, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """bf16 serving states before and after each AdamW step (fp32 master weights)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    states = [{k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}]
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (8, 128))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
    return states


def best_of(fn, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    """Fastest of ``repeat`` runs, in seconds (the machine is shared)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], classes: bool) -> dict[str, object]:
    base_w = {k: to_words(v) for k, v in base.items()}
    target_w = {k: to_words(v) for k, v in target.items()}
    full = sum(w.nbytes for w in target_w.values())
    mb = full / 1e6
    xor = {k: base_w[k] ^ target_w[k] for k in target_w}
    stream = np.concatenate([x.ravel() for x in xor.values()])
    _, counts = np.unique(stream, return_counts=True)
    p = counts / counts.sum()
    bound = float(-(p * np.log2(p)).sum() * stream.size / 8)
    z3 = zstandard.ZstdCompressor(level=3)
    xor_zstd = sum(len(z3.compress(x.tobytes())) for x in xor.values())
    config = WeightsConfig(magnitude_classes=classes)
    masks = {k: magnitude_mask(str(v.dtype).removeprefix("torch.")) if classes else None for k, v in target.items()}
    start = time.perf_counter()
    encoded = {k: encode_tensor(base_w[k], target_w[k], masks[k], level=config.zstd_level) for k in target_w}
    encode_s = time.perf_counter() - start
    expected = {k: checksum(w) for k, w in target_w.items()}

    def decode() -> None:
        for k, e in encoded.items():
            decode_tensor(e.payload, base_w[k], base_w[k].dtype, base_w[k].size, expected[k])

    decode_s = best_of(decode)
    buffers = {k: np.empty_like(w) for k, w in base_w.items()}
    memcpy_s = best_of(lambda: [np.copyto(buffers[k], w) for k, w in base_w.items()], repeat=5)
    with tempfile.TemporaryDirectory() as tmp:
        store = WeightStore(Path(tmp) / "weights", config)
        v0 = store.put(base).version
        manifest = store.put(target)
        delta_bytes = manifest.delta.bytes if manifest.delta else 0
        live = {k: v.clone() for k, v in base.items()}
        start = time.perf_counter()
        apply_delta_inplace(live, store.open_delta(manifest.version), held_version=v0)
        apply_s = time.perf_counter() - start
    bitexact = all(torch.equal(live[k].view(torch.int16), target[k].view(torch.int16)) for k in target)
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
    }


def run() -> dict[str, object]:
    torch.set_num_threads(2)
    out: dict[str, object] = {"model": "Qwen3-MoE 4 layers, 16 experts top-2, hidden 128; AdamW, fp32 master, bf16"}
    for lr, key in ((1e-6, None), (1e-5, "lr_1e-5")):
        states = checkpoints(lr, steps=1)
        result = measure(states[0], states[1], classes=True)
        plain = measure(states[0], states[1], classes=False)
        result.update({f"plain_{k}": plain[k] for k in ("delta_bytes", "bound_ratio", "decode_mb_s")})
        result["lr"] = lr
        if key is None:
            out.update(result)
        else:
            out[key] = result
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
