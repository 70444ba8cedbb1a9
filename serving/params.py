"""Live tensors of a served model, addressed by checkpoint name: what weight updates read and write.

The weight store names tensors as the Hugging Face checkpoint does (what ``undertow weights put
CHECKPOINT_DIR`` stores, and what vLLM's ``load_weights`` takes): one tensor per expert
projection, ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``. transformers 5 fuses
the experts in memory instead: ``experts.gate_up_proj`` is ``[E, 2I, H]`` (gate rows first, then
up rows) and ``experts.down_proj`` is ``[E, H, I]``. :class:`ModelParams` maps every checkpoint
name to a view of the live parameter (the whole tensor, or one expert's slice of a fused one),
so an update writes in place and the model never reloads. The mapping is checked once at start
against the checkpoint file itself: every name maps to a view of the right shape holding the
checkpoint's values, else the engine refuses to start (a new fusion in transformers fails loudly
instead of serving mixed weights).

:class:`DictParams` is the same interface over a plain dict (the vLLM extension's host shadow).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

Tensors = dict[str, torch.Tensor]
Changes = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""name -> (flat positions, int64; the values to write there)."""


def scatter_into(tensor: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` at the flat ``positions`` of ``tensor`` in place (a contiguous tensor: only those elements)."""
    values = values.to(tensor.dtype)
    if tensor.is_contiguous():
        tensor.view(-1).index_copy_(0, positions.to(tensor.device), values.to(tensor.device))
    else:
        flat = tensor.reshape(-1).clone()
        flat.index_copy_(0, positions.to(flat.device), values.to(flat.device))
        tensor.copy_(flat.view(tensor.shape))


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class LiveParams(Protocol):
    """Named live tensors: the served weights."""

    def names(self) -> list[str]:
        """Every tensor name, in checkpoint naming."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """The live tensor (a view; its native dtype)."""
        ...

    def write(self, new: Tensors) -> None:
        """Make each named tensor hold the new values (cast to the native dtype), atomically for readers."""
        ...

    def scatter(self, changes: Changes) -> None:
        """Write only the given flat positions of each named tensor (values cast to the native dtype)."""
        ...


class DictParams:
    """A dict of tensors; ``on_write`` is told about each batch after the dict holds it."""

    def __init__(self, tensors: Tensors, on_write: Callable[[Tensors], None] | None = None) -> None:
        self.tensors = tensors
        self.on_write = on_write

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def write(self, new: Tensors) -> None:
        if self.on_write is not None:
            self.on_write(new)
        for name, value in new.items():
            current = self.tensors.get(name)
            if current is not None and current.shape == value.shape:
                current.copy_(value)
            else:
                self.tensors[name] = value.clone()

    def scatter(self, changes: Changes) -> None:
        for name, (positions, values) in changes.items():
            scatter_into(self.tensors[name], positions, values)
        if self.on_write is not None and changes:
            self.on_write({name: self.tensors[name] for name in changes})


def checkpoint_names(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in a checkpoint directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint}; the engine needs a safetensors checkpoint")
    out: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = tuple(handle.get_slice(name).get_shape())
    return out


def _view(state: Tensors, name: str) -> torch.Tensor | None:
    if name in state:
        return state[name]
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, proj = match["prefix"], int(match["e"]), match["proj"]
    if proj == "down_proj":
        fused = state.get(f"{prefix}.down_proj")
        return None if fused is None else fused[expert]
    fused = state.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]


class ModelParams:
    """A torch model's parameters under checkpoint names (see module docstring); writes hold ``lock``."""

    def __init__(self, model: torch.nn.Module, checkpoint: str | Path, lock: threading.Lock) -> None:
        from safetensors import safe_open

        state = dict(model.state_dict(keep_vars=False))
        self.lock = lock
        self.views: Tensors = {}
        unmapped = []
        for name, shape in checkpoint_names(checkpoint).items():
            view = _view(state, name)
            if view is None or tuple(view.shape) != shape:
                unmapped.append(name)
            else:
                self.views[name] = view
        if unmapped:
            raise ValueError(
                f"checkpoint tensors {unmapped[:3]} map to no parameter of the loaded model "
                f"({len(unmapped)} in all); this transformers version lays the model out differently"
            )
        covered = sum(v.numel() for v in self.views.values())
        total = sum(t.numel() for t in state.values())
        if covered != total:
            raise ValueError(f"checkpoint names cover {covered} of the model's {total} values; refusing to serve")
        for file in sorted(Path(checkpoint).glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    if not torch.equal(handle.get_tensor(name).to(self.views[name].dtype), self.views[name]):
                        raise ValueError(f"checkpoint tensor {name} does not match the loaded parameter it maps to")

    def names(self) -> list[str]:
        return list(self.views)

    def get(self, name: str) -> torch.Tensor:
        return self.views[name]

    def write(self, new: Tensors) -> None:
        with self.lock, torch.no_grad():
            for name, value in new.items():
                self.views[name].copy_(value)

    def scatter(self, changes: Changes) -> None:
        with self.lock, torch.no_grad():
            for name, (positions, values) in changes.items():
                scatter_into(self.views[name], positions, values)
