"""The vLLM worker extension against a fake worker that keeps vLLM's layout: fused ``qkv_proj``
parameters filled by a ``load_weights`` that maps Hugging Face names, as vLLM's models do."""

from __future__ import annotations

import pytest
import torch

from serving.vllm_ext import UndertowWorkerExtension


class FusedModel(torch.nn.Module):
    """Holds q/k/v of each layer fused in one tensor; everything else under its HF name."""

    def __init__(self, hf: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params: dict[str, torch.Tensor] = {}
        self.loads = 0
        self.load_weights(list(hf.items()))
        self.loads = 0

    @staticmethod
    def _fused(name: str) -> tuple[str, int] | None:
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            if f".{part}." in name:
                return name.replace(part, "qkv_proj"), i
        return None

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, value in weights:
            self.loads += 1
            fused = self._fused(name)
            if fused is None:
                self.params.setdefault(name, torch.empty_like(value)).copy_(value)
                continue
            key, slot = fused
            parts = list(self.params.get(key + "#parts", (None, None, None)))  # type: ignore[arg-type]
            parts[slot] = value.clone()
            self.params[key + "#parts"] = parts  # type: ignore[assignment]
            if all(p is not None for p in parts):
                self.params[key] = torch.cat(parts, 0)


class Runner:
    def __init__(self, model: FusedModel) -> None:
        self.model = model


class FakeConfig:
    def __init__(self, path: str) -> None:
        self.model = path


class FakeWorker(UndertowWorkerExtension):
    def __init__(self, checkpoint: str, hf: dict[str, torch.Tensor]) -> None:
        self.model_config = FakeConfig(checkpoint)
        self.model_runner = Runner(FusedModel(hf))


def _fused_q(worker: FakeWorker, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    name = next(n for n in tensors if ".q_proj." in n)
    key = name.replace("q_proj", "qkv_proj")
    expect = torch.cat(
        [tensors[name], tensors[name.replace("q_proj", "k_proj")], tensors[name.replace("q_proj", "v_proj")]]
    )
    return worker.model_runner.model.params[key], expect


def test_extension_applies_delta_in_vllm_layout_and_refuses_corruption(versions, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("UNDERTOW_WEIGHTS_STORE", str(versions.store))
    monkeypatch.setenv("UNDERTOW_WEIGHTS_VERSION", "v0")
    monkeypatch.setenv("UNDERTOW_WEIGHTS_PUBLIC_KEY", str(versions.public_key))
    worker = FakeWorker(str(versions.checkpoint), dict(versions.model_tensors["v0"]))
    info = worker.undertow_weight_info()
    assert info == {"version": "v0", "hash": versions.hashes["v0"], "staged": None}

    # Corrupt delta (same size, garbage inside): refused before load_weights touches the model.
    delta = versions.store / "versions" / "v1" / "delta.bin"
    good = delta.read_bytes()
    delta.write_bytes(bytes(len(good) // 3) + good[len(good) // 3 :])
    try:
        with pytest.raises(ValueError, match="corrupt"):
            worker.undertow_prefetch(to_version="v1", from_version="v0", kind="delta")
    finally:
        delta.write_bytes(good)
    assert worker.model_runner.model.loads == 0
    got, expect = _fused_q(worker, versions.model_tensors["v0"])
    assert torch.equal(got, expect)

    # Wrong expected hash: refused, nothing loaded.
    worker.undertow_prefetch(to_version="v1", from_version="v0")
    with pytest.raises(ValueError, match="refused"):
        worker.undertow_apply(to_version="v1", expected_hash="0" * 64)
    assert worker.model_runner.model.loads == 0

    # The real delta: only touched tensors are loaded, into the fused layout, and the hash switches.
    pulled = worker.undertow_prefetch(to_version="v1", from_version="v0")
    assert pulled["kind"] == "delta" and 0 < pulled["bytes"] < 1_000_000
    info = worker.undertow_apply(to_version="v1", expected_hash=versions.hashes["v1"])
    assert info["version"] == "v1" and info["hash"] == versions.hashes["v1"]
    assert 0 < worker.model_runner.model.loads <= len(versions.model_tensors["v1"])
    got, expect = _fused_q(worker, versions.model_tensors["v1"])
    assert torch.equal(got, expect)
    # And back (rollback): a local revert of the touched tensors, no store read.
    pulled = worker.undertow_prefetch(to_version="v0")
    assert pulled["kind"] == "undo" and pulled["bytes"] == 0
    assert worker.undertow_apply(to_version="v0", expected_hash=versions.hashes["v0"])["version"] == "v0"
    got, expect = _fused_q(worker, versions.model_tensors["v0"])
    assert torch.equal(got, expect)
