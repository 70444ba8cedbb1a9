"""Subprocess entry points for the trainer tests (resume after SIGKILL, torchrun data parallel)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def tiny_setup():  # type: ignore[no-untyped-def]
    from policy.model import build_model
    from policy.tokenizer import default_tokenizer

    torch.set_num_threads(1)
    tok = default_tokenizer()
    return build_model("tiny", len(tok), seed=0), tok


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


def ddp_main(out_path: str) -> None:
    import torch.distributed as dist

    from policy.trainer import TrainConfig, update_step

    dist.init_process_group("gloo")
    model, tok = tiny_setup()
    batch = synthetic_batch(model, tok)
    cfg = TrainConfig(grad_clip=1e9)
    # plain SGD with lr 1: the weight change is exactly the all-reduced gradient
    metrics = update_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg)
    if dist.get_rank() == 0:
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save({"loss": metrics["loss/total"], "weights": weights}, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume_main(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "ddp":
        ddp_main(sys.argv[2])
    else:
        print(json.dumps({"error": f"unknown worker {sys.argv[1]}"}))
        sys.exit(2)
