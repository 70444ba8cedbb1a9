"""Weight updates in process: the CPU engine's checkpoint-name view of fused experts, delta and
snapshot pulls from the weight store, the hash check, the sparse undo, hostile inputs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from policy.weights.format import to_words
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
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store), public_key=versions.public_key)
    assert updater.hash == versions.hashes["v0"]
    gate_up = engine_model.model.layers[1].mlp.experts.gate_up_proj
    pointer = gate_up.data_ptr()
    before = {name: tensor.clone() for name, tensor in engine_model.state_dict().items()}
    updater.warm_up()  # what the engine runs at start: it writes nothing the replica serves
    assert updater.state.refresh() == [] and updater.hash == versions.hashes["v0"]
    assert all(torch.equal(tensor, before[name]) for name, tensor in engine_model.state_dict().items())

    pulled = updater.prefetch(PrefetchRequest(to_version="v2", kind="delta"))
    assert pulled["steps"] == ["delta:v1", "delta:v2"] and updater.version == "v0"
    assert updater.apply(ApplyRequest(to_version="v2", expected_hash=versions.hashes["v2"])).version == "v2"
    # The fp32 engine's bf16 copy of the verified bits is written after the pause, then matches the model.
    assert updater._unsettled is not None
    updater.settle()
    for name in params.names():
        assert np.array_equal(updater.state.held[name], to_words(params.get(name).to(torch.bfloat16))), name
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
    assert (
        WeightUpdater(params, version="v1", store_url=str(versions.store), public_key=versions.public_key).hash
        == versions.hashes["v1"]
    )


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
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store), public_key=versions.public_key)
    assert updater.hash == versions.hashes["v0"]
    assert torch.equal(q, versions.model_tensors["v0"]["model.layers.0.self_attn.q_proj.weight"].float())


def test_unknown_versions_wrong_names_and_stale_staging_are_refused(engine_model, versions, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from policy.weights import SigningKey, WeightStore

    params = ModelParams(engine_model, versions.checkpoint, threading.Lock())
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store), public_key=versions.public_key)
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
    other = WeightStore(tmp_path / "fused", signer=SigningKey(versions.signing_key))
    other.put({k: v.to(torch.bfloat16) for k, v in engine_model.state_dict().items()}, version="v0")
    with pytest.raises(ValueError, match="checkpoint names"):
        WeightUpdater(params, version="v0", store_url=str(tmp_path / "fused"), public_key=versions.public_key)


def test_verified_state_is_carried_forward_and_foreign_writes_are_caught(engine_model, versions, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import serving.verified

    params = ModelParams(engine_model, versions.checkpoint, threading.Lock())
    updater = WeightUpdater(params, version="v0", store_url=str(versions.store), public_key=versions.public_key)
    # A delta is checked against the checksums verified at load: the held weights are not hashed again.
    hashed: list[str] = []
    real_derive = serving.verified.VerifiedState._derive
    monkeypatch.setattr(
        serving.verified.VerifiedState, "_derive", lambda self, n, d: (hashed.append(n), real_derive(self, n, d))
    )
    pulled = updater.prefetch(PrefetchRequest(to_version="v1", kind="delta"))
    assert (
        hashed == []
        and pulled["kind"] == "delta"
        and 0 < pulled["changed"] < sum(m.numel() for m in updater.table.values())
    )
    assert {"decode", "verify_target"} <= set(pulled["timings"])
    # Weights written by another path between prefetch and apply: the apply is refused, nothing written.
    q = engine_model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q.mul_(2.0)
    with pytest.raises(ValueError, match="written since the update was pulled"):
        updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
    assert hashed == ["model.layers.0.self_attn.q_proj.weight"]
    assert updater.version == "v0" and updater.hash != versions.hashes["v0"]  # the hash says what it really holds
    # The refreshed state no longer matches v1's base: the delta is refused, the snapshot repairs it.
    with pytest.raises(ValueError, match="does not match version v0"):
        updater.prefetch(PrefetchRequest(to_version="v1", kind="delta"))
    assert updater.prefetch(PrefetchRequest(to_version="v1", kind="snapshot"))["kind"] == "snapshot"
    assert (
        updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"])).hash == versions.hashes["v1"]
    )
    assert torch.equal(q, versions.model_tensors["v1"]["model.layers.0.self_attn.q_proj.weight"].float())
    # The state carried forward is what a fresh load verifies.
    assert (
        WeightUpdater(params, version="v1", store_url=str(versions.store), public_key=versions.public_key).table
        == updater.table
    )


def test_delta_whose_base_differs_from_the_verified_state_is_refused(versions) -> None:  # type: ignore[no-untyped-def]
    from policy.weights import Keyring, WeightStore

    # A replica that claims v1 but holds v0's bits: v2's delta (base v1) must not apply.
    held = {k: v.clone() for k, v in versions.model_tensors["v0"].items()}
    updater = WeightUpdater.for_dict(held, version="v1", store_url=None)
    updater.store = WeightStore(versions.store, keyring=Keyring(versions.public_key))
    with pytest.raises(ValueError, match="does not match version v1"):
        updater.prefetch(PrefetchRequest(to_version="v2", kind="delta"))
    assert all(torch.equal(held[k], v) for k, v in versions.model_tensors["v0"].items())


def test_sparse_updates_write_only_changed_positions_and_revert_exactly(versions) -> None:  # type: ignore[no-untyped-def]
    held = {k: v.clone() for k, v in versions.model_tensors["v0"].items()}
    updater = WeightUpdater.for_dict(held, version="v0", store_url=str(versions.store), public_key=versions.public_key)
    views = {k: v.data_ptr() for k, v in held.items()}
    pulled = updater.prefetch(PrefetchRequest(to_version="v1", kind="delta"))
    updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
    changed = sum(int((versions.model_tensors["v0"][k] != versions.model_tensors["v1"][k]).sum()) for k in held)
    assert pulled["changed"] == changed
    assert all(
        torch.equal(held[k], v) and held[k].data_ptr() == views[k] for k, v in versions.model_tensors["v1"].items()
    )
    assert updater.prefetch(PrefetchRequest(to_version="v0"))["kind"] == "undo"
    updater.apply(ApplyRequest(to_version="v0", expected_hash=versions.hashes["v0"]))
    assert all(torch.equal(held[k], v) for k, v in versions.model_tensors["v0"].items())
    # A tampered undo is refused before anything is written.
    assert updater.prefetch(PrefetchRequest(to_version="v1"))["kind"] == "undo"
    updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
    assert updater.undo is not None
    _name, (_positions, old) = next(iter(updater.undo.changes.items()))
    old[0] ^= 1
    with pytest.raises(ValueError, match="does not restore"):
        updater.prefetch(PrefetchRequest(to_version="v0"))
    assert all(torch.equal(held[k], v) for k, v in versions.model_tensors["v1"].items())
