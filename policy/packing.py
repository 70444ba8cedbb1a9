"""Sequence packing for the trainer: several rollouts in one forward, each blind to the others.

- :func:`pack_sequences` ``(lengths, pack_tokens) -> list[PackedRow]``: first-fit decreasing
  over sequence lengths; every sequence lands in exactly one row, and no row holds more than
  ``pack_tokens`` tokens unless a single sequence is longer (it then gets a row of its own).
  Deterministic: ties break by index, so every rank computes the same rows.
- :func:`forward_packed_rows`: several such rows in one forward, a batch ``[rows, L]`` (shorter
  rows padded; a pad attends only to itself and reaches no output), so one forward covers a whole
  step's rollouts and the per-forward overhead (the MoE dispatch of every layer, kernel launches)
  is paid once.
- :func:`forward_packed` ``(model, sequences, prompt_lens, routed_experts=None) -> list[ForwardOutput]``:
  one forward of the sequences laid end to end in a row of batch one, with positions that restart
  at 0 for each sequence and a block-diagonal causal mask (a 4D additive float mask, which
  transformers passes through as it is to the eager and sdpa attention). Each sequence's outputs
  are unpacked into the :class:`policy.forward.ForwardOutput` that
  :func:`policy.forward.forward_tokens` returns for it alone, equal to float rounding (about
  1e-7 in float32 on CPU: the matrix shapes differ, so the last bits may). Routing replay places
  each sequence's served experts at its own tokens; tokens without a served entry (the last one of
  each sequence, as in the one-at-a-time prefix convention) are routed by the router itself.

The MoE experts and the norms act per token, so the only coupling inside a row is attention,
which the mask cuts. Tensors are made on the model's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from policy.forward import ForwardOutput, forward_routed, install_routing, routers


@dataclass(frozen=True)
class PackedRow:
    """One forward's worth of sequences: their indices in the input and their lengths, in row order."""

    members: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Tokens in the row."""
        return sum(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each member starts in the row."""
        return tuple(int(x) for x in np.cumsum((0, *self.lengths[:-1])))


def pack_sequences(lengths: Sequence[int], pack_tokens: int) -> list[PackedRow]:
    """First-fit decreasing: rows of at most ``pack_tokens`` tokens (an over-long sequence alone)."""
    if pack_tokens < 1:
        raise ValueError(f"pack_tokens must be >= 1 (got {pack_tokens})")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs at least one token")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        slot = next((r for r, room in enumerate(free) if room >= n), None)
        if slot is None:
            rows.append([i])
            free.append(pack_tokens - n)
        else:
            rows[slot].append(i)
            free[slot] -= n
    return [PackedRow(tuple(r), tuple(int(lengths[i]) for i in r)) for r in rows]


def packed_positions(lengths: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """int64 ``[1, sum(lengths)]``: 0, 1, ... restarting at each sequence."""
    return torch.cat([torch.arange(int(n), device=device) for n in lengths]).reshape(1, -1)


def block_causal_mask(
    lengths: Sequence[int], dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """Additive ``[1, 1, L, L]`` mask: 0 where a token may attend (itself and earlier tokens of its
    own sequence), the dtype's most negative value elsewhere."""
    return segment_mask(_segments(lengths, sum(int(n) for n in lengths))[None], dtype, device)


def _segments(lengths: Sequence[int], width: int) -> torch.Tensor:
    """int64 ``[width]``: each token's sequence in its row, -1 for the padding after them."""
    seg = torch.full((width,), -1, dtype=torch.int64)
    total = sum(int(n) for n in lengths)
    seg[:total] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor([int(n) for n in lengths]))
    return seg


def segment_mask(segment: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Additive ``[rows, 1, L, L]`` mask from ``segment`` ``[rows, L]`` (:func:`_segments` per row): a
    token attends to itself and to earlier tokens of its own sequence; a pad (-1) only to itself."""
    segment = segment.to(device)
    width = segment.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    allowed = causal & (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    allowed |= torch.eye(width, dtype=torch.bool, device=device)
    mask = torch.zeros((segment.shape[0], 1, width, width), dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return mask


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _replay_rows(
    model: PreTrainedModel, lengths: Sequence[int], routed_experts: Sequence[np.ndarray | torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's replay tensor and its ``natural`` mask from each sequence's served experts."""
    layers = install_routing(model)
    first = routers(model)[0]
    top_k, num_experts = int(first.top_k), int(first.num_experts)
    total = sum(int(n) for n in lengths)
    replay = torch.zeros((total, layers, top_k), dtype=torch.int64)
    natural = torch.ones(total, dtype=torch.bool)
    start = 0
    for n, served in zip(lengths, routed_experts, strict=True):
        if served is not None:
            r = torch.as_tensor(np.asarray(served), dtype=torch.int64)
            if r.ndim != 3 or r.shape[1:] != (layers, top_k) or r.shape[0] > n:
                raise ValueError(
                    f"routed_experts shape {tuple(r.shape)} does not fit this model: "
                    f"expected [<= {n}, {layers}, {top_k}]"
                )
            if r.numel() and (int(r.min()) < 0 or int(r.max()) >= num_experts):
                raise ValueError(f"routed_experts holds expert ids outside [0, {num_experts})")
            replay[start : start + r.shape[0]] = r
            natural[start : start + r.shape[0]] = False
        start += int(n)
    device = model_device(model)
    return replay.to(device), natural.to(device)


def forward_packed(
    model: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    *,
    routed_experts: Sequence[np.ndarray | torch.Tensor | None] | None = None,
) -> list[ForwardOutput]:
    """One forward of ``sequences`` packed in a row; per-sequence outputs as :func:`forward_tokens` gives."""
    if not sequences:
        return []
    return forward_packed_rows(model, [sequences], [prompt_lens], routed_experts=[routed_experts])[0]


def forward_packed_rows(
    model: PreTrainedModel,
    rows: Sequence[Sequence[Sequence[int]]],
    prompt_lens: Sequence[Sequence[int]],
    *,
    routed_experts: Sequence[Sequence[np.ndarray | torch.Tensor | None] | None] | None = None,
) -> list[list[ForwardOutput]]:
    """One forward of several packed rows as a batch ``[rows, L]``; per row, per sequence, the outputs
    :func:`forward_tokens` gives for that sequence alone (to float rounding).

    Rows shorter than the longest are padded at the end; a pad token attends only to itself and is
    routed by the router, and nothing of it reaches an output. Each row keeps its own positions and
    block-diagonal mask, so a row sees exactly what :func:`forward_packed` shows it."""
    if not rows:
        return []
    device = model_device(model)
    dtype = next(iter(model.parameters())).dtype
    lengths = [[len(s) for s in row] for row in rows]
    for row_lengths, row_prompts in zip(lengths, prompt_lens, strict=True):
        for n, p in zip(row_lengths, row_prompts, strict=True):
            if not 1 <= p <= n:
                raise ValueError(f"prompt_len {p} must be in [1, {n}] (the first token is never scored)")
    width = max(sum(row) for row in lengths)
    ids = torch.zeros((len(rows), width), dtype=torch.int64, device=device)
    positions = torch.zeros((len(rows), width), dtype=torch.int64, device=device)
    for b, (row, row_lengths) in enumerate(zip(rows, lengths, strict=True)):
        total = sum(row_lengths)
        ids[b, :total] = torch.tensor([int(t) for s in row for t in s], dtype=torch.int64, device=device)
        positions[b, :total] = packed_positions(row_lengths, device)[0]
    mask = segment_mask(torch.stack([_segments(row_lengths, width) for row_lengths in lengths]), dtype, device)
    replay = natural = None
    if routed_experts is not None and any(r is not None for r in routed_experts):
        layers = install_routing(model)
        top_k = int(routers(model)[0].top_k)
        replay = torch.zeros((len(rows) * width, layers, top_k), dtype=torch.int64, device=device)
        natural = torch.ones(len(rows) * width, dtype=torch.bool, device=device)
        for b, row_lengths in enumerate(lengths):
            served = routed_experts[b]
            if served is not None:
                total = sum(row_lengths)
                row_replay, row_natural = _replay_rows(model, row_lengths, served)
                replay[b * width : b * width + total] = row_replay
                natural[b * width : b * width + total] = row_natural
    logits, router_logits, experts = forward_routed(
        model, ids, position_ids=positions, attention_mask=mask, replay=replay, natural=natural
    )
    log_probs = torch.log_softmax(logits, dim=-1)
    # every position's next-token logprob and entropy at once, then sliced per sequence (one op
    # each for the whole batch instead of one per sequence, in the forward and in the backward)
    next_logprobs = log_probs[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
    entropy = -(log_probs[:, :-1].exp() * log_probs[:, :-1]).sum(-1)
    out: list[list[ForwardOutput]] = []
    for b, (row_lengths, row_prompts) in enumerate(zip(lengths, prompt_lens, strict=True)):
        outs = []
        start = 0
        for n, p in zip(row_lengths, row_prompts, strict=True):
            flat = b * width + start
            outs.append(
                ForwardOutput(
                    logprobs=next_logprobs[b, start + p - 1 : start + n - 1],
                    entropy=entropy[b, start + p - 1 : start + n - 1],
                    router_logits=[layer[flat : flat + n] for layer in router_logits],
                    routed_experts=experts[flat : flat + n - 1],
                )
            )
            start += n
        out.append(outs)
    return out
