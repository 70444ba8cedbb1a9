"""The shared forward path: bit-identical serving and training logprobs, routing capture and replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from policy.forward import forward_tokens, generate, sample_batch, score_tokens
from policy.model import load_checkpoint, save_checkpoint


def test_generate_reports_exactly_what_the_trainer_recomputes(tiny) -> None:  # type: ignore[no-untyped-def]
    prompt = [0, 11, 12, 13]
    gens = generate(tiny, prompt, max_tokens=12, n=3, seed=7, temperature=1.0)
    assert len(gens) == 3
    for g in gens:
        assert g.finish_reason == "length" and len(g.token_ids) == 12
        assert g.routed_experts.shape == (len(prompt) + 12 - 1, 3, 2) and g.routed_experts.dtype == np.int32
        seq = prompt + g.token_ids
        scored = score_tokens(tiny, seq, prompt_len=len(prompt))
        assert scored.logprobs.dtype == np.float32
        assert np.array_equal(scored.logprobs, np.asarray(g.logprobs, dtype=np.float32))
        assert np.array_equal(scored.routed_experts, g.routed_experts)
        # the trainer's autograd path: same bits
        out = forward_tokens(tiny, seq, prompt_len=len(prompt), routed_experts=g.routed_experts)
        assert torch.equal(out.logprobs.detach(), torch.from_numpy(scored.logprobs))
        assert out.logprobs.requires_grad


def test_generate_is_seeded_and_stops(tiny) -> None:  # type: ignore[no-untyped-def]
    a = generate(tiny, [0, 5], max_tokens=10, n=2, seed=3)
    b = generate(tiny, [0, 5], max_tokens=10, n=2, seed=3)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    first = a[0].token_ids[0]
    stopped = generate(tiny, [0, 5], max_tokens=10, n=1, seed=3, stop_token_ids=[first])[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    greedy = generate(tiny, [0, 5], max_tokens=6, temperature=0.0)[0]
    assert greedy.token_ids == generate(tiny, [0, 5], max_tokens=6, temperature=0.0, seed=99)[0].token_ids


def test_replay_uses_the_given_experts(tiny) -> None:  # type: ignore[no-untyped-def]
    seq = list(range(3, 40))
    natural = score_tokens(tiny, seq, prompt_len=5)
    same = score_tokens(tiny, seq, prompt_len=5, routed_experts=natural.routed_experts)
    assert np.array_equal(same.logprobs, natural.logprobs)
    other = (natural.routed_experts + 1) % 8
    replayed = score_tokens(tiny, seq, prompt_len=5, routed_experts=other)
    assert np.array_equal(replayed.routed_experts, other)
    assert np.abs(replayed.logprobs - natural.logprobs).max() > 1e-4
    # a replay array shorter than the sequence replays its prefix and routes the rest naturally
    partial = score_tokens(tiny, seq, prompt_len=5, routed_experts=natural.routed_experts[:10])
    assert np.array_equal(partial.logprobs, natural.logprobs)


def test_replay_gradients_reach_the_router(tiny) -> None:  # type: ignore[no-untyped-def]
    seq = list(range(3, 30))
    experts = score_tokens(tiny, seq, prompt_len=3).routed_experts
    out = forward_tokens(tiny, seq, prompt_len=3, routed_experts=experts)
    out.logprobs.sum().backward()
    gate = tiny.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((5, 2, 2), dtype=np.int64),  # wrong layer count
        np.zeros((5, 3, 3), dtype=np.int64),  # wrong top_k
        np.full((5, 3, 2), 8, dtype=np.int64),  # expert id out of range
        np.full((5, 3, 2), -1, dtype=np.int64),
        np.zeros((500, 3, 2), dtype=np.int64),  # longer than the sequence
        np.zeros((5, 3), dtype=np.int64),
    ],
)
def test_hostile_routed_experts_are_rejected(tiny, bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        score_tokens(tiny, list(range(3, 20)), prompt_len=2, routed_experts=bad)


def test_bad_arguments_are_rejected(tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        score_tokens(tiny, [1, 2, 3], prompt_len=0)
    with pytest.raises(ValueError):
        score_tokens(tiny, [1, 2, 3], prompt_len=4)
    with pytest.raises(ValueError):
        generate(tiny, [], max_tokens=3)
    with pytest.raises(ValueError):
        generate(tiny, [0], max_tokens=tiny.config.max_position_embeddings)  # beyond the context window
    with pytest.raises(ValueError):
        generate(tiny, [0], max_tokens=3, top_p=0.0)
    with pytest.raises(ValueError):
        generate(tiny, [0], max_tokens=3, n=0)


def test_left_padded_batch_matches_single_prompt_greedy(tiny) -> None:  # type: ignore[no-untyped-def]
    batch = sample_batch(tiny, [[0, 5, 6, 7, 8], [0, 9]], max_tokens=8, temperature=0.0)
    solo = sample_batch(tiny, [[0, 9]], max_tokens=8, temperature=0.0)
    assert batch[1][0] == solo[0][0]


def test_checkpoint_round_trip_and_mixtral_style(tiny, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = save_checkpoint(tiny, tokenizer, tmp_path / "v0")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    loaded, tok = load_checkpoint(path)
    seq = list(range(3, 25))
    assert np.array_equal(
        score_tokens(loaded, seq, prompt_len=4).logprobs, score_tokens(tiny, seq, prompt_len=4).logprobs
    )
    assert tok.encode("def f(x):") == tokenizer.encode("def f(x):")
    assert type(AutoModelForCausalLM.from_pretrained(path)).__name__ == "Qwen3MoeForCausalLM"
    # a Mixtral-style MoE directory loads and replays too
    cfg = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    save_checkpoint(MixtralForCausalLM(cfg), tokenizer, tmp_path / "mixtral")
    mixtral, _ = load_checkpoint(tmp_path / "mixtral")
    scored = score_tokens(mixtral, seq, prompt_len=4)
    assert scored.routed_experts.shape == (len(seq) - 1, 2, 2)
    replayed = score_tokens(mixtral, seq, prompt_len=4, routed_experts=scored.routed_experts)
    assert np.array_equal(replayed.logprobs, scored.logprobs)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing")
