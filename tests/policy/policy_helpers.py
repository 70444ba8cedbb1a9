"""Subprocess entry points for the trainer tests (resume after SIGKILL, torchrun FSDP and data parallel)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def tiny_setup(seed: int = 0):  # type: ignore[no-untyped-def]
    from policy.model import build_model
    from policy.tokenizer import default_tokenizer

    torch.set_num_threads(1)
    tok = default_tokenizer()
    return build_model("tiny", len(tok), seed=seed), tok


def small_train_config(steps: int):  # type: ignore[no-untyped-def]
    from policy.losses import LossConfig
    from policy.trainer import TrainConfig

    return TrainConfig(
        seed=5, steps=steps, tasks_per_step=2, group_size=2, max_tokens=6, lr=1e-2, loss=LossConfig(entropy_coef=0.01)
    )


def synthetic_batch(model, tok):  # type: ignore[no-untyped-def]
    """A fixed batch of scored rollouts with mixed rewards (two groups of three)."""
    from policy.forward import score_tokens
    from policy.rollouts import Rollout

    out = []
    for i in range(6):
        prompt = [0, 10 + i, 20]
        completion = [30 + i, 40, 50 + (i % 3), 60]
        scored = score_tokens(model, prompt + completion, prompt_len=len(prompt))
        out.append(
            Rollout(
                prompt_ids=prompt,
                completion_ids=completion,
                reward=float(i % 2),
                served_logprobs=scored.logprobs.astype("float64"),
                routed_experts=scored.routed_experts,
                group_id=f"g{i // 3}",
                policy_version=0,
            )
        )
    return out


def resume_main(state_dir: str, steps: int) -> None:
    from policy.trainer import train_offline

    model, tok = tiny_setup()
    train_offline(model, tok, small_train_config(steps), state_dir=Path(state_dir))


def uneven_batch(model, tok):  # type: ignore[no-untyped-def]
    """The synthetic batch plus a zero-advantage group (skipped) and a third group: 9 rollouts
    with a gradient, so with 2 ranks one has a rollout fewer and the FSDP path pads it."""
    from dataclasses import replace

    batch = synthetic_batch(model, tok)
    batch.insert(0, replace(batch[0], group_id="gz", reward=0.5))
    batch.insert(2, replace(batch[3], group_id="gz", reward=0.5))
    batch += [replace(batch[i], group_id="g2", reward=r) for i, r in ((2, 1.0), (4, 0.0), (6, 0.2))]
    return batch


def one_step(model, batch, grad_clip: float):  # type: ignore[no-untyped-def]
    """One update with SGD at lr 1 (its first step with momentum moves the weights by exactly the clipped gradient)."""
    from policy.trainer import TrainConfig, update_step

    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    return update_step(model, opt, batch, TrainConfig(grad_clip=grad_clip)), opt


def parallel_main(mode: str, out_path: str, grad_clip: float) -> None:
    """Under torchrun: one step on the uneven batch (``fsdp`` or ``ddp``), then a resumable state."""
    from policy.distributed import init_from_env, is_main, shard, shutdown, unsharded_copy
    from policy.trainer import load_state, save_state

    init_from_env()
    model, tok = tiny_setup()
    batch = uneven_batch(model, tok)  # scored by the whole model, as the serving engine would
    if mode == "fsdp":
        shard(model)
    metrics, opt = one_step(model, batch, grad_clip)
    whole = unsharded_copy(model)
    weights = {k: v.clone() for k, v in whole.state_dict().items()} if whole is not None else {}
    state = Path(out_path).with_suffix(".state")
    save_state(state, model, opt, 1, {"mode": mode})
    # every rank resumes that state into a fresh (differently initialised) model of the same layout
    again, _ = tiny_setup(seed=1)
    if mode == "fsdp":
        shard(again)
    step, _ = load_state(state, again, torch.optim.SGD(again.parameters(), lr=1.0, momentum=0.9))
    reloaded = unsharded_copy(again)
    if is_main():
        same = step == 1 and all(torch.equal(v, reloaded.state_dict()[k]) for k, v in weights.items())
        torch.save({"metrics": metrics, "weights": weights, "reloaded_same": same}, out_path)
    shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume_main(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] in ("fsdp", "ddp"):
        parallel_main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    else:
        print(json.dumps({"error": f"unknown worker {sys.argv[1]}"}))
        sys.exit(2)
