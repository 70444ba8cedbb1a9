"""RL trainer throughput, routing-replay overhead and train/serve logprob gaps, held-out gain per minute.

Measured on the ``tiny`` Qwen3-MoE preset, side by side with its baselines, in one run:

- ``moe_tokens_per_s``: RL update throughput (forward + backward + AdamW step, batch of one per
  sequence, the exact path) over prompt+completion tokens of a batch of scored rollouts;
- ``dense_tokens_per_s``: the same update for a dense Qwen3 with equal *active* parameters
  (same attention, a dense MLP of ``top_k * moe_intermediate_size``);
- ``replay_overhead``: update time with routing replay over without, minus 1 (target < 5%);
- ``logprob_gap_replay``: max |served - trainer| logprob with replay on the shared forward path
  (target exactly 0 on CPU);
- ``logprob_gap_no_replay``: the same against a throughput-style trainer forward (padded batch of
  8, no replay): batch non-invariance plus any routing flips it causes;
- ``heldout_gain_per_min``: held-out pass-and-keep gain of offline RL from v0 per minute of RL.
  v0 is the checkpoint ``<home>/policy/v0000`` when one exists (``undertow policy warmup``),
  else a short warm-up run here (``v0_source`` says which; its time is not counted).

Figures measured on a shared, busy 2-core machine are noisy; rerun on a quiet one.
Run: ``python benchmarks/train.py --json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen3Config, Qwen3ForCausalLM

from policy.evaluate import EvalConfig, evaluate
from policy.forward import forward_tokens, generate
from policy.model import PRESETS, active_parameters, build_model, load_checkpoint, num_parameters
from policy.rollouts import Rollout
from policy.sft import SFTConfig, prompt_ids, warmup
from policy.tasks import train_tasks
from policy.tokenizer import default_tokenizer
from policy.trainer import TrainConfig, make_optimizer, train_offline, update_step


def scored_batch(model, tokenizer, n: int, max_tokens: int) -> list[Rollout]:  # type: ignore[no-untyped-def]
    """``n`` generated and scored rollouts on training tasks, rewards alternating 1/0."""
    out = []
    for i, task in enumerate(train_tasks()[:n]):
        prompt = prompt_ids(tokenizer, task)
        g = generate(model, prompt, max_tokens=max_tokens, seed=i)[0]
        out.append(
            Rollout(
                prompt_ids=prompt,
                completion_ids=g.token_ids,
                reward=float(i % 2),
                served_logprobs=np.asarray(g.logprobs, dtype=np.float64),
                routed_experts=g.routed_experts,
                group_id="g",
                policy_version=0,
            )
        )
    return out


def time_updates(model, batch: list[Rollout], cfg: TrainConfig, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of one update step over ``repeats`` runs."""
    opt = make_optimizer(model, cfg)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        update_step(model, opt, batch, cfg)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def dense_twin(vocab: int) -> Qwen3ForCausalLM:
    """A dense Qwen3 with the tiny preset's attention and an MLP as wide as its active experts."""
    p = PRESETS["tiny"]
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=p["hidden_size"], num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"], intermediate_size=p["num_experts_per_tok"] * p["moe_intermediate_size"],
        max_position_embeddings=p["max_position_embeddings"], tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


def time_dense(model, batch: list[Rollout], repeats: int) -> float:  # type: ignore[no-untyped-def]
    """The same per-sequence policy-gradient update on a dense model (no routing)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    norm = sum(len(r.completion_ids) for r in batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.zero_grad()
        for r in batch:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].float(), -1)
            tok = logp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            (-(r.reward - 0.5) * tok.sum() / norm).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def batched_gap(model, batch: list[Rollout]) -> float:  # type: ignore[no-untyped-def]
    """Max |served - padded-batch forward| logprob without replay."""
    seqs = [r.prompt_ids + r.completion_ids for r in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), 1, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    gap = 0.0
    for i, r in enumerate(batch):
        p = len(r.prompt_ids)
        lp = torch.log_softmax(logits[i, p - 1 : len(seqs[i]) - 1], -1)
        tok = lp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0].numpy()
        gap = max(gap, float(np.abs(tok - r.served_logprobs.astype(np.float32)).max()))  # type: ignore[union-attr]
    return gap


def replay_gap(model, batch: list[Rollout]) -> float:  # type: ignore[no-untyped-def]
    """Max |served - trainer forward with replay| logprob (shared path)."""
    gap = 0.0
    with torch.no_grad():
        for r in batch:
            out = forward_tokens(model, r.prompt_ids + r.completion_ids, prompt_len=len(r.prompt_ids),
                                 routed_experts=r.routed_experts)  # fmt: skip
            gap = max(gap, float(np.abs(out.logprobs.numpy() - r.served_logprobs.astype(np.float32)).max()))  # type: ignore[union-attr]
    return gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--home", default=".undertow", help="Undertow home holding policy/v0000")
    parser.add_argument("--rl-steps", type=int, default=4, help="offline RL steps for the held-out gain")
    parser.add_argument("--sft-steps", type=int, default=400, help="warm-up steps when no v0 exists")
    parser.add_argument("--per-tier", type=int, default=16, help="held-out tasks per tier in the evaluation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = default_tokenizer()
    model = build_model("tiny", len(tokenizer), seed=0)
    batch = scored_batch(model, tokenizer, n=8, max_tokens=40)
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in batch)
    base = TrainConfig(replay=False, lr=1e-4)
    t_plain = time_updates(model, batch, base, repeats=3)
    t_replay = time_updates(model, batch, TrainConfig(replay=True, lr=1e-4), repeats=3)
    dense = dense_twin(len(tokenizer))
    t_dense = time_dense(dense, batch, repeats=3)
    fresh = build_model("tiny", len(tokenizer), seed=0)
    served = scored_batch(fresh, tokenizer, n=8, max_tokens=40)
    result: dict[str, object] = {
        "moe_tokens_per_s": tokens / t_plain,
        "dense_tokens_per_s": tokens / t_dense,
        "replay_overhead": t_replay / t_plain - 1,
        "logprob_gap_replay": replay_gap(fresh, served),
        "logprob_gap_no_replay": batched_gap(fresh, served),
        "moe_params": num_parameters(fresh),
        "moe_active_params": active_parameters(fresh),
        "dense_params": num_parameters(dense),
    }
    v0_dir = Path(args.home) / "policy" / "v0000"
    if (v0_dir / "config.json").exists():
        policy, tok = load_checkpoint(v0_dir)
        result["v0_source"] = str(v0_dir)
    else:
        policy, tok, _ = warmup(SFTConfig(steps=args.sft_steps))
        result["v0_source"] = f"warm-up here ({args.sft_steps} steps, not timed)"
    eval_cfg = EvalConfig(per_tier=args.per_tier, samples_per_task=4)
    before = evaluate(policy, tok, eval_cfg)["eval/keep_rate"]
    start = time.perf_counter()
    train_offline(policy, tok, TrainConfig(steps=args.rl_steps, seed=1))
    minutes = (time.perf_counter() - start) / 60
    after = evaluate(policy, tok, eval_cfg)["eval/keep_rate"]
    result.update(
        heldout_gain_per_min=(after - before) / minutes,
        heldout_keep_before=before,
        heldout_keep_after=after,
        rl_minutes=minutes,
        note="measured on a shared 2-core CPU under contention; rerun on a quiet machine",
    )
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
