"""The CPU engine's model runner: one checkpoint, the trainer's forward code, and weights that can
be swapped in place.

Generation goes through :func:`policy.forward.generate`, the same code path the trainer scores
with, one sequence at a time (identical shapes), so the logprobs and routed experts this engine
returns are the ones the trainer reproduces. Stop strings are applied after generation by
truncating at the first token whose text completes a stop string (token ids, logprobs and
routed-expert rows are cut together).

Requests run one at a time under a lock: CPU inference of a tiny model gains nothing from
interleaving, and a single stream keeps results batch-invariant.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policy.forward import TokenSink
from serving.protocol import SamplingParams


@dataclass
class Sample:
    """One generated sample, before it is shaped into the HTTP answer."""

    token_ids: list[int]
    logprobs: list[float]
    routed_experts: np.ndarray | None
    """``[prompt_len + len(token_ids) - 1, layers, top_k]`` int array, or None."""
    finish_reason: str
    stop_reason: str | int | None
    text: str


class ModelRunner:
    """Holds the model and tokenizer; generates under a lock; exposes the named tensors for updates."""

    def __init__(self, checkpoint: str | Path, *, threads: int = 1) -> None:
        from policy.model import load_checkpoint

        torch.set_num_threads(threads)
        self.checkpoint = Path(checkpoint)
        self.model, self.tokenizer = load_checkpoint(self.checkpoint)
        self.lock = threading.Lock()
        self.eos_id = self.tokenizer.eos_token_id

    @property
    def context_limit(self) -> int | None:
        """The model's own context window (``max_position_embeddings``), if it declares one."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        return int(limit) if limit else None

    def state(self) -> dict[str, torch.Tensor]:
        """The model's named tensors (the objects updates write into, in place)."""
        return dict(self.model.state_dict(keep_vars=False))

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids; token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False)) or [int(self.eos_id)]
        vocab = int(self.model.config.vocab_size)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return list(prompt)

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """Token ids that end a sample: the request's, EOS, and the end of a chat turn."""
        stop_ids = list(params.stop_token_ids)
        for special in (self.eos_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>")):
            usable = isinstance(special, int) and special >= 0 and special not in stop_ids
            if usable and isinstance(special, int) and special != getattr(self.tokenizer, "unk_token_id", None):
                stop_ids.append(special)
        return stop_ids

    def generate(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        *,
        routed: bool,
        on_tokens: TokenSink | None = None,
        top_k_stream: int = 0,
    ) -> list[Sample]:
        """Generate ``params.n`` samples for ``prompt_ids`` with the trainer's forward code.

        ``on_tokens`` streams each step's tokens as they are sampled and can stop generation (a
        client that went away); the samples returned are then cut where sampling stopped.
        """
        from policy.forward import generate

        with self.lock, torch.inference_mode():
            gens = generate(
                self.model,
                prompt_ids,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                n=params.n,
                stop_token_ids=self.stop_ids(params),
                on_tokens=on_tokens,
                top_k_stream=top_k_stream,
            )
        return [self._finish(g, len(prompt_ids), params.stop, routed) for g in gens]

    def top_logprobs(self, prompt_ids: list[int], token_ids: list[int], k: int) -> list[list[tuple[int, float]]]:
        """The ``k`` most likely tokens at each generated position (the re-scoring pass)."""
        from policy.forward import top_logprobs

        with self.lock, torch.inference_mode():
            return top_logprobs(self.model, prompt_ids + token_ids, prompt_len=len(prompt_ids), k=k)

    def choose(self, prompt_ids: list[int], options: list[list[int]], *, temperature: float, seed: int | None) -> int:
        """Draw one of ``options`` (token sequences continuing ``prompt_ids``) by the model's
        probability of each, at ``temperature`` (0: the most likely)."""
        from policy.forward import score_tokens

        with self.lock, torch.inference_mode():
            scores = torch.tensor(
                [
                    float(score_tokens(self.model, prompt_ids + o, prompt_len=len(prompt_ids)).logprobs.sum())
                    for o in options
                ]
            )
        if temperature <= 0 or len(options) == 1:
            return int(scores.argmax())
        gen = torch.Generator().manual_seed(int(seed) if seed is not None else int(torch.seed() % 2**63))
        return int(torch.multinomial(torch.softmax(scores / temperature, dim=0), 1, generator=gen))

    def _finish(self, gen: Any, prompt_len: int, stops: list[str], routed: bool) -> Sample:
        token_ids = [int(t) for t in gen.token_ids]
        logprobs = [float(x) for x in np.asarray(gen.logprobs, dtype=np.float64).tolist()]
        experts = _as_array(gen.routed_experts) if routed else None
        finish = str(gen.finish_reason)
        stop_reason: str | int | None = None
        stop: str
        if finish == "stop" and token_ids:
            stop_reason = token_ids[-1]
        text = str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
        if stops:
            cut = _stop_cut(self.tokenizer, token_ids, stops)
            if cut is not None:
                keep, stop = cut
                token_ids, logprobs = token_ids[:keep], logprobs[:keep]
                finish, stop_reason = "stop", stop
                text = str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
                text = text[: text.find(stop)] if stop in text else text
        if experts is not None:
            experts = experts[: prompt_len + len(token_ids) - 1]
        return Sample(token_ids, logprobs, experts, finish, stop_reason, text)


def _as_array(value: Any) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _stop_cut(tokenizer: Any, token_ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """The number of tokens to keep (up to and including the one completing a stop string) and the stop."""
    for i in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        for stop in stops:
            if stop and stop in text:
                return i, stop
    return None
