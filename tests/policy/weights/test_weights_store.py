"""The store end to end on real checkpoints: round trips, tampering, chains with fallback, GC.

Versions are applied to live tensors the way a replica applies them: through the serving layer's
:class:`serving.weights.WeightUpdater` (prefetch, then apply with the expected hash)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs

from policy.config import WeightsConfig
from policy.weights import DeltaReader, SigningKey, WeightsError, WeightStore, collect, plan, plan_gc
from policy.weights.format import DELTA_FILE, FULL_FILE, MANIFEST
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.weights import WeightUpdater


def _bf16(path: Path) -> dict[str, torch.Tensor]:
    return {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in load_file(path / "model.safetensors").items()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def _flip(path: str, offset: int) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[offset] ^= 0x5A
    Path(path).write_bytes(bytes(raw))


def _filled(store: WeightStore, checkpoints: list[Path]) -> list[str]:
    return [store.put(path).version for path in checkpoints]


def _switch(store: WeightStore, live: dict[str, torch.Tensor], held: str, to: str, kind: str = "auto") -> dict:
    """Move ``live`` (holding ``held``) to ``to`` as a replica does; returns what the prefetch pulled."""
    assert store.signer is not None
    updater = WeightUpdater.for_dict(live, version=held, store_url=store.url, public_key=store.signer.public_path)
    pulled = updater.prefetch(PrefetchRequest(to_version=to, kind=kind))
    applied = updater.apply(ApplyRequest(to_version=to, expected_hash=store.manifest(to).version_hash))
    updater.settle()
    assert applied.version == to and applied.hash == store.manifest(to).version_hash
    return pulled


def test_checkpoints_roundtrip_bit_exact(store: WeightStore, checkpoints: list[Path]) -> None:
    versions = _filled(store, checkpoints)
    manifests = [store.manifest(v) for v in versions]
    assert manifests[0].full is not None and manifests[0].delta is None
    assert manifests[1].full is None and manifests[1].delta is not None
    for version, path in zip(versions, checkpoints, strict=True):
        assert _same(store.state_dict(version), _bf16(path))
    assert manifests[1].delta.bytes * 5 < manifests[0].full.bytes  # type: ignore[union-attr]
    full = load_file(store.path(versions[0], FULL_FILE))  # the snapshot is plain safetensors
    assert _same(full, _bf16(checkpoints[0]))


def test_a_delta_updates_a_live_model_in_place(store: WeightStore, checkpoints: list[Path]) -> None:
    versions = _filled(store, checkpoints)
    live = store.state_dict(versions[0])
    tensor_ids = {k: (id(v), v.data_ptr()) for k, v in live.items()}
    pulled = _switch(store, live, versions[0], versions[1], kind="delta")
    assert pulled["steps"] == [f"delta:{versions[1]}"] and pulled["tensors"] > 0
    assert _same(live, _bf16(checkpoints[1]))
    assert {k: (id(v), v.data_ptr()) for k, v in live.items()} == tensor_ids, "tensors must be updated in place"


def test_new_and_removed_tensors(store: WeightStore) -> None:
    first = {"w": torch.randn(40, 40).to(torch.bfloat16), "gone": torch.randn(8).half(), "step": torch.tensor([1])}
    second = {
        "w": first["w"].float().add(1e-3).to(torch.bfloat16),
        "extra": torch.randn(3, 3),
        "step": torch.tensor([2]),
    }
    second["w2"] = torch.randn(5).to(torch.float8_e4m3fn)
    a, b = store.put(first).version, store.put(second).version
    expected = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in second.items()}
    assert _same(store.state_dict(b), expected)  # rebuilt from a's snapshot and b's delta
    assert store.manifest(b).delta.removed == ["gone"]  # type: ignore[union-attr]
    # A running engine cannot grow or drop parameters: the update is refused, nothing is written.
    live = store.state_dict(a)
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(ValueError, match="adds tensor"):
        _switch(store, live, a, b)
    assert _same(live, before)
    # Every dtype's delta applies bit for bit (bf16, fp8, int64).
    third = {
        "w": expected["w"].float().add(1e-3).to(torch.bfloat16),
        "extra": expected["extra"].float().mul(1.5).to(torch.bfloat16),
        "step": torch.tensor([3]),
        "w2": expected["w2"].float().mul(-1.0).to(torch.float8_e4m3fn),
    }
    c = store.put(third).version
    live = store.state_dict(b)
    _switch(store, live, b, c, kind="delta")
    assert _same(live, third)


def test_flipped_byte_in_delta_is_detected_and_nothing_applied(store: WeightStore, checkpoints: list[Path]) -> None:
    versions = _filled(store, checkpoints)
    manifest = store.manifest(versions[1])
    entry = max(manifest.delta.tensors.values(), key=lambda e: e.length)  # type: ignore[union-attr]
    _flip(store.path(versions[1], DELTA_FILE), entry.offset + entry.length // 2)
    live = store.state_dict(versions[0])
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(ValueError, match="corrupt"):
        _switch(store, live, versions[0], versions[1], kind="delta")
    assert _same(live, before)


def test_truncated_files_are_detected(store: WeightStore, checkpoints: list[Path]) -> None:
    versions = _filled(store, checkpoints)
    delta_path = Path(store.path(versions[1], DELTA_FILE))
    live = store.state_dict(versions[0])
    held_v1 = store.state_dict(versions[1])
    delta_path.write_bytes(delta_path.read_bytes()[:-10])
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(ValueError, match=r"truncated|corrupt"):
        _switch(store, live, versions[0], versions[1], kind="delta")
    assert _same(live, before)
    full_path = Path(store.path(versions[0], FULL_FILE))
    full_path.write_bytes(full_path.read_bytes()[:-100])
    before = {k: v.clone() for k, v in held_v1.items()}
    with pytest.raises(ValueError, match=r"truncated|corrupt"):
        _switch(store, held_v1, versions[1], versions[0], kind="snapshot")
    assert _same(held_v1, before)


def test_wrong_base_version_is_refused(store: WeightStore, checkpoints: list[Path]) -> None:
    versions = _filled(store, checkpoints)
    live = store.state_dict(versions[0])
    before = {k: v.clone() for k, v in live.items()}
    # A receiver that claims v1 but holds v0's bits: v2's delta (base v1) must not apply.
    updater = WeightUpdater.for_dict(live, version=versions[1], store_url=None)
    updater.store = store
    with pytest.raises(ValueError, match=f"does not match version {versions[1]}"):
        updater.prefetch(PrefetchRequest(to_version=versions[2], kind="delta"))
    assert _same(live, before)


def test_missing_or_tampered_manifest(store: WeightStore, checkpoints: list[Path]) -> None:
    versions = _filled(store, checkpoints)
    Path(store.path(versions[2], MANIFEST)).unlink()
    assert [m.version for m in store.manifests()] == versions[:2]
    with pytest.raises(WeightsError, match="not in the store"):
        store.open_delta(versions[2])
    path = Path(store.path(versions[1], MANIFEST))
    doc = json.loads(path.read_text())
    name = next(iter(doc["tensors"]))
    doc["tensors"][name]["checksum"] = "0" * 32
    path.write_text(json.dumps(doc))
    with pytest.raises(WeightsError, match="whole-version hash"):
        store.manifest(versions[1])


def test_chain_plans_cheapest_path_and_falls_back_to_snapshot(tmp_path: Path, signer: SigningKey) -> None:
    store = WeightStore(tmp_path / "w", WeightsConfig(snapshot_every=2), signer=signer)
    torch.manual_seed(0)
    state = {"w": torch.randn(200, 100).to(torch.bfloat16)}
    versions, states = [], []
    for _ in range(5):
        versions.append(store.put(state).version)
        states.append({k: v.clone() for k, v in state.items()})
        state = {"w": state["w"].float().add(torch.randn(200, 100) * 1e-3).to(torch.bfloat16)}
    manifests = store.manifests()
    assert [m.full is not None for m in manifests] == [True, False, True, False, True]
    assert [s.kind for s in plan(manifests, versions[3], versions[1])] == ["delta", "delta"]
    assert [s.kind for s in plan(manifests, versions[3], None)] == ["full", "delta"]
    assert plan(manifests, versions[3], versions[3]) == []
    assert [(s.kind, s.version) for s in plan(manifests, versions[4], versions[3])] == [("delta", versions[4])]
    _flip(store.path(versions[3], DELTA_FILE), 40)  # corrupt delta v2 -> v3
    live = {k: v.clone() for k, v in states[1].items()}
    assert [s.kind for s in plan(manifests, versions[4], versions[1])] == ["delta", "delta", "delta"]
    with capture_logs() as logs:
        pulled = _switch(store, live, versions[1], versions[4])
    assert [e["version"] for e in logs if e["event"] == "weights.artifact_refused"] == [versions[3]]
    assert pulled["steps"] == [f"full:{versions[4]}"] and _same(live, states[4])
    Path(store.path(versions[4], DELTA_FILE)).unlink()  # missing delta: nearest snapshot instead
    live = {k: v.clone() for k, v in states[3].items()}
    with capture_logs() as logs:
        pulled = _switch(store, live, versions[3], versions[4])
    assert [e["version"] for e in logs if e["event"] == "weights.artifact_refused"] == [versions[4]]
    assert pulled["steps"] == [f"full:{versions[4]}"] and _same(live, states[4])


def test_magnitude_classes_through_the_store(tmp_path: Path, checkpoints: list[Path], signer: SigningKey) -> None:
    """The opt-in low-magnitude class stores smaller deltas that apply bit for bit."""
    plain = WeightStore(tmp_path / "plain", WeightsConfig(), signer=signer)
    classed = WeightStore(tmp_path / "classed", WeightsConfig(magnitude_classes=True), signer=signer)
    for store in (plain, classed):
        versions = _filled(store, checkpoints[:2])
        live = store.state_dict(versions[0])
        _switch(store, live, versions[0], versions[1], kind="delta")
        assert _same(live, _bf16(checkpoints[1]))
    p_delta, c_delta = (s.manifest(s.latest() or "").delta for s in (plain, classed))
    assert p_delta is not None and c_delta is not None
    assert "classed" in {e.encoding for e in c_delta.tensors.values()}
    assert "classed" not in {e.encoding for e in p_delta.tensors.values()}
    assert c_delta.bytes < p_delta.bytes


def test_rollback_plans_through_the_nearest_snapshot(tmp_path: Path, signer: SigningKey) -> None:
    """Deltas only go forward: rolling back is a snapshot at or before the target plus deltas after it."""
    store = WeightStore(tmp_path / "w", WeightsConfig(snapshot_every=3), signer=signer)
    torch.manual_seed(1)
    state = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    versions, states = [], []
    for _ in range(6):
        versions.append(store.put(state).version)
        states.append({k: v.clone() for k, v in state.items()})
        state = {"w": state["w"].float().add(torch.randn(64, 64) * 1e-2).to(torch.bfloat16)}
    steps = plan(store.manifests(), versions[1], versions[5])
    assert [(s.kind, s.version) for s in steps] == [("full", versions[0]), ("delta", versions[1])]
    live = {k: v.clone() for k, v in states[5].items()}
    pulled = _switch(store, live, versions[5], versions[1])
    assert pulled["steps"] == [f"full:{versions[0]}", f"delta:{versions[1]}"] and _same(live, states[1])


def test_delta_reader_reuses_and_closes_its_file(
    store: WeightStore, checkpoints: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = _filled(store, checkpoints[:2])
    reader = store.open_delta(versions[1])
    names = list(reader.delta.tensors)
    first = reader.payload(names[0])
    assert reader._handle is not None
    reader.close()
    assert reader._handle is None and reader.payload(names[0]) == first  # reopens on demand
    reader.close()
    assert bytes(reader.load().payload(names[0])) == bytes(first)  # one read of the whole file, then slices
    reader.close()
    assert reader._whole is None
    opened: list[DeltaReader] = []
    real_open_delta = WeightStore.open_delta

    def open_delta(self: WeightStore, version: str) -> DeltaReader:
        opened.append(real_open_delta(self, version))
        return opened[-1]

    monkeypatch.setattr(WeightStore, "open_delta", open_delta)
    _switch(store, store.state_dict(versions[0]), versions[0], versions[1], kind="delta")
    assert opened and all(r._handle is None and r._whole is None for r in opened), "a pull closes the delta file"


def test_gc_keeps_what_replicas_need(tmp_path: Path, signer: SigningKey) -> None:
    store = WeightStore(tmp_path / "w", WeightsConfig(snapshot_every=3, retain_last=1), signer=signer)
    state = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    versions = []
    for i in range(7):
        state = {"w": state["w"] + float(i)}
        versions.append(store.put(state).version)
    # v1 full, v2, v3 delta, v4 full, v5, v6 delta, v7 full
    gc_plan = plan_gc(store.manifests(), in_use={versions[4]}, retain_last=1)
    assert versions[4] in gc_plan.keep and versions[3] in gc_plan.keep  # v5 and its chain root v4
    assert versions[5] in gc_plan.keep  # v5 -> v7 deltas stay for the replica's cheap update
    assert versions[0] in gc_plan.delete and versions[1] in gc_plan.delete
    Path(store.path("crashed")).mkdir()
    result = collect(store, {versions[4]}, retain_last=1)
    assert result.delete == gc_plan.delete and result.incomplete == []
    assert [m.version for m in store.manifests()] == gc_plan.keep
    live = store.state_dict(versions[4])
    assert _switch(store, live, versions[4], versions[6])["steps"] == [f"delta:{versions[5]}", f"delta:{versions[6]}"]
    assert _same(live, store.state_dict(versions[6]))
    store.config = WeightsConfig(stale_write_s=1e-9)
    assert collect(store, set()).incomplete == ["crashed"]


def test_store_urls_resolve_against_the_home(tmp_path: Path) -> None:
    from policy.config import PolicyConfig
    from policy.weights import open_store, resolve_store_url

    home = tmp_path / "home"
    assert resolve_store_url("weights", home) == str(home / "weights")
    assert resolve_store_url("shared/weights", home) == str(home / "shared" / "weights")
    assert resolve_store_url(str(tmp_path / "elsewhere"), home) == str(tmp_path / "elsewhere")
    assert resolve_store_url("http://10.0.0.5:8300/", home) == "http://10.0.0.5:8300/"
    assert resolve_store_url("s3://bucket/weights", home) == "s3://bucket/weights"
    config = PolicyConfig(weights_url="weights", weights=WeightsConfig(snapshot_every=2))
    store = open_store(config, home)
    assert Path(store.root) == home / "weights" and (home / "weights" / "versions").is_dir()
    assert store.config.snapshot_every == 2
    version = store.put({"w": torch.ones(4, dtype=torch.bfloat16)}).version
    assert open_store(config.model_copy(update={"weights_url": str(home / "weights")}), tmp_path).latest() == version
