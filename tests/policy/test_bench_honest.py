"""The cores of the train, delta and deploy benchmarks at tiny sizes: what each one measures is what it says.

- train: the trainer's recomputation of served completions (one-at-a-time and packed paths, routing
  replay on and off), and the engine over HTTP under concurrent requests;
- delta: the byte-plane baselines round-trip bit for bit and need their base; a real trainer step's
  delta is measured bit-exact by every method;
- deploy: a trainer-made version reaches a replica's weights bit for bit by delta and by snapshot,
  and a shaped link really bounds the transfer.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from policy_helpers import synthetic_batch

from benchmarks import delta as bench_delta
from benchmarks import deploy as bench_deploy
from benchmarks import netlink
from benchmarks import train as bench_train
from policy.forward import generate
from policy.model import build_model, save_checkpoint
from policy.sft import prompt_ids
from policy.tasks import train_tasks
from policy.trainer import TrainConfig, make_optimizer, update_step


def _served(model, tokenizer, n: int = 3, max_tokens: int = 8) -> list[bench_train.Served]:  # type: ignore[no-untyped-def]
    """Completions as the CPU engine makes them (:func:`policy.forward.generate`, its code path)."""
    out = []
    for i, task in enumerate(train_tasks()[:n]):
        prompt = prompt_ids(tokenizer, task)
        gen = generate(model, prompt, max_tokens=max_tokens, seed=i)[0]
        out.append(
            bench_train.Served(prompt, gen.token_ids, np.asarray(gen.logprobs, dtype=np.float64), gen.routed_experts)
        )
    return out


def test_replay_on_the_served_routing_reproduces_the_served_logprobs(tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    served = _served(tiny, tokenizer)
    table = bench_train.gap_table(tiny, served)
    exact_on, packed_on = table["one_at_a_time"]["replay_on"], table["packed"]["replay_on"]
    assert exact_on["tokens"] == packed_on["tokens"] == sum(len(s.token_ids) for s in served)
    assert exact_on["max_abs"] == 0.0 and exact_on["routing_differs"] == 0.0
    assert packed_on["max_abs"] < 1e-5 and packed_on["routing_differs"] == 0.0


def test_perturbed_routing_separates_replay_on_from_off(tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    served = _served(tiny, tokenizer)
    experts = int(tiny.config.num_experts)
    perturbed, moved, rows = [], 0, 0
    for s in served:
        routed = s.routed_experts.copy()
        rows_moved = np.arange(routed.shape[0]) % 2 == 0
        routed[rows_moved] = (routed[rows_moved] + 1) % experts  # a different expert set in every layer
        perturbed.append(replace(s, routed_experts=routed))
        moved, rows = moved + int(rows_moved.sum()), rows + routed.shape[0]
    on = bench_train.recompute_gap(tiny, perturbed, replay=True)
    off = bench_train.recompute_gap(tiny, perturbed, replay=False)
    assert on.routing_differs == 0.0 and on.max_abs > 1e-4  # follows the (wrong) served routing
    assert off.routing_differs == pytest.approx(moved / rows) and off.routing_differs_layers == pytest.approx(
        moved / rows
    )
    assert off.max_abs == 0.0  # its own routing is the one the served logprobs came from


def test_one_update_later_replay_holds_the_served_routing(tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    served = _served(tiny, tokenizer, n=4, max_tokens=12)
    batch = synthetic_batch(tiny, tokenizer)
    cfg = TrainConfig(lr=3e-2)
    update_step(tiny, make_optimizer(tiny, cfg), batch, cfg)
    on = bench_train.recompute_gap(tiny, served, replay=True)
    off = bench_train.recompute_gap(tiny, served, replay=False)
    assert on.routing_differs == 0.0 < off.routing_differs
    assert on.max_abs > 0.0 and off.max_abs > 0.0


def test_engine_serves_concurrent_requests_that_the_trainer_reproduces(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from policy.model import load_checkpoint
    from serving.launch import EngineProcess

    checkpoint = save_checkpoint(build_model("tiny", len(tokenizer), seed=3), tokenizer, tmp_path / "ckpt")
    prompts = [prompt_ids(tokenizer, task) for task in train_tasks()[:4]]
    engine = EngineProcess(checkpoint, "v0", None, log_path=tmp_path / "engine.log").start()
    try:
        engine.wait_ready(timeout_s=180)
        streamed, stats = bench_train.serve_requests(engine.url, prompts, max_tokens=6, concurrency=4, stream=True)
        whole, _ = bench_train.serve_requests(engine.url, prompts[:2], max_tokens=6, concurrency=2)
    finally:
        engine.stop()
    model, _ = load_checkpoint(checkpoint)
    layers, top_k = int(model.config.num_hidden_layers), int(model.config.num_experts_per_tok)
    assert [s.prompt_ids for s in streamed] == prompts
    for s in streamed + whole:
        assert len(s.logprobs) == len(s.token_ids) >= 1
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.token_ids) - 1, layers, top_k)
    assert all(s.decode_logprobs is not None and len(s.decode_logprobs) == len(s.token_ids) for s in streamed)
    assert stats["engine_max_inflight"] >= 2  # requests waited in flight together
    for served in (streamed, whole):
        gap = bench_train.recompute_gap(model, served, replay=True)
        assert gap.max_abs == 0.0 and gap.routing_differs == 0.0
    decode = bench_train.recompute_gap(model, streamed, replay=True, against="decode")
    assert decode.tokens == sum(len(s.token_ids) for s in streamed) and decode.max_abs < 1e-3
    with pytest.raises(ValueError, match="streamed"):
        bench_train.recompute_gap(model, whole, replay=True, against="decode")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", bench_delta.PLANE_MODES)
def test_plane_baselines_round_trip_bit_exactly(dtype: torch.dtype, mode: str) -> None:
    from policy.weights.format import to_words

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=gen).to(dtype)
    moved = torch.rand(4099, generator=gen) < 0.3
    target = torch.where(moved, base.float() * (1 + 1e-2 * torch.randn(4099, generator=gen)), base.float()).to(dtype)
    base_w, target_w = to_words(base), to_words(target)
    frames = bench_delta.planes_encode(base_w, target_w, mode)
    assert len(frames) == target_w.dtype.itemsize
    decoded = bench_delta.planes_decode(base_w, frames, mode, target_w.dtype)
    assert decoded.dtype == target_w.dtype and np.array_equal(decoded, target_w)
    if mode != "full":
        other = to_words(torch.randn(4099, generator=gen).to(dtype))
        assert not np.array_equal(bench_delta.planes_decode(other, frames, mode, target_w.dtype), target_w)


def test_plane_baseline_refuses_a_base_that_does_not_fit() -> None:
    target = np.arange(10, dtype=np.uint16)
    with pytest.raises(ValueError, match="base"):
        bench_delta.planes_encode(np.arange(9, dtype=np.uint16), target, "xor")
    with pytest.raises(ValueError, match="mode"):
        bench_delta.planes_encode(target, target, "gzip")


def test_a_real_trainer_step_is_measured_bit_exact_by_every_method(tiny, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    views = bench_delta.checkpoint_views(tiny, tokenizer, tmp_path)
    base = bench_delta.serving_state(views)
    cfg = TrainConfig(lr=3e-4)
    update_step(tiny, make_optimizer(tiny, cfg), synthetic_batch(tiny, tokenizer), cfg)
    target = bench_delta.serving_state(views)
    assert set(base) == set(target) and any(".experts.0." in name for name in target)  # the store's names
    result = bench_delta.measure(base, target)
    assert result["bitexact"] is True and result["baselines_bitexact"] is True
    assert 0 < result["changed_fraction"] < 1  # type: ignore[operator]
    sizes = {name: b["bytes"] for name, b in result["baselines"].items()}  # type: ignore[attr-defined]
    assert result["delta_bytes"] < result["full_bytes"]  # type: ignore[operator]
    assert sizes["xor_planes_zstd"] < sizes["full_planes_zstd"] < result["full_bytes"]
    assert result["best_baseline"] == min(sizes, key=sizes.__getitem__)


def _trainer_store(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A tiny v0 checkpoint and a store with v0 and a trainer-made v1 (delta and snapshot)."""
    from safetensors.torch import load_file

    from policy.config import WeightsConfig
    from policy.weights import SigningKey, WeightStore

    ckpt, _ = bench_deploy.make_checkpoint(tmp_path, "tiny")
    signer = SigningKey(tmp_path / "keys" / "weights.pem", tmp_path / "keys" / "weights.pub")
    store = WeightStore(tmp_path / "store", WeightsConfig(zstd_level=3), signer=signer)
    store.put(ckpt, version="v0", full=True)
    info: dict[str, object] = {}
    (v1,) = list(bench_deploy.trainer_versions(ckpt, 1, steps=1, tasks_per_step=1, info=info))
    manifest = store.put(v1, version="v1", full=True)
    return ckpt, load_file(str(ckpt / "model.safetensors")), store, manifest, signer, info


def test_a_trainer_version_reaches_a_replica_bit_exactly_by_delta_and_snapshot(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _, held, store, manifest, signer, info = _trainer_store(tmp_path)
    (made,) = info["versions"]  # type: ignore[index]
    assert len(set(made["rewards"])) > 1 and made["changed_fraction"] > 0  # a real GRPO signal moved the weights
    target = store.state_dict("v1")
    figures = {
        kind: bench_deploy.link_transfer(
            str(tmp_path / "store"),
            held,
            target,
            to_version="v1",
            expected_hash=manifest.version_hash,
            kind=kind,
            public_key=signer.public_path,
        )
        for kind in ("delta", "snapshot")
    }
    assert figures["delta"]["bitexact"] and figures["snapshot"]["bitexact"]
    assert figures["delta"]["bytes"] == manifest.delta.bytes < figures["snapshot"]["bytes"]
    assert sum(not torch.equal(target[k], held[k].to(torch.bfloat16)) for k in target) > len(target) // 2


@pytest.mark.skipif(netlink.available() is not None, reason=f"no network namespace here: {netlink.available()}")
def test_a_shaped_link_bounds_the_snapshot_transfer(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _, held, store, manifest, signer, _ = _trainer_store(tmp_path)
    mbit = 20
    with bench_deploy.remote_store(tmp_path, mbit) as url:
        figures = bench_deploy.link_transfer(
            url,
            held,
            store.state_dict("v1"),
            to_version="v1",
            expected_hash=manifest.version_hash,
            kind="snapshot",
            public_key=signer.public_path,
        )
    floor = figures["bytes"] * 8 / (mbit * 1e6)
    assert figures["bitexact"] and floor > 0.3
    assert figures["prefetch_s"] >= 0.8 * floor  # the bytes crossed the shaped link
