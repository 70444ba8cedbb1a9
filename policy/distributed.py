"""Several training processes: process group, FSDP sharding of the MoE policy, full state dicts.

The trainer runs unchanged in one process; under ``torchrun`` (``WORLD_SIZE`` > 1) these helpers
make N processes compute the update one process would:

- :func:`train_device` picks where the trainer runs: ``cuda:<LOCAL_RANK>`` when CUDA is present
  (one GPU per process, as ``torchrun`` starts them), else the CPU; :func:`init_from_env` joins the
  process group ``torchrun`` describes with the backend for that device (NCCL on GPUs, gloo on
  CPUs, :func:`backend_for`) and returns ``(rank, world)``.
- :func:`shard` applies FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) per decoder layer and
  at the root: parameters, gradients and optimizer state are split across ranks (each holds
  ``1/world`` of every tensor, as a ``DTensor``), whole layers are all-gathered for the forward
  and backward and gradients reduce-scattered. Gradients are *summed* across ranks (the divide
  factor is 1): the trainer normalises its loss by the global token count, so the sum is the
  one-process gradient. Sums only (no pre-multiplied reductions), so gloo can run it.
- ``parallel = "ddp"`` keeps a full replica per rank instead and all-reduces gradients
  (:func:`all_reduce_grads`): less communication per forward, N times the memory.
- :func:`model_and_optim_state` / :func:`load_model_and_optim_state`: full (unsharded) state
  dicts keyed by parameter name (collective under FSDP), the same format in one process and in
  N, so a run saved with one world size resumes with another.
- :func:`unsharded_copy` gathers the weights into a plain model on rank 0 only (sampling,
  evaluation and Hugging Face checkpoints need whole tensors and no collectives); other ranks
  get ``None`` and must not write.

Routing replay needs nothing here: :mod:`policy.forward` patches each router's ``forward``
before sharding touches parameters, and FSDP2 swaps in unsharded tensors for the forward, so the
patched router sees plain weights on every rank.
"""

from __future__ import annotations

import gc
import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Whole tensors on CPU (on rank 0 only when the model is sharded)."""


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (``(0, 1)`` outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on rank 0 (the only rank that writes checkpoints, rows and stdout)."""
    return world()[0] == 0


def train_device(requested: str = "auto") -> torch.device:
    """The trainer's device: ``auto`` takes ``cuda:<LOCAL_RANK>`` when CUDA is available and the CPU
    otherwise; ``cuda`` insists (an error without a GPU); ``cpu`` stays on the CPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda (got {requested!r})")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device cuda was asked for, but torch sees no CUDA device; use auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def backend_for(device: torch.device) -> str:
    """The collective backend for ``device``: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(device: torch.device | None = None) -> tuple[int, int]:
    """Join the process group ``torchrun`` set up in the environment, with the backend for ``device``
    (default :func:`train_device`); ``(0, 1)`` without one."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return world()
    if not dist.is_initialized():
        device = device or train_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device))
    return world()


M = TypeVar("M", bound=torch.nn.Module)


def place(model: M, device: torch.device) -> M:
    """``model`` moved (in place) to ``device``; returned for chaining."""
    torch.nn.Module.to(model, device)
    return model


def on_cpu(model: M) -> M:
    """``model`` itself when its weights are on the CPU, else a float32 copy there (evaluation and
    checkpoints run on the CPU whatever device trained)."""
    if all(p.device.type == "cpu" for p in model.parameters()):
        return model
    import copy

    return copy.deepcopy(model).to("cpu").float().eval()


def shutdown() -> None:
    """Leave the process group (no-op outside one).

    Every rank waits for the others first and drops its finished collective handles: a rank
    that tears down gloo while a peer is still working, or with handles still alive, can abort
    at exit (``terminate called without an active exception``)."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if world()[1] > 1:
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; for small things like a rollout batch)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is FSDP-sharded (its parameters are ``DTensor`` shards)."""
    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to shard")
    return list(layers)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 per decoder layer plus the root (in place); gradients are summed across ranks."""
    from policy.forward import install_routing

    install_routing(model)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Under FSDP, reduce-scatter gradients at the next backward (else accumulate them locally)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the ranks (the ``ddp`` path; missing grads count as 0)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def to_float(value: torch.Tensor | float) -> float:
    """A Python float of a scalar tensor or replicated ``DTensor``."""
    if isinstance(value, torch.Tensor):
        full = getattr(value, "full_tensor", None)
        return float(full() if full is not None else value)
    return float(value)


def model_and_optim_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full model and optimizer state dicts keyed by parameter name (collective when sharded)."""
    return get_state_dict(model, optimizer, options=FULL)


def load_model_and_optim_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Restore :func:`model_and_optim_state` output into a (sharded or plain) model and optimizer."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )


def _plain_class(model: torch.nn.Module) -> type[torch.nn.Module]:
    """The model's own class (FSDP2 puts a generated ``FSDP<Name>`` subclass in front of it)."""
    return next(c for c in type(model).__mro__ if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule))


def unsharded_copy(model: torch.nn.Module, into: torch.nn.Module | None = None) -> Any:
    """The whole model as a plain module on rank 0 (``into`` is refreshed when given), ``None`` elsewhere.

    Collective when ``model`` is sharded: every rank must call it. Unsharded models come back as
    they are (rank 0) so callers need no second code path.
    """
    if not is_sharded(model):
        return model if is_main() else None
    state = get_model_state_dict(model, options=FULL)
    if not is_main():
        return None
    if into is None:
        fork_devices: list[int] = []
        with torch.random.fork_rng(devices=fork_devices):
            into = _plain_class(model)(model.config)  # type: ignore[call-arg]
    into.load_state_dict(state)
    return into.float().eval()
