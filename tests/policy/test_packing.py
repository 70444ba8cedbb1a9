"""Packed training rows: a partition of the batch, per-sequence outputs and the update equal to one-at-a-time.

Equal to float rounding (float32 on CPU), with and without routing replay; sequences in a row are blind to each other.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from policy_helpers import synthetic_batch

from ingest.embedded import free_port
from policy.advantages import compute_advantages
from policy.forward import forward_tokens, score_tokens
from policy.losses import LossConfig
from policy.model import build_model
from policy.packing import block_causal_mask, forward_packed, forward_packed_rows, pack_sequences, packed_positions
from policy.rollouts import Rollout
from policy.tokenizer import default_tokenizer
from policy.trainer import TrainConfig, update_step


def _sequences(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 400) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


@pytest.mark.parametrize("budget", [1, 17, 64, 200])
def test_packing_is_a_partition_within_budget(budget: int) -> None:
    lengths = [random.Random(budget + i).randrange(1, 90) for i in range(41)]
    rows = pack_sequences(lengths, budget)
    members = sorted(i for row in rows for i in row.members)
    assert members == list(range(len(lengths)))  # every sequence exactly once
    for row in rows:
        assert row.lengths == tuple(lengths[i] for i in row.members)
        assert row.tokens <= budget or len(row.members) == 1  # only a lone over-long sequence exceeds it
    assert pack_sequences(lengths, budget) == rows  # deterministic: every rank packs alike
    if budget >= max(lengths):  # FFD's bound: at most 11/9 of the optimum (>= the token lower bound) + 6/9
        assert len(rows) <= 11 / 9 * -(-sum(lengths) // budget) + 6 / 9


def test_positions_restart_and_mask_is_block_causal() -> None:
    assert packed_positions([3, 2]).tolist() == [[0, 1, 2, 0, 1]]
    allowed = (block_causal_mask([3, 2])[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.parametrize("replay", [False, True])
def test_packed_outputs_match_one_at_a_time(tiny, replay: bool) -> None:  # type: ignore[no-untyped-def]
    seqs = _sequences(7, seed=1)
    prompt_lens = [1 + i % 3 for i in range(len(seqs))]
    served = [score_tokens(tiny, s, prompt_len=p).routed_experts for s, p in zip(seqs, prompt_lens, strict=True)]
    if replay:  # experts the router would not pick itself, so replay visibly matters
        served = [(e + 3) % 8 for e in served]
    with torch.no_grad():
        packed = forward_packed(tiny, seqs, prompt_lens, routed_experts=served if replay else None)
        for s, p, e, out in zip(seqs, prompt_lens, served, packed, strict=True):
            one = forward_tokens(tiny, s, prompt_len=p, routed_experts=e if replay else None)
            torch.testing.assert_close(out.logprobs, one.logprobs, rtol=0, atol=1e-5)
            torch.testing.assert_close(out.entropy, one.entropy, rtol=1e-6, atol=1e-5)
            for a, b in zip(out.router_logits, one.router_logits, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert torch.equal(out.routed_experts, one.routed_experts)
            if replay:
                assert torch.equal(out.routed_experts, torch.as_tensor(e, dtype=torch.int64))


def test_a_sequence_cannot_see_its_row_neighbours(tiny) -> None:  # type: ignore[no-untyped-def]
    seqs = _sequences(4, seed=2)
    changed = [list(s) for s in seqs]
    changed[1] = [0] + [(t * 7 + 3) % 400 for t in changed[1][1:]]
    changed[3] = changed[3][: len(changed[3]) // 2]
    with torch.no_grad():
        before = forward_packed(tiny, seqs, [1] * 4)
        after = forward_packed(tiny, changed, [1] * 4)
    for i in (0, 2):  # untouched sequences: the same logprobs, though their neighbours changed
        torch.testing.assert_close(after[i].logprobs, before[i].logprobs, rtol=0, atol=1e-6)
    assert not torch.allclose(after[1].logprobs, before[1].logprobs)


@pytest.mark.parametrize("replay", [False, True])
def test_rows_in_one_forward_match_each_row_alone(tiny, replay: bool) -> None:  # type: ignore[no-untyped-def]
    seqs = _sequences(11, seed=5)
    rows = [seqs[:3], seqs[3:4], seqs[4:9], seqs[9:]]  # rows of unequal length: the shorter are padded
    prompts = [[1 + i % 2 for i in range(len(row))] for row in rows]
    served = [[(score_tokens(tiny, s, prompt_len=1).routed_experts + 5) % 8 for s in row] for row in rows]
    if replay:
        served[1] = [None]  # a row without served experts is routed by the router
    with torch.no_grad():
        together = forward_packed_rows(tiny, rows, prompts, routed_experts=served if replay else None)
        for row, row_prompts, row_served, outs in zip(rows, prompts, served, together, strict=True):
            alone = forward_packed(tiny, row, row_prompts, routed_experts=row_served if replay else None)
            assert len(outs) == len(alone) == len(row)
            for a, b in zip(outs, alone, strict=True):
                torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
                torch.testing.assert_close(a.entropy, b.entropy, rtol=1e-6, atol=1e-5)
                assert torch.equal(a.routed_experts, b.routed_experts)
    assert forward_packed_rows(tiny, [], []) == []


def _mixed_batch(model, tokenizer) -> list[Rollout]:  # type: ignore[no-untyped-def]
    """The synthetic batch plus longer rollouts of varied lengths (several rows at the budget used)."""
    batch = synthetic_batch(model, tokenizer)
    for i, s in enumerate(_sequences(6, seed=3)):
        scored = score_tokens(model, s, prompt_len=3)
        mask = [j % 5 != 0 for j in range(len(s) - 3)]
        batch.append(
            Rollout(s[:3], s[3:], float(i % 3) / 2, scored.logprobs.astype("float64") - 0.05 * (i % 2),
                    scored.routed_experts, mask, group_id=f"h{i // 3}", policy_version=0)
        )  # fmt: skip
    batch[0] = replace(batch[0], served_logprobs=np.where(np.arange(4) == 1, np.nan, batch[0].served_logprobs))
    return batch


@pytest.mark.parametrize(
    "loss", [LossConfig(kl_coef=0.1, entropy_coef=0.01, load_balance_coef=0.01), LossConfig(level="sequence")]
)
def test_packed_update_matches_unpacked(tokenizer, loss: LossConfig) -> None:  # type: ignore[no-untyped-def]
    base = build_model("tiny", len(tokenizer), seed=0)
    batch = _mixed_batch(base, tokenizer)
    ref = build_model("tiny", len(tokenizer), seed=4)
    results = {}
    for pack, rows in ((0, 1), (48, 1), (48, 3)):  # one at a time; one row per forward; three rows per forward
        model = build_model("tiny", len(tokenizer), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = TrainConfig(pack_tokens=pack, pack_rows=rows, grad_clip=1e9, loss=loss)
        metrics = update_step(model, opt, batch, cfg, ref_model=ref if loss.kl_coef else None)
        results[(pack, rows)] = (metrics, {k: v.detach().clone() for k, v in model.state_dict().items()})
    for packed in ((48, 1), (48, 3)):
        _assert_same_update(results[(0, 1)], results[packed], loss)


def _assert_same_update(one, packed, loss: LossConfig) -> None:  # type: ignore[no-untyped-def]
    (m0, w0), (m1, w1) = one, packed
    for key in ("loss/total", "loss/policy", "optim/grad_norm", "entropy/mean", "ratio/clip_frac", "is/mean_weight"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    assert m1["batch/trained_tokens"] == m0["batch/trained_tokens"]
    if loss.load_balance_coef:
        assert m1["moe/load_balance"] == pytest.approx(m0["moe/load_balance"], rel=1e-5)
    assert m0["gap/max_abs_logprob"] == pytest.approx(m1["gap/max_abs_logprob"], abs=1e-5)
    initial = build_model("tiny", len(w0["model.embed_tokens.weight"]), seed=0).state_dict()
    moved = 0
    for k, v in w0.items():  # SGD at lr 1: the weight change is the gradient
        torch.testing.assert_close(w1[k] - initial[k], v - initial[k], rtol=1e-4, atol=1e-6)
        moved += int(not torch.equal(v, initial[k]))
    assert moved > 10


def test_packed_update_of_a_batch_without_gradient_is_a_no_op(tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    batch = [replace(r, reward=1.0) for r in synthetic_batch(tiny, tokenizer)]  # every group all alike: advantages 0
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    opt = torch.optim.SGD(tiny.parameters(), lr=1.0)
    metrics = update_step(tiny, opt, batch, TrainConfig(pack_tokens=64, pack_rows=4))
    assert metrics["batch/trained_tokens"] <= 1.0 and metrics["optim/grad_norm"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in tiny.state_dict().items())


def test_packed_update_rejects_negative_budget(tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(tiny.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="pack_tokens"):
        update_step(tiny, opt, synthetic_batch(tiny, tokenizer), TrainConfig(pack_tokens=-1))


def test_two_processes_fsdp_packed_match_one(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = build_model("tiny", len(tokenizer), seed=0)
    batch = _mixed_batch(model, tokenizer)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    advantages = compute_advantages([r.reward for r in batch], [r.group_id for r in batch], [""] * len(batch))
    active = [len(r.prompt_ids) + len(r.completion_ids) for r, a in zip(batch, advantages, strict=True) if a != 0.0]
    assert len(pack_sequences(active, PACK)) % 2 == 1
    reference = update_step(model, opt, batch, TrainConfig(pack_tokens=PACK, grad_clip=GRAD_CLIP))
    assert reference["optim/grad_norm"] > GRAD_CLIP
    out = tmp_path / "fsdp.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "--master_addr=127.0.0.1", __file__, str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    two = torch.load(out, weights_only=False)
    for key in ("loss/total", "optim/grad_norm", "batch/trained_tokens", "loss/policy"):
        assert two["metrics"][key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    for k, v in model.state_dict().items():
        assert torch.allclose(v, two["weights"][k], rtol=1e-5, atol=1e-7), k


PACK = 56
"""Three rows of the mixed batch's rollouts with a gradient: with 2 ranks one adds a zero-weight pass."""
GRAD_CLIP = 0.05
ROOT = Path(__file__).resolve().parents[2]


def _fsdp_worker(out_path: str) -> None:
    """Under torchrun: one packed update of the mixed batch on an FSDP-sharded model (odd row count: a pad pass)."""
    from policy.distributed import init_from_env, is_main, shard, shutdown, unsharded_copy

    init_from_env()
    torch.set_num_threads(1)
    tok = default_tokenizer()
    model = build_model("tiny", len(tok), seed=0)
    batch = _mixed_batch(model, tok)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = update_step(model, opt, batch, TrainConfig(pack_tokens=PACK, grad_clip=GRAD_CLIP))
    whole = unsharded_copy(model)
    if is_main() and whole is not None:
        torch.save({"metrics": metrics, "weights": whole.state_dict()}, out_path)
    shutdown()


if __name__ == "__main__":
    _fsdp_worker(sys.argv[1])


def test_packed_update_with_turn_credit_and_session_mean_matches_unpacked(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Per-token advantages (turn-level credit) and the per-session mean take the same path packed."""
    base = build_model("tiny", len(tokenizer), seed=0)
    batch = []
    for i, r in enumerate(_mixed_batch(base, tokenizer)):
        if r.group_id and r.group_id.startswith("h"):  # agent windows: tokens in turns of four
            turns = np.array([j // 4 if m else -1 for j, m in enumerate(r.mask)])
            r = replace(r, session_id=f"s{i}", token_turns=turns, turn_feedback={0: float(i % 2), 1: 0.2})
        batch.append(r)
    assert any(r.token_turns is not None for r in batch)
    results = {}
    for pack, rows in ((0, 1), (48, 3)):
        model = build_model("tiny", len(tokenizer), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = TrainConfig(pack_tokens=pack, pack_rows=rows, grad_clip=1e9, feedback_weight=1.0, normalize="session")
        metrics = update_step(model, opt, batch, cfg)
        results[pack] = (metrics, {k: v.detach().clone() for k, v in model.state_dict().items()})
    _assert_same_update(results[0], results[48], LossConfig())
    # the credit changed the update (against the same batch without it)
    model = build_model("tiny", len(tokenizer), seed=0)
    plain = update_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, TrainConfig(grad_clip=1e9))
    assert plain["loss/total"] != pytest.approx(results[0][0]["loss/total"], rel=1e-3)
