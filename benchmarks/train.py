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
- train/serve gaps, measured against what the CPU engine served over HTTP (``undertow engine
  serve`` on a fresh ``tiny`` checkpoint, ``--requests`` completions of training tasks, ``--concurrency``
  sent at once; the engine runs them one at a time under its lock, so they wait in flight rather
  than batch: ``served_gap.engine.engine_max_inflight`` is the most its ``/metrics`` reported at once),
  recomputed by the trainer's own forward with routing replay of the served experts on and off:
  ``logprob_gap_replay`` / ``logprob_gap_no_replay`` (max |served - trainer| logprob, the default
  one-at-a-time path, :func:`policy.forward.forward_tokens`), ``logprob_gap_mean_*``,
  ``routing_differs_*`` (share of tokens whose experts differ from the served ones in some layer) and
  ``logprob_gap_packed_*`` (the packed path, :func:`policy.packing.forward_packed_rows`);
  ``served_gap`` has every figure for both paths, on the served weights (``same_weights``) and after
  one trainer update on those completions (``one_step_later``: the routing the trainer's moved policy
  would pick, which replay overrides). The requests are streamed: the last chunk carries the
  logprobs and experts of the engine's re-scoring pass (what a non-streamed answer carries, and what
  the figures above compare), each earlier chunk its token's logprob from the sampler's incremental
  KV-cache pass: ``logprob_gap_decode_time`` (max, replay on; ``_mean_`` too) and
  ``served_gap.same_weights_vs_decode_time`` compare the trainer with those, the gap an engine that
  reports decode-time logprobs (vLLM's way) would leave;
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from policy.evaluate import EvalConfig, evaluate
from policy.forward import forward_tokens, sample_batch, score_tokens
from policy.model import PRESETS, active_parameters, build_model, load_checkpoint, num_parameters, save_checkpoint
from policy.packing import forward_packed_rows, pack_sequences
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


@dataclass
class Served:
    """One completion as the engine served it: the ids, the served logprobs and experts."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: np.ndarray
    """float64 per generated token, as the engine's JSON carried them."""
    routed_experts: np.ndarray
    """int ``[len(prompt) + len(tokens) - 1, layers, top_k]`` (the wire contract's ``routed_experts``)."""
    decode_logprobs: np.ndarray | None = None
    """Streamed requests: each token's logprob in the chunk that carried it, as the sampler's
    incremental (KV-cache) pass computed it; ``logprobs`` are the engine's re-scoring of the whole
    sequence, sent in the last chunk."""


@dataclass
class Gap:
    """Served against recomputed logprobs and routing over a set of completions."""

    max_abs: float
    mean_abs: float
    tokens: int
    """Scored (generated) tokens compared."""
    routing_differs: float
    """Share of routed tokens (prompt and completion, every token but the last) whose expert set
    differs from the served one in at least one layer."""
    routing_differs_layers: float
    """Share of (token, layer) pairs whose expert set differs."""


def serve_requests(
    url: str, prompts: list[list[int]], *, max_tokens: int, concurrency: int, seed: int = 0, stream: bool = False
) -> tuple[list[Served], dict[str, float]]:
    """Send one completion request per prompt, ``concurrency`` at once, to the engine at ``url`` (streamed
    with ``stream``); return what it served and how many requests it held at once (polled from its
    ``/metrics``)."""
    from ingest.arrays import npy_from_b64

    stop = threading.Event()
    peak = [0]

    def poll() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                text = c.get(url + "/metrics").text
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        peak[0] = max(peak[0], int(float(line.rsplit(" ", 1)[1])))
                time.sleep(0.01)

    def served_of(i: int, choice: dict[str, Any], tokens: list[int], decoded: list[float] | None) -> Served:
        if not choice.get("routed_experts"):
            raise RuntimeError("the engine returned no routed_experts: start it with enable_return_routed_experts")
        if decoded is not None and len(decoded) != len(tokens):
            raise RuntimeError(f"request {i}: {len(decoded)} streamed logprobs for {len(tokens)} tokens")
        return Served(
            prompt_ids=list(prompts[i]),
            token_ids=tokens,
            logprobs=np.asarray(
                choice["token_logprobs"] if decoded is not None else choice["logprobs"]["token_logprobs"],
                dtype=np.float64,
            ),
            routed_experts=npy_from_b64(choice["routed_experts"]),
            decode_logprobs=None if decoded is None else np.asarray(decoded, dtype=np.float64),
        )

    def one(i: int, client: httpx.Client) -> Served:
        body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 1.0, "seed": seed + i,
                "logprobs": 0, "return_token_ids": True, "stream": stream}  # fmt: skip
        if not stream:
            r = client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"the engine refused request {i}: {r.status_code} {r.text[:300]}")
            choice = r.json()["choices"][0]
            if choice["prompt_token_ids"] != prompts[i]:
                raise RuntimeError(f"request {i}: the engine echoed other prompt ids")
            return served_of(i, choice, [int(t) for t in choice["token_ids"]], None)
        tokens: list[int] = []
        decoded: list[float] = []
        last: dict[str, Any] | None = None
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the engine refused request {i}: {r.status_code} {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    raise RuntimeError(f"request {i} failed in the engine: {event['error']}")
                for choice in event["choices"]:
                    if "token_logprobs" in choice:
                        last = choice
                    elif choice.get("token_ids"):
                        tokens += [int(t) for t in choice["token_ids"]]
                        decoded += [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if last is None:
            raise RuntimeError(f"request {i}: the stream ended without its last chunk")
        return served_of(i, last, tokens, decoded)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    start = time.perf_counter()
    try:
        limits = httpx.Limits(max_connections=concurrency)
        with httpx.Client(timeout=300, limits=limits) as client, ThreadPoolExecutor(max_workers=concurrency) as pool:
            served = list(pool.map(lambda i: one(i, client), range(len(prompts))))
    finally:
        stop.set()
        poller.join(5)
    return served, {"requests": len(prompts), "concurrency": concurrency, "engine_max_inflight": peak[0],
                    "seconds": time.perf_counter() - start}  # fmt: skip


def _compare(served: list[Served], logprobs: list[np.ndarray], experts: list[np.ndarray], against: str) -> Gap:
    """Gap figures of recomputed ``logprobs`` and ``experts`` (per completion) against the served ones
    (``against``: ``served``, the engine's answer, or ``decode``, the streamed decode-time logprobs)."""
    if against not in ("served", "decode"):
        raise ValueError(f"against must be served or decode (got {against!r})")
    if against == "decode" and any(s.decode_logprobs is None for s in served):
        raise ValueError("decode-time logprobs come only with streamed requests (serve_requests(stream=True))")
    reference = [s.logprobs if against == "served" else s.decode_logprobs for s in served]
    diffs = np.concatenate(
        [np.abs(lp.astype(np.float64) - ref) for ref, lp in zip(reference, logprobs, strict=True)]  # type: ignore[operator]
    )
    differs = [
        np.sort(e[: len(s.routed_experts)], axis=-1) != np.sort(s.routed_experts, axis=-1)
        for s, e in zip(served, experts, strict=True)
    ]
    per_layer = np.concatenate([d.any(axis=-1).reshape(-1) for d in differs])
    per_token = np.concatenate([d.any(axis=(1, 2)) for d in differs])
    return Gap(
        max_abs=float(diffs.max()) if diffs.size else 0.0,
        mean_abs=float(diffs.mean()) if diffs.size else 0.0,
        tokens=int(diffs.size),
        routing_differs=float(per_token.mean()) if per_token.size else 0.0,
        routing_differs_layers=float(per_layer.mean()) if per_layer.size else 0.0,
    )


def recompute_gap(
    model: PreTrainedModel,
    served: list[Served],
    *,
    replay: bool,
    pack_tokens: int = 0,
    pack_rows: int = 1,
    against: str = "served",
) -> Gap:
    """The trainer's forward of every served completion against what was served.

    ``pack_tokens == 0``: :func:`policy.forward.forward_tokens`, one sequence per forward (what
    :func:`policy.trainer.update_step` runs by default); else :func:`policy.packing.forward_packed_rows`
    over the rows :func:`policy.packing.pack_sequences` makes, ``pack_rows`` rows per forward (its packed
    path). ``replay``: the served experts are replayed (the trainer's ``replay`` switch). ``against``: see
    :func:`_compare`."""
    logprobs: list[np.ndarray] = [np.zeros(0)] * len(served)
    experts: list[np.ndarray] = [np.zeros(0)] * len(served)
    with torch.no_grad():
        if pack_tokens == 0:
            for i, s in enumerate(served):
                out = forward_tokens(model, s.prompt_ids + s.token_ids, prompt_len=len(s.prompt_ids),
                                     routed_experts=s.routed_experts if replay else None)  # fmt: skip
                logprobs[i], experts[i] = out.logprobs.numpy(), out.routed_experts.numpy()
        else:
            rows = pack_sequences([len(s.prompt_ids) + len(s.token_ids) for s in served], pack_tokens)
            for start in range(0, len(rows), pack_rows):
                chunk = rows[start : start + pack_rows]
                members = [[served[j] for j in row.members] for row in chunk]
                outs = forward_packed_rows(
                    model,
                    [[s.prompt_ids + s.token_ids for s in ms] for ms in members],
                    [[len(s.prompt_ids) for s in ms] for ms in members],
                    routed_experts=[[s.routed_experts for s in ms] for ms in members] if replay else None,
                )
                for row, row_outs in zip(chunk, outs, strict=True):
                    for j, out in zip(row.members, row_outs, strict=True):
                        logprobs[j], experts[j] = out.logprobs.numpy(), out.routed_experts.numpy()
    return _compare(served, logprobs, experts, against)


def gap_table(
    model: PreTrainedModel, served: list[Served], against: str = "served"
) -> dict[str, dict[str, dict[str, float]]]:
    """Replay on and off, for the trainer's one-at-a-time and packed forwards."""
    paths = {"one_at_a_time": (0, 1), "packed": (PACK_TOKENS, PACK_ROWS)}
    return {
        name: {
            f"replay_{'on' if replay else 'off'}": asdict(
                recompute_gap(model, served, replay=replay, pack_tokens=tokens, pack_rows=rows, against=against)
            )
            for replay in (True, False)
        }
        for name, (tokens, rows) in paths.items()
    }


def served_gap_figures(
    tokenizer: PreTrainedTokenizerBase, root: Path, *, requests: int = 8, concurrency: int = 8, max_tokens: int = 40
) -> dict[str, object]:
    """The CPU engine serves a fresh ``tiny`` checkpoint over HTTP (``undertow engine serve``, as the
    serving tests start it); ``requests`` completions of training tasks are sent ``concurrency`` at once,
    streamed (:func:`serve_requests`);
    the trainer then recomputes what was served (:func:`gap_table`) on the same weights, and again one
    update step later (:func:`policy.trainer.update_step` with the pipeline's settings on those
    completions, rewards alternating 1/0: the policy the trainer holds once it has moved)."""
    from policy.config import PolicyConfig
    from policy.pipeline import train_config
    from serving.launch import EngineProcess

    checkpoint = save_checkpoint(build_model("tiny", len(tokenizer), seed=0), tokenizer, root / "served-v0")
    engine = EngineProcess(checkpoint, "v0", None, log_path=root / "engine.log").start()
    try:
        engine.wait_ready(timeout_s=180)
        prompts = [prompt_ids(tokenizer, task) for task in train_tasks()[:requests]]
        served, stats = serve_requests(engine.url, prompts, max_tokens=max_tokens, concurrency=concurrency, stream=True)
    finally:
        engine.stop()
    model, _ = load_checkpoint(checkpoint)
    same = gap_table(model, served)
    decode = gap_table(model, served, against="decode")
    batch = [
        Rollout(prompt_ids=s.prompt_ids, completion_ids=s.token_ids, reward=float(i % 2), served_logprobs=s.logprobs,
                routed_experts=s.routed_experts, group_id="g", policy_version=0)
        for i, s in enumerate(served)
    ]  # fmt: skip
    cfg = train_config(PolicyConfig())
    update_step(model, make_optimizer(model, cfg), batch, cfg)
    return {
        "engine": {**stats, "max_tokens": max_tokens, "generated_tokens": sum(len(s.token_ids) for s in served)},
        "same_weights": same,
        "same_weights_vs_decode_time": decode,
        "one_step_later": gap_table(model, served),
        "packed_path": {"pack_tokens": PACK_TOKENS, "pack_rows": PACK_ROWS},
    }


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
    parser.add_argument("--requests", type=int, default=8, help="completions served by the engine for the gap")
    parser.add_argument("--concurrency", type=int, default=8, help="of those, sent at once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scratch = tempfile.TemporaryDirectory(prefix="undertow-bench-v0-")
    proc, v0_dir = start_warmup(Path(args.home), args.sft_steps, Path(scratch.name) / "v0000")
    tokenizer = default_tokenizer()
    gaps = served_gap_figures(tokenizer, Path(scratch.name), requests=args.requests, concurrency=args.concurrency)
    model = build_model("tiny", len(tokenizer), seed=0)
    batch = scored_batch(model, tokenizer, n=8, max_tokens=40)
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in batch)
    t_plain, t_replay = time_updates(
        model, batch, [TrainConfig(replay=False, lr=1e-4), TrainConfig(replay=True, lr=1e-4)], repeats=10
    )
    dense = dense_twin(len(tokenizer))
    t_dense = time_dense(dense, batch, repeats=10)
    fresh = build_model("tiny", len(tokenizer), seed=0)
    exact, packed = gaps["same_weights"]["one_at_a_time"], gaps["same_weights"]["packed"]  # type: ignore[index]
    decode = gaps["same_weights_vs_decode_time"]["one_at_a_time"]  # type: ignore[index]
    result: dict[str, object] = {
        "moe_tokens_per_s": tokens / t_plain,
        "dense_tokens_per_s": tokens / t_dense,
        "replay_overhead": t_replay / t_plain - 1,
        "logprob_gap_replay": exact["replay_on"]["max_abs"],
        "logprob_gap_no_replay": exact["replay_off"]["max_abs"],
        "logprob_gap_mean_replay": exact["replay_on"]["mean_abs"],
        "logprob_gap_mean_no_replay": exact["replay_off"]["mean_abs"],
        "routing_differs_replay": exact["replay_on"]["routing_differs"],
        "routing_differs_no_replay": exact["replay_off"]["routing_differs"],
        "logprob_gap_packed_replay": packed["replay_on"]["max_abs"],
        "logprob_gap_packed_no_replay": packed["replay_off"]["max_abs"],
        "logprob_gap_decode_time": decode["replay_on"]["max_abs"],
        "logprob_gap_mean_decode_time": decode["replay_on"]["mean_abs"],
        "served_gap": gaps,
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
