"""vLLM worker extension that applies Undertow weight updates in place, tensor by tensor.

Start vLLM with ``--worker-extension-cls serving.vllm_ext.UndertowWorkerExtension`` (full flags
in ``docs/serving.md``); vLLM mixes this class into each GPU worker, and its methods are called
through the dev-mode ``POST /collective_rpc`` with the same names and arguments the CPU engine
answers (:data:`serving.protocol.WEIGHT_RPC_METHODS`), so :class:`serving.client.EngineClient`
drives both backends the same way.

vLLM keeps weights in its own layout (fused ``qkv_proj``, stacked expert tensors, sharded over
tensor-parallel ranks), while Undertow's deltas and hashes are over the Hugging Face tensors of
the checkpoint. Each worker therefore keeps a host-memory shadow of the Hugging Face tensors
(read once from the store's version, or from the checkpoint directory without a store). An
update decodes the new values of the touched tensors against that shadow, verifies the version
hash, and only then hands the touched tensors to the model's own ``load_weights`` (which
writes them into the fused, sharded GPU parameters in place, as it does at startup) and
updates the shadow. A corrupt delta or a hash mismatch raises before ``load_weights`` is called:
the worker keeps serving the old weights.

Configuration comes from the environment of ``vllm serve`` (workers inherit it):
``UNDERTOW_WEIGHTS_STORE`` (the weight store), ``UNDERTOW_WEIGHTS_VERSION`` (the version of
the checkpoint being served, default ``v0``) and ``UNDERTOW_WEIGHTS_PUBLIC_KEY`` (the file of public
keys versions must be signed by: without it every version is refused, see
:mod:`policy.weights.signing`).

The dev-mode routes this extension is reached through are control routes: start the server with
``--middleware serving.engine_auth.ControlAuth`` and ``UNDERTOW_SERVING__FLEET__CONTROL_TOKEN`` so
they need the fleet's control token, and keep its port on a network only the deployer and the
gateway reach (``deploy/docker-compose.yml``).

Left out: the shadow costs host memory equal to the checkpoint per worker; a sharded shadow
(each tensor-parallel rank keeping only its slice) would need per-shard hashes in the store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from serving.params import DictParams, Tensors
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.weights import WeightUpdater


def load_hf_tensors(checkpoint: str | Path) -> Tensors:
    """Every tensor of a Hugging Face checkpoint directory (all ``*.safetensors`` shards), on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint}; the extension needs a safetensors checkpoint")
    tensors: Tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


class UndertowWorkerExtension:
    """Mixed into vLLM's worker: ``self.model_runner.model`` is the served model."""

    _undertow: WeightUpdater | None = None

    def _undertow_checkpoint(self) -> str:
        cfg = getattr(self, "vllm_config", None)
        model_config = getattr(cfg, "model_config", None) or getattr(self, "model_config", None)
        return str(model_config.model)  # type: ignore[union-attr]

    def _undertow_updater(self) -> WeightUpdater:
        if self._undertow is None:
            store, version = os.environ.get("UNDERTOW_WEIGHTS_STORE"), os.environ.get("UNDERTOW_WEIGHTS_VERSION", "v0")
            public_key = os.environ.get("UNDERTOW_WEIGHTS_PUBLIC_KEY")
            if store:  # the store names tensors as the checkpoint does, in the dtype the fleet serves
                from policy.weights import Keyring, WeightStore

                shadow = WeightStore(store, keyring=Keyring(public_key)).state_dict(version)
            else:
                shadow = load_hf_tensors(self._undertow_checkpoint())
            model = self.model_runner.model  # type: ignore[attr-defined]

            def load(new: Tensors) -> None:
                with torch.no_grad():
                    model.load_weights(weights=list(new.items()))

            self._undertow = WeightUpdater(
                DictParams(shadow, on_write=load), version=version, store_url=store, public_key=public_key
            )
        return self._undertow

    def undertow_weight_info(self) -> dict[str, Any]:
        """The version and hash this worker serves."""
        return self._undertow_updater().info().model_dump()

    def undertow_prefetch(self, **kwargs: Any) -> dict[str, Any]:
        """Pull an update into host memory while serving continues."""
        return self._undertow_updater().prefetch(PrefetchRequest(**kwargs))

    def undertow_apply(self, **kwargs: Any) -> dict[str, Any]:
        """Verify and apply the staged update (call while the engine is paused)."""
        return self._undertow_updater().apply(ApplyRequest(**kwargs)).model_dump()

    def undertow_discard(self) -> dict[str, Any]:
        """Drop a staged update."""
        updater = self._undertow_updater()
        updater.discard()
        return updater.info().model_dump()
