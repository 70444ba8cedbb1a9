"""Weight updates in process: the CPU engine's checkpoint-name view of fused experts, delta and
snapshot pulls from the weight store, the hash check, the sparse undo, hostile inputs."""

from __future__ import annotations

import threading

import pytest
import torch

from serving.params import ModelParams
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.weights import WeightUpdater


@pytest.fixture
def engine_model(versions):  # type: ignore[no-untyped-def]
    from policy.model import load_checkpoint

    model, _ = load_checkpoint(versions.checkpoint)
    return model


def _fused_expert(model, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    experts = model.model.layers[layer].mlp.experts
    return experts.gate_up_proj[expert].detach().clone(), experts.down_proj[expert].detach().clone()


def test_updates_write_fused_experts_in_place_and_undo_reverts(engine_model, versions) -> None:  # type: ignore[no-untyped-def]
    params = ModelParams(engine_model, versions.checkpoint, threading.Lock())
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store))
    assert updater.hash == versions.hashes["v0"]
    gate_up = engine_model.model.layers[1].mlp.experts.gate_up_proj
    pointer = gate_up.data_ptr()

    pulled = updater.prefetch(PrefetchRequest(to_version="v2", kind="delta"))
    assert pulled["steps"] == ["delta:v1", "delta:v2"] and updater.version == "v0"
    assert updater.apply(ApplyRequest(to_version="v2", expected_hash=versions.hashes["v2"])).version == "v2"
    v2 = versions.model_tensors["v2"]
    gu, down = _fused_expert(engine_model, 1, 3)
    half = gu.shape[0] // 2
    assert torch.equal(gu[:half], v2["model.layers.1.mlp.experts.3.gate_proj.weight"].float())
    assert torch.equal(gu[half:], v2["model.layers.1.mlp.experts.3.up_proj.weight"].float())
    assert torch.equal(down, v2["model.layers.1.mlp.experts.3.down_proj.weight"].float())
    assert gate_up.data_ptr() == pointer, "updates must write in place"

    # Rollback: the sparse undo, no store read, bit-exact v0 again.
    pulled = updater.prefetch(PrefetchRequest(to_version="v0"))
    assert pulled["kind"] == "undo"
    updater.apply(ApplyRequest(to_version="v0", expected_hash=versions.hashes["v0"]))
    assert updater.hash == versions.hashes["v0"]
    gu, _ = _fused_expert(engine_model, 1, 3)
    assert torch.equal(gu[:half], versions.model_tensors["v0"]["model.layers.1.mlp.experts.3.gate_proj.weight"].float())

    # Snapshot path (the baseline) gets to the same bits.
    assert updater.prefetch(PrefetchRequest(to_version="v1", kind="snapshot"))["steps"] == ["full:v1"]
    updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
    assert WeightUpdater(params, version="v1", store_url=str(versions.store)).hash == versions.hashes["v1"]


def test_engine_loads_the_stored_bits_when_the_checkpoint_differs(versions) -> None:  # type: ignore[no-untyped-def]
    from policy.model import load_checkpoint

    model, _ = load_checkpoint(versions.checkpoint)
    params = ModelParams(model, versions.checkpoint, threading.Lock())
    q = model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q.add_(1e-3)  # the engine's weights are not the stored bits of the version it claims
    assert WeightUpdater(params, version="v0", store_url=None).hash != versions.hashes["v0"]
    # ModelParams refuses a checkpoint whose values do not match the model it maps.
    with pytest.raises(ValueError, match="does not match"):
        ModelParams(model, versions.checkpoint, threading.Lock())
    # With the store attached, the engine loads the stored bits where they differ.
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store))
    assert updater.hash == versions.hashes["v0"]
    assert torch.equal(q, versions.model_tensors["v0"]["model.layers.0.self_attn.q_proj.weight"].float())


def test_unknown_versions_wrong_names_and_stale_staging_are_refused(engine_model, versions, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from policy.weights import WeightStore

    params = ModelParams(engine_model, versions.checkpoint, threading.Lock())
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store))
    with pytest.raises(ValueError, match="not in the store"):
        updater.prefetch(PrefetchRequest(to_version="v9"))
    with pytest.raises(ValueError, match="nothing staged"):
        updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
    updater.prefetch(PrefetchRequest(to_version="v1"))
    with pytest.raises(ValueError, match="nothing staged"):
        updater.apply(ApplyRequest(to_version="v2", expected_hash=versions.hashes["v2"]))
    with pytest.raises(ValueError, match="without a weight store"):
        WeightUpdater(params, version="v0", store_url=None).prefetch(PrefetchRequest(to_version="v1"))
    # A store put with in-memory (fused) names does not fit the checkpoint names the engine serves.
    other = WeightStore(tmp_path / "fused")
    other.put({k: v.to(torch.bfloat16) for k, v in engine_model.state_dict().items()}, version="v0")
    with pytest.raises(ValueError, match="checkpoint names"):
        WeightUpdater(params, version="v0", store_url=str(tmp_path / "fused"))
