"""RL trainer throughput, routing-replay overhead and train/serve logprob gaps, held-out gain per minute.

Measured on the ``tiny`` Qwen3-MoE preset, side by side with its baselines, in one run:

- ``moe_tokens_per_s``: RL update throughput (forward + backward + AdamW step, batch of one per
  sequence, the exact path) over prompt+completion tokens of a batch of scored rollouts, per
  second of this process's CPU time (single-threaded, so the wall time on an idle core; CPU time
  keeps other processes on a shared machine out of the figure);
- ``dense_tokens_per_s``: the same update for a dense Qwen3 with equal *active* parameters
  (same attention, a dense MLP of ``top_k * moe_intermediate_size``);
- ``replay_overhead``: update time with routing replay over without, minus 1 (target < 5%);
- ``packed_tokens_per_s`` / ``one_at_a_time_tokens_per_s`` / ``packed_speedup``: the same update
  (replay on) with rollouts packed into rows of ``pack_tokens`` (:mod:`policy.packing`), ``pack_rows``
  rows per forward (one forward and backward for the whole step here), and with one forward per
  rollout, interleaved on the same model and the same batch of the trainer's default step shape
  (8 tasks x 6 samples, ``max_tokens`` 48; ``packed_batch`` gives sequences, mean length,
  ``pack_tokens`` and ``pack_rows``; measured once the warm-up process has finished, on a quiet
  core, in steady state: blocks of steps per mode, :func:`time_blocks`); target speedup >= 3;
- ``peak_rss_mb``: this process's peak resident memory at the end of the run;
- ``logprob_gap_replay``: max |served - trainer| logprob with replay on the shared forward path
  (target exactly 0 on CPU);
- ``logprob_gap_no_replay``: the same against a throughput-style trainer forward (padded batch of
  8, no replay): batch non-invariance plus any routing flips it causes;
- ``heldout_gain_per_min``: held-out pass-and-keep gain of offline RL from v0 per minute of RL
  (``heldout_samples`` held-out samples before and after: ``--per-tier`` tasks per tier, 4 each).
  v0 is the checkpoint ``<home>/policy/v0000`` when one exists (``undertow policy warmup``),
  else a warm-up of ``--sft-steps`` steps (``v0_source`` says which; its time is not counted).
  That warm-up runs in a second, single-threaded process forked at the start, on the machine's other
  core, while this one measures throughput and gaps (also single-threaded): in a fresh home it
  is most of the wall time, and overlapping it keeps the run under a minute on 2 cores.

Figures measured on a shared, busy 2-core machine are noisy; rerun on a quiet one.
Run: ``python benchmarks/train.py --json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen3Config, Qwen3ForCausalLM

from policy.evaluate import EvalConfig, evaluate
from policy.forward import forward_tokens, sample_batch, score_tokens
from policy.model import PRESETS, active_parameters, build_model, load_checkpoint, num_parameters, save_checkpoint
from policy.rollouts import Rollout
from policy.sft import SFTConfig, prompt_ids, warmup
from policy.tasks import train_tasks
from policy.tokenizer import default_tokenizer
from policy.trainer import TrainConfig, make_optimizer, train_offline, update_step


def scored_batch(model, tokenizer, n: int, max_tokens: int) -> list[Rollout]:  # type: ignore[no-untyped-def]
    """``n`` sampled (one padded batch) and scored rollouts on training tasks, rewards alternating 1/0."""
    prompts = [prompt_ids(tokenizer, task) for task in train_tasks()[:n]]
    sampled = sample_batch(model, prompts, max_tokens=max_tokens, seed=0, pad_token_id=int(tokenizer.pad_token_id))
    out = []
    for i, (prompt, (tokens, _)) in enumerate(zip(prompts, sampled, strict=True)):
        scored = score_tokens(model, prompt + tokens, prompt_len=len(prompt))
        out.append(
            Rollout(
                prompt_ids=prompt,
                completion_ids=tokens,
                reward=float(i % 2),
                served_logprobs=scored.logprobs.astype(np.float64),
                routed_experts=scored.routed_experts,
                group_id="g",
                policy_version=0,
            )
        )
    return out


def time_updates(model, batch: list[Rollout], cfgs: list[TrainConfig], repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Median CPU seconds of one update step per config, the configs' steps interleaved (same conditions)."""
    opts = [make_optimizer(model, cfg) for cfg in cfgs]
    times: list[list[float]] = [[] for _ in cfgs]
    for _ in range(repeats):
        for cfg, opt, ts in zip(cfgs, opts, times, strict=True):
            start = time.process_time()
            update_step(model, opt, batch, cfg)
            ts.append(time.process_time() - start)
    return [float(np.median(ts)) for ts in times]


def time_blocks(model, batch: list[Rollout], cfgs: list[TrainConfig], rounds: int, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Median CPU seconds of one update step per config in steady state: each config runs blocks of
    one untimed step then ``steps`` timed ones, the configs' blocks alternating for ``rounds``.

    A trainer runs one mode step after step; alternating single steps (:func:`time_updates`) would
    make the packed path pay for the allocator churn of the other path (its large per-step buffers
    are given back and faulted in again, about 10k page faults a step)."""
    opts = [make_optimizer(model, cfg) for cfg in cfgs]
    times: list[list[float]] = [[] for _ in cfgs]
    for _ in range(rounds):
        for cfg, opt, ts in zip(cfgs, opts, times, strict=True):
            update_step(model, opt, batch, cfg)
            for _ in range(steps):
                start = time.process_time()
                update_step(model, opt, batch, cfg)
                ts.append(time.process_time() - start)
    return [float(np.median(ts)) for ts in times]


PACK_TOKENS = 96
"""Rows of the packed measurement: one or two of the task family's ~64-token rollouts. With every row
in one forward, short rows are best: eager attention pays for a row's masked-out part, quadratic
in its length (measured per update: 256-token rows 0.23 s, 128 0.157 s, 96 0.144 s, 72 0.150 s)."""
PACK_ROWS = 64
"""Packed rows per forward: more than the default step's 48 rollouts fill, so one forward."""


def packing_figures(tokenizer) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Packed against one-at-a-time update throughput on one batch of the default step's shape."""
    defaults = TrainConfig()
    model = build_model("tiny", len(tokenizer), seed=0)
    batch = scored_batch(
        model, tokenizer, n=defaults.tasks_per_step * defaults.group_size, max_tokens=defaults.max_tokens
    )
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in batch]
    t_one, t_packed = time_blocks(
        model,
        batch,
        [TrainConfig(lr=1e-4), TrainConfig(lr=1e-4, pack_tokens=PACK_TOKENS, pack_rows=PACK_ROWS)],
        rounds=2,
        steps=3,
    )
    return {
        "packed_tokens_per_s": sum(lengths) / t_packed,
        "one_at_a_time_tokens_per_s": sum(lengths) / t_one,
        "packed_speedup": t_one / t_packed,
        "packed_batch": {
            "sequences": len(batch),
            "mean_length": float(np.mean(lengths)),
            "mean_prompt_length": float(np.mean([len(r.prompt_ids) for r in batch])),
            "pack_tokens": PACK_TOKENS,
            "pack_rows": PACK_ROWS,
        },
    }


def packing_figures_fresh() -> dict[str, object]:
    """:func:`packing_figures` in the process it runs in (single-threaded, the presets' tokenizer)."""
    torch.set_num_threads(1)
    return packing_figures(default_tokenizer())


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
        start = time.process_time()
        opt.zero_grad()
        for r in batch:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].float(), -1)
            tok = logp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            (-(r.reward - 0.5) * tok.sum() / norm).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.process_time() - start)
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


def start_warmup(home: Path, steps: int, out: Path) -> tuple[multiprocessing.process.BaseProcess | None, Path]:
    """v0 from the home when cached, else a warm-up started in a second process (see the docstring).

    The process is forked from this one once torch and transformers are imported, so the warm-up
    starts at once instead of importing them again (seconds on this machine).
    """
    cached = home / "policy" / "v0000"
    if (cached / "config.json").exists():
        return None, cached
    proc = multiprocessing.get_context("fork").Process(target=warmup_into, args=(out, steps), name="v0-warmup")
    proc.start()
    return proc, out


def warmup_into(path: Path, steps: int) -> None:
    """The second process: train v0 single-threaded and save it as a checkpoint (stdout stays the parent's JSON)."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process ends with the warm-up)
    torch.set_num_threads(1)
    model, tokenizer, _ = warmup(SFTConfig(steps=steps))
    save_checkpoint(model, tokenizer, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--home", default=".undertow", help="Undertow home holding policy/v0000")
    parser.add_argument("--rl-steps", type=int, default=4, help="offline RL steps for the held-out gain")
    parser.add_argument("--sft-steps", type=int, default=300, help="warm-up steps when no v0 exists")
    parser.add_argument("--per-tier", type=int, default=16, help="held-out tasks per tier in the evaluation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scratch = tempfile.TemporaryDirectory(prefix="undertow-bench-v0-")
    proc, v0_dir = start_warmup(Path(args.home), args.sft_steps, Path(scratch.name) / "v0000")
    tokenizer = default_tokenizer()
    model = build_model("tiny", len(tokenizer), seed=0)
    batch = scored_batch(model, tokenizer, n=8, max_tokens=40)
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in batch)
    t_plain, t_replay = time_updates(
        model, batch, [TrainConfig(replay=False, lr=1e-4), TrainConfig(replay=True, lr=1e-4)], repeats=10
    )
    dense = dense_twin(len(tokenizer))
    t_dense = time_dense(dense, batch, repeats=10)
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
    if proc is None:
        result["v0_source"] = str(v0_dir)
    else:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"the v0 warm-up process failed (exit {proc.exitcode}); see its log above")
        result["v0_source"] = (
            f"warm-up here ({args.sft_steps} steps, in a second process during the throughput measurements; not timed)"
        )
    # after the warm-up process (a whole step in one forward is memory-bound, so a busy second core
    # would tax the packed path more than the one-at-a-time path it is compared with), in a fresh
    # process (the heap this one built up in the measurements above slows the packed path's large
    # per-step buffers: 2.5x here against 3.0 to 3.3x in a fresh process, measured)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result.update(pool.apply(packing_figures_fresh))
    policy, tok = load_checkpoint(v0_dir)
    scratch.cleanup()
    eval_cfg = EvalConfig(per_tier=args.per_tier, samples_per_task=4)
    before = evaluate(policy, tok, eval_cfg)
    start = time.perf_counter()
    train_offline(policy, tok, TrainConfig(steps=args.rl_steps, seed=1))
    minutes = (time.perf_counter() - start) / 60
    after = evaluate(policy, tok, eval_cfg)
    result.update(
        heldout_gain_per_min=(after["eval/keep_rate"] - before["eval/keep_rate"]) / minutes,
        heldout_keep_before=before["eval/keep_rate"],
        heldout_keep_after=after["eval/keep_rate"],
        heldout_samples=int(after["eval/samples"]),
        rl_minutes=minutes,
        note="single-threaded rates per CPU second; the v0 warm-up is not timed",
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
