"""THE forward code path shared by the trainer and the serving engine (routing capture and replay).

Contract (the serving layer and the trainer both call these; nothing else computes logprobs):

- :func:`score_tokens` ``(model, token_ids, *, prompt_len, routed_experts=None) -> ScoreOutput``:
  one full-sequence forward pass, batch of one, float32. ``ScoreOutput.logprobs[i]`` is
  ``log p(token_ids[prompt_len + i] | token_ids[:prompt_len + i])`` (raw: before temperature or
  top-p, like vLLM's default ``logprobs_mode``), a float32 array of ``len(token_ids) - prompt_len``.
  ``ScoreOutput.routed_experts`` is the int32 array ``[len(token_ids) - 1, layers, top_k]`` of the
  experts each token was routed to in each MoE layer (vLLM's ``--enable-return-routed-experts``
  format: every token but the last, prompt included). When ``routed_experts`` is passed, the
  forward uses exactly those experts (routing replay): each layer's router still computes its
  softmax, but gathers the given experts' probabilities instead of taking its own top-k, so
  gradients reach the router and the experts the rollout actually used.
- :func:`forward_tokens`: the same pass with autograd (the trainer's entry point); under
  ``torch.no_grad`` it produces bit-identical numbers to :func:`score_tokens` on CPU.
- :func:`forward_routed`: a bare forward (any batch, positions and mask) with per-token replay, for
  the packed trainer path (:mod:`policy.packing`); to float rounding, not bit for bit.
- :func:`generate` ``(model, prompt_ids, *, max_tokens, temperature, top_p, seed, n,
  stop_token_ids) -> list[Generation]``: samples ``n`` continuations with a KV cache, then
  re-scores each final sequence with :func:`score_tokens`, so the returned ``logprobs`` and
  ``routed_experts`` are exactly what the trainer recomputes (bit for bit on CPU). The sampler
  itself sees the incremental-decode logits, which differ from the full pass in the last bits
  (batch and prefix non-invariance); that is the sampling distribution, not the reported one.

Why batch of one: on CPU the same sequence's logprobs differ in the last bits between batch
shapes and between a prefix pass and the full pass. Identical shapes give identical bits.

Routing capture/replay works on any transformers MoE whose router is a ``*TopKRouter`` module
returning ``(logits, weights, indices)`` (Qwen3-MoE, Mixtral, ...). The router's ``forward`` is
replaced once per model by :func:`install_routing`; per-thread state makes concurrent calls safe.
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

_STATE = threading.local()


@dataclass
class SampledToken:
    """One token as the sampler drew it (streaming): its row, id, raw logprob and the top ones."""

    row: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


TokenSink = Callable[[list[SampledToken]], bool]
"""Streaming callback: one step's sampled tokens; returning False stops sampling."""


@dataclass
class ScoreOutput:
    """Logprobs of ``token_ids[prompt_len:]`` and the experts every token but the last used."""

    logprobs: np.ndarray
    """float32 ``[len(token_ids) - prompt_len]``: raw log-probabilities of the scored tokens."""
    routed_experts: np.ndarray
    """int32 ``[len(token_ids) - 1, layers, top_k]`` (vLLM's format)."""


@dataclass
class ForwardOutput:
    """Autograd tensors of one scored sequence (trainer side)."""

    logprobs: torch.Tensor
    """float32 ``[T - prompt_len]`` log-probabilities of the scored tokens."""
    entropy: torch.Tensor
    """float32 ``[T - prompt_len]`` entropy of the predictive distribution at each scored position."""
    router_logits: list[torch.Tensor]
    """Per MoE layer, ``[T, num_experts]`` router logits (for the load-balancing loss)."""
    routed_experts: torch.Tensor
    """int64 ``[T - 1, layers, top_k]``: experts used (the replayed ones under replay)."""


@dataclass
class Generation:
    """One sampled continuation, scored by :func:`score_tokens` on the final sequence."""

    token_ids: list[int]
    """Generated token ids (stop token included when one ended the sequence)."""
    logprobs: list[float]
    """Raw logprob of each generated token (float32 values as Python floats)."""
    routed_experts: np.ndarray
    """int32 ``[prompt_len + len(token_ids) - 1, layers, top_k]`` over prompt and generated tokens."""
    finish_reason: str
    """``"stop"`` (a stop token was sampled) or ``"length"`` (``max_tokens`` reached)."""


@dataclass
class _Routing:
    replay: torch.Tensor | None
    natural: torch.Tensor | None = None
    """With ``replay``: bool per flattened token, True where the router takes its own top-k instead
    (packed rows, see :func:`forward_routed`); None keeps the prefix convention of :func:`forward_tokens`."""
    logits: list[torch.Tensor] = field(default_factory=list)
    indices: list[torch.Tensor] = field(default_factory=list)


def _router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Drop-in for transformers' ``*TopKRouter.forward`` with capture and replay."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    state: _Routing | None = getattr(_STATE, "routing", None)
    replay = None if state is None or state.replay is None else state.replay[:, self._undertow_layer, :]
    if replay is None:
        top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
    elif state is not None and state.natural is not None:
        own = torch.topk(router_probs, self.top_k, dim=-1).indices
        top_index = torch.where(state.natural[:, None], own, replay)
        top_value = router_probs.gather(1, top_index)
    else:
        natural = torch.topk(router_probs[replay.shape[0] :], self.top_k, dim=-1).indices
        top_index = torch.cat([replay, natural], dim=0)
        top_value = router_probs.gather(1, top_index)
    if getattr(self, "norm_topk_prob", True):
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    top_value = top_value.to(router_logits.dtype)
    if state is not None:
        state.logits.append(router_logits)
        state.indices.append(top_index)
    return router_logits, top_value, top_index


def routers(model: torch.nn.Module) -> list[Any]:
    """The MoE router modules of ``model`` in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def install_routing(model: torch.nn.Module) -> int:
    """Make every router of ``model`` capture/replay-aware (idempotent); returns the MoE layer count."""
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no *TopKRouter modules; routing replay needs a transformers MoE")
    for layer, router in enumerate(found):
        if getattr(router, "_undertow_layer", None) is None:
            router._undertow_layer = layer
            router.forward = types.MethodType(_router_forward, router)
    return len(found)


def forward_tokens(
    model: PreTrainedModel,
    token_ids: Sequence[int] | torch.Tensor,
    *,
    prompt_len: int,
    routed_experts: np.ndarray | torch.Tensor | None = None,
) -> ForwardOutput:
    """One full-sequence pass (batch of one) with autograd; see the module docstring."""
    device = next(iter(model.parameters())).device
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1).to(device)
    total = ids.shape[1]
    if not 1 <= prompt_len <= total:
        raise ValueError(f"prompt_len {prompt_len} must be in [1, {total}] (the first token is never scored)")
    layers = install_routing(model)
    replay = None
    if routed_experts is not None:
        replay = torch.as_tensor(np.asarray(routed_experts), dtype=torch.int64)
        top_k = routers(model)[0].top_k
        if replay.ndim != 3 or replay.shape[1:] != (layers, top_k) or replay.shape[0] > total:
            raise ValueError(
                f"routed_experts shape {tuple(replay.shape)} does not fit this model: expected "
                f"[<= {total}, {layers}, {top_k}]"
            )
        num_experts = routers(model)[0].num_experts
        if replay.numel() and (int(replay.min()) < 0 or int(replay.max()) >= num_experts):
            raise ValueError(f"routed_experts holds expert ids outside [0, {num_experts})")
        replay = replay.to(device)
    state = _Routing(replay=replay)
    _STATE.routing = state
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        _STATE.routing = None
    log_probs = torch.log_softmax(logits[prompt_len - 1 : total - 1], dim=-1)
    targets = ids[0, prompt_len:]
    token_logprobs = log_probs.gather(1, targets[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    experts = torch.stack(state.indices, dim=1)[: total - 1]
    return ForwardOutput(token_logprobs, entropy, state.logits, experts)


def forward_routed(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
    natural: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One forward of ``input_ids`` ``[B, L]`` with routing capture and per-token replay (autograd on).

    ``replay`` is int64 ``[B * L, layers, top_k]`` over the flattened tokens; where ``natural``
    (bool ``[B * L]``) is True the router takes its own top-k and that row of ``replay`` is
    ignored. Returns float32 logits ``[B, L, vocab]``, the router logits of each MoE layer
    ``[B * L, num_experts]`` and the experts used ``[B * L, layers, top_k]``. The packed trainer
    path (:mod:`policy.packing`) builds ``position_ids`` and the block-diagonal ``attention_mask``.
    """
    install_routing(model)
    if replay is not None and natural is None:
        natural = torch.zeros(replay.shape[0], dtype=torch.bool, device=replay.device)
    state = _Routing(replay=replay, natural=natural)
    _STATE.routing = state
    try:
        logits = model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        ).logits.float()
    finally:
        _STATE.routing = None
    return logits, state.logits, torch.stack(state.indices, dim=1)


def score_tokens(
    model: PreTrainedModel,
    token_ids: Sequence[int],
    *,
    prompt_len: int,
    routed_experts: np.ndarray | None = None,
) -> ScoreOutput:
    """Raw float32 logprobs of ``token_ids[prompt_len:]`` and the routed experts (no autograd)."""
    with torch.no_grad():
        out = forward_tokens(model, token_ids, prompt_len=prompt_len, routed_experts=routed_experts)
    return ScoreOutput(
        logprobs=out.logprobs.cpu().numpy().astype(np.float32),
        routed_experts=out.routed_experts.cpu().numpy().astype(np.int32),
    )


def _cache_kwarg(model: PreTrainedModel) -> str:
    """``cache`` on transformers releases that renamed ``past_key_values``, else the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Sample one token per row from ``logits`` with temperature and nucleus (top-p) filtering."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def sample_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    on_tokens: TokenSink | None = None,
    top_logprobs: int = 0,
) -> list[tuple[list[int], str]]:
    """Sample one continuation per prompt (left-padded batch, KV cache); no scoring.

    Returns ``(token_ids, finish_reason)`` per prompt. The sampler's logits come from a padded
    incremental pass; use :func:`score_tokens` for the logprobs anything else consumes.

    ``on_tokens`` (streaming) receives each step's new tokens with their raw logprob under the
    sampler's pass (and the ``top_logprobs`` most likely tokens); when it returns False, sampling
    stops and the rows still running finish with ``abort``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. the EOS/BOS id)")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (got {max_tokens})")
    if not 0.0 < top_p <= 1.0 or temperature < 0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
    longest = max(len(p) for p in prompts)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest + max_tokens > limit:
        raise ValueError(f"prompt ({longest}) + max_tokens ({max_tokens}) exceeds the context window ({limit})")
    gen = torch.Generator().manual_seed(int(seed) if seed is not None else int(torch.seed() % 2**63))
    stops = {int(s) for s in stop_token_ids}
    n = len(prompts)
    outputs: list[list[int]] = [[] for _ in range(n)]
    finish = ["length"] * n
    if max_tokens == 0:
        return list(zip(outputs, finish, strict=True))
    install_routing(model)
    device = next(iter(model.parameters())).device
    ids = torch.full((n, longest), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((n, longest), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor([int(t) for t in p])
        mask[i, longest - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)  # the model's device; sampling itself runs on the CPU
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    alive = [True] * n
    with torch.no_grad():
        kv: dict[str, Any] = {_cache_kwarg(model): DynamicCache(), "use_cache": True}
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **kv).logits[:, -1].cpu()
        for step in range(max_tokens):
            nxt = _sample(logits, temperature, top_p, gen)
            emitted: list[SampledToken] = []
            raw = torch.log_softmax(logits.float(), dim=-1) if on_tokens is not None else None
            for i in range(n):
                if alive[i]:
                    tok = int(nxt[i])
                    outputs[i].append(tok)
                    if raw is not None:
                        emitted.append(SampledToken(i, tok, float(raw[i, tok]), _top(raw[i], top_logprobs)))
                    if tok in stops:
                        alive[i] = False
                        finish[i] = "stop"
            if on_tokens is not None and not on_tokens(emitted):
                finish = ["abort" if alive[i] else finish[i] for i in range(n)]
                break
            if not any(alive) or step == max_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.int64, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            step_ids = nxt[:, None].to(device)
            logits = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, **kv).logits[:, -1].cpu()
    return list(zip(outputs, finish, strict=True))


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = logprobs.topk(k)
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def top_logprobs(
    model: PreTrainedModel, token_ids: Sequence[int], *, prompt_len: int, k: int
) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely tokens and their raw logprobs at each completion position (one full pass,
    the shape :func:`score_tokens` uses)."""
    if k <= 0 or len(token_ids) <= prompt_len:
        return [[] for _ in range(max(len(token_ids) - prompt_len, 0))]
    install_routing(model)
    with torch.no_grad():
        ids = torch.tensor([[int(t) for t in token_ids]], dtype=torch.int64)
        logits = model(input_ids=ids).logits[0, prompt_len - 1 : len(token_ids) - 1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [_top(row, k) for row in logprobs]


def generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    n: int = 1,
    stop_token_ids: Sequence[int] = (),
    on_tokens: TokenSink | None = None,
    top_k_stream: int = 0,
) -> list[Generation]:
    """Sample ``n`` continuations of ``prompt_ids``; logprobs and experts come from :func:`score_tokens`.

    ``on_tokens`` streams tokens as they are sampled (see :func:`sample_batch`); an aborted
    generation is returned as far as it went, scored the same way.
    """
    prompt = [int(t) for t in prompt_ids]
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    sampled = sample_batch(
        model,
        [prompt] * n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_token_ids,
        on_tokens=on_tokens,
        top_logprobs=top_k_stream,
    )
    results = []
    for tokens, reason in sampled:
        scored = score_tokens(model, prompt + tokens, prompt_len=len(prompt))
        results.append(
            Generation(
                token_ids=tokens,
                logprobs=[float(x) for x in scored.logprobs],
                routed_experts=scored.routed_experts,
                finish_reason=reason,
            )
        )
    return results
