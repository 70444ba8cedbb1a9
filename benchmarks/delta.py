"""Delta size and speed of the weight store on the project's own RL versions, against full-checkpoint
compression, XOR + zstd, a byte-plane (ZipNN-style) delta at zstd level 19, and the order-0 bound.

Consecutive versions come from the project's trainer as its pipeline makes them
(:func:`policy.pipeline.run_rl_versions`): the ``tiny`` preset, v0 a supervised warm-up (the checkpoint
``<home>/policy/v0000`` when one exists, else ``--sft-steps`` warm-up steps here; ``v0_source`` says
which), then ``--versions`` versions of ``--steps-per-version`` GRPO steps each
(:func:`policy.trainer.train_offline` with :func:`policy.pipeline.train_config` of the default
:class:`policy.config.PolicyConfig`: lr 3e-4, 8 tasks x 6 samples per step, rollouts of the task
family sampled by the policy and rewarded by the sandboxed checker, a fresh optimizer per version,
the version's seed as the pipeline derives it), stored as bf16 serving weights. The top level is the
first pair (v0 -> v1); ``pairs`` lists every consecutive pair.

Per pair:

- ``full_bytes``: the bf16 snapshot. Full-checkpoint baselines (what shipping the whole version
  compressed costs): ``full_zstd_bytes`` (zstd level 19 per tensor) and ``full_planes_zstd_bytes``
  (each tensor split into byte planes, high byte (sign, exponent) apart from low byte (mantissa), as
  ZipNN does, zstd level 19 per plane).
- Delta baselines against the exact base: ``xor_zstd_bytes`` (XOR of the bit patterns, zstd level 3
  per tensor, the published baseline), and the stronger ``xor_planes_zstd_bytes`` and
  ``sub_planes_zstd_bytes``: the XOR, or the wrapping integer difference of the bit patterns (an
  arithmetic delta), split into byte planes, zstd level 19 per plane. ``baselines`` has each one's
  bytes, ratio, encode and decode MB/s (in memory, decode = decompress, reassemble, apply to the base)
  and ``bitexact`` (decoded equals the target bit for bit, checked every run).
- The project's delta: ``delta_bytes`` (the store's delta file, default config), ``entropy_bound_bytes``
  (order-0 entropy of the whole XOR stream over 16-bit symbols), ``changed_fraction``,
  ``delta_vs_best_baseline`` (against the smallest baseline).
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

``lr_1e-6`` and ``lr_1e-5``: the earlier synthetic pair, kept for comparison with older figures: one
plain AdamW step (fp32 master weights) at that lr after one forward/backward on random tokens, on a
Qwen3-MoE of 4 layers, 16 experts top-2, hidden 128 (not the RL trainer).

Timings are wall clock; on a shared machine they are noisy (rerun on an idle one for figures to
quote). Run: ``python benchmarks/delta.py --json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import zstandard
from transformers import PreTrainedModel, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.config import PolicyConfig, WeightsConfig
from policy.weights import SigningKey, WeightStore
from policy.weights.codec import decode_tensor, encode_tensor
from policy.weights.format import checksum, magnitude_mask, to_words
from policy.weights.tensors import cast_for_serving
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.weights import WeightUpdater

LRS = (1e-6, 1e-5)
PLANES_LEVEL = 19
"""zstd level of the byte-plane baselines (the strongest ZipNN-style setting that stays practical)."""


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


def checkpoint_views(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, scratch: Path
) -> dict[str, torch.Tensor]:
    """``model``'s live parameters under the names the store keeps them by (the checkpoint's: one tensor
    per expert projection, :class:`serving.params.ModelParams`), as views that follow its training."""
    from policy.model import save_checkpoint
    from serving.params import ModelParams

    params = ModelParams(model, save_checkpoint(model, tokenizer, scratch / "v0"), threading.Lock())
    return {name: params.get(name) for name in params.names()}


def serving_state(views: dict[str, torch.Tensor], serving_dtype: str | None = "bfloat16") -> dict[str, torch.Tensor]:
    """A copy of the tensors as the store keeps them (fp32 master weights cast to the serving dtype)."""
    return {k: cast_for_serving(v.detach(), serving_dtype).clone() for k, v in views.items()}


def trainer_versions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    versions: int,
    steps_per_version: int,
    policy: PolicyConfig,
    scratch: Path,
) -> list[dict[str, torch.Tensor]]:
    """Serving states of ``model`` (v0) and of ``versions`` RL versions trained from it in place, each
    as :func:`policy.pipeline.run_rl_versions` trains one (its config, seed and a fresh optimizer)."""
    from policy.pipeline import train_config
    from policy.trainer import train_offline

    views = checkpoint_views(model, tokenizer, scratch)
    states = [serving_state(views, policy.weights.serving_dtype)]
    for number in range(1, versions + 1):
        cfg = replace(train_config(policy, steps_per_version), seed=policy.seed * 7919 + number)
        train_offline(model, tokenizer, cfg, version=number)  # type: ignore[arg-type]
        states.append(serving_state(views, policy.weights.serving_dtype))
    return states


def load_v0(home: Path, sft_steps: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """v0 from ``<home>/policy/v0000`` when it exists, else a warm-up here; and where it came from."""
    from policy.model import load_checkpoint
    from policy.sft import SFTConfig, warmup

    cached = home / "policy" / "v0000"
    if (cached / "config.json").exists():
        model, tokenizer = load_checkpoint(cached)
        return model, tokenizer, str(cached)
    model, tokenizer, _ = warmup(SFTConfig(steps=sft_steps))
    return model, tokenizer, f"warm-up here ({sft_steps} steps, not timed)"


def best_of(fn: Callable[[], object], repeat: int, budget_s: float = 1.0) -> float:
    """Fastest of up to ``repeat`` runs (fewer once ``budget_s`` is spent), in seconds."""
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() - started < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def byte_planes(words: np.ndarray) -> list[bytes]:
    """``words`` split into byte planes, most significant byte first (for bf16: sign and exponent, then
    the low exponent bit and the mantissa)."""
    size = words.dtype.itemsize
    as_bytes = np.ascontiguousarray(words, dtype=words.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, size)
    return [np.ascontiguousarray(as_bytes[:, size - 1 - i]).tobytes() for i in range(size)]


def join_planes(planes: list[bytes], dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`byte_planes`."""
    size, count = dtype.itemsize, len(planes[0])
    if len(planes) != size or any(len(p) != count for p in planes):
        raise ValueError(f"expected {size} byte planes of equal length, got {[len(p) for p in planes]}")
    out = np.empty((count, size), dtype=np.uint8)
    for i, plane in enumerate(planes):
        out[:, size - 1 - i] = np.frombuffer(plane, dtype=np.uint8)
    return out.view(dtype.newbyteorder("<")).reshape(-1).astype(dtype)


PLANE_MODES = ("full", "xor", "sub")
"""What the byte-plane baseline compresses: the target itself, the XOR of the bit patterns, or their
wrapping integer difference (target - base)."""


def planes_encode(base: np.ndarray | None, target: np.ndarray, mode: str, level: int = PLANES_LEVEL) -> list[bytes]:
    """One tensor as zstd frames of byte planes (see :data:`PLANE_MODES`)."""
    if mode not in PLANE_MODES:
        raise ValueError(f"mode must be one of {PLANE_MODES} (got {mode!r})")
    if mode != "full" and (base is None or base.shape != target.shape or base.dtype != target.dtype):
        raise ValueError("a delta needs a base of the target's dtype and size")
    if mode == "xor":
        words = target ^ base
    elif mode == "sub":
        words = target - base  # unsigned: wraps modulo 2**bits, so adding it back is exact
    else:
        words = target
    compressor = zstandard.ZstdCompressor(level=level)
    return [compressor.compress(plane) for plane in byte_planes(words)]


def planes_decode(base: np.ndarray | None, frames: list[bytes], mode: str, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`planes_encode`."""
    decompressor = zstandard.ZstdDecompressor()
    words = join_planes([decompressor.decompress(f) for f in frames], dtype)
    if mode == "full":
        return words
    if base is None or base.shape != words.shape:
        raise ValueError("a delta needs the base it was made against")
    return words ^ base if mode == "xor" else words + base


def plane_baseline(base: dict[str, np.ndarray], target: dict[str, np.ndarray], mode: str) -> dict[str, object]:
    """Bytes, speeds and bit-exactness of the byte-plane baseline ``mode`` over every tensor."""
    mb = sum(w.nbytes for w in target.values()) / 1e6
    start = time.perf_counter()
    frames = {k: planes_encode(base.get(k), w, mode) for k, w in target.items()}
    encode_s = time.perf_counter() - start
    decoded: dict[str, np.ndarray] = {}

    def decode() -> None:
        for k, fs in frames.items():
            decoded[k] = planes_decode(base.get(k), fs, mode, target[k].dtype)

    decode_s = best_of(decode, repeat=20)
    size = sum(len(f) for fs in frames.values() for f in fs)
    return {
        "bytes": size,
        "ratio": round(sum(w.nbytes for w in target.values()) / size, 2),
        "encode_mb_s": round(mb / encode_s, 1),
        "decode_mb_s": round(mb / decode_s, 1),
        "bitexact": all(np.array_equal(decoded[k], target[k]) for k in target),
        "level": PLANES_LEVEL,
    }


def encode_all(base: dict[str, np.ndarray], target: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, bytes]:
    """Every tensor's payload with the opt-in low-magnitude class."""
    level = WeightsConfig().zstd_level
    return {k: encode_tensor(base[k], target[k], magnitude_mask(dtypes[k]), level=level).payload for k in target}


def decode_seconds(
    base: dict[str, np.ndarray], target: dict[str, np.ndarray], payloads: dict[str, bytes | memoryview]
) -> float:
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
    z19 = zstandard.ZstdCompressor(level=PLANES_LEVEL)
    start = time.perf_counter()
    full_zstd = sum(len(z19.compress(w.tobytes())) for w in target_w.values())
    full_zstd_s = time.perf_counter() - start
    baselines: dict[str, dict[str, object]] = {
        "full_zstd": {
            "bytes": full_zstd,
            "ratio": round(full / full_zstd, 2),
            "encode_mb_s": round(mb / full_zstd_s, 1),
        },
        "full_planes_zstd": plane_baseline(base_w, target_w, "full"),
        "xor_zstd": {"bytes": xor_zstd, "ratio": round(full / xor_zstd, 2), "level": 3},
        "xor_planes_zstd": plane_baseline(base_w, target_w, "xor"),
        "sub_planes_zstd": plane_baseline(base_w, target_w, "sub"),
    }
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
    classes_decode_s = decode_seconds(base_w, target_w, dict(classed))
    buffers = {k: np.empty_like(w) for k, w in target_w.items()}

    def memcpy() -> None:
        for k, w in target_w.items():
            np.copyto(buffers[k], w)

    memcpy_s = best_of(memcpy, repeat=100)
    best = min(baselines, key=lambda name: int(baselines[name]["bytes"]))  # type: ignore[call-overload]
    return {
        "full_bytes": full,
        "full_zstd_bytes": full_zstd,
        "full_planes_zstd_bytes": baselines["full_planes_zstd"]["bytes"],
        "xor_zstd_bytes": xor_zstd,
        "xor_planes_zstd_bytes": baselines["xor_planes_zstd"]["bytes"],
        "sub_planes_zstd_bytes": baselines["sub_planes_zstd"]["bytes"],
        "delta_bytes": delta_bytes,
        "entropy_bound_bytes": round(bound),
        "changed_fraction": round(float(np.count_nonzero(stream)) / stream.size, 5),
        "ratio": round(full / delta_bytes, 2),
        "xor_zstd_ratio": round(full / xor_zstd, 2),
        "bound_ratio": round(delta_bytes / bound, 3),
        "delta_vs_xor_zstd": round(delta_bytes / xor_zstd, 3),
        "best_baseline": best,
        "delta_vs_best_baseline": round(delta_bytes / int(baselines[best]["bytes"]), 3),  # type: ignore[call-overload]
        "encode_mb_s": round(mb / encode_s, 1),
        "decode_mb_s": round(mb / decode_s, 1),
        "apply_mb_s": round(mb / apply_s, 1),
        "memcpy_mb_s": round(mb / memcpy_s, 1),
        "decode_vs_memcpy": round(memcpy_s / decode_s, 4),
        "bitexact": bitexact,
        "baselines_bitexact": all(b.get("bitexact", True) for b in baselines.values()),
        "encodings": encodings,
        "baselines": baselines,
        "classes_delta_bytes": classes_bytes,
        "classes_bound_ratio": round(classes_bytes / bound, 3),
        "classes_encode_mb_s": round(mb / classes_encode_s, 1),
        "classes_decode_mb_s": round(mb / classes_decode_s, 1),
        "classes_decode_vs_memcpy": round(memcpy_s / classes_decode_s, 4),
    }


PAIR_KEYS = (
    "changed_fraction", "full_bytes", "delta_bytes", "ratio", "xor_zstd_ratio", "best_baseline",
    "delta_vs_best_baseline", "bound_ratio", "decode_mb_s", "apply_mb_s", "bitexact", "baselines_bitexact",
)  # fmt: skip


def run(home: Path, sft_steps: int, versions: int, steps_per_version: int, synthetic: bool) -> dict[str, object]:
    torch.set_num_threads(1)
    policy = PolicyConfig()
    model, tokenizer, source = load_v0(home, sft_steps)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        states = trainer_versions(
            model,
            tokenizer,
            versions=versions,
            steps_per_version=steps_per_version,
            policy=policy,
            scratch=Path(scratch),
        )
    train_s = time.perf_counter() - start
    from policy.model import num_parameters

    pairs = [measure(a, b) for a, b in itertools.pairwise(states)]
    out: dict[str, object] = {
        "model": f"tiny preset ({num_parameters(model)} parameters), bf16 serving weights; versions of the RL trainer",
        "source": "trainer",
        "v0_source": source,
        "versions": versions,
        "steps_per_version": steps_per_version,
        "lr": policy.rl_lr,
        "trainer_seconds": round(train_s, 1),
        **pairs[0],
        "pairs": [{"pair": f"v{i}->v{i + 1}", **{k: m[k] for k in PAIR_KEYS}} for i, m in enumerate(pairs)],
    }
    if synthetic:
        torch.set_num_threads(2)
        base, targets = checkpoints()
        torch.set_num_threads(1)
        for lr, target in zip(LRS, targets, strict=True):
            result = measure(base, target)
            result["lr"] = lr
            result["model"] = "Qwen3-MoE 4 layers, 16 experts top-2, hidden 128; one AdamW step, fp32 master, bf16"
            out[f"lr_{lr:.0e}".replace("e-0", "e-")] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (always printed last)")
    parser.add_argument("--home", default=".undertow", help="Undertow home holding policy/v0000")
    parser.add_argument("--sft-steps", type=int, default=150, help="warm-up steps when no v0 exists")
    parser.add_argument("--versions", type=int, default=2, help="RL versions after v0 (pairs measured)")
    parser.add_argument(
        "--steps-per-version", type=int, default=PolicyConfig().rl_steps_per_version, help="trainer steps per version"
    )
    parser.add_argument("--no-synthetic", action="store_true", help="skip the earlier synthetic AdamW pair")
    args = parser.parse_args()
    if args.versions < 1 or args.steps_per_version < 1:
        raise SystemExit("--versions and --steps-per-version must be at least 1")
    started = time.perf_counter()
    result = run(Path(args.home), args.sft_steps, args.versions, args.steps_per_version, not args.no_synthetic)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
