"""Trainer: exact replay in the update, determinism, resume after SIGKILL, staleness, sessions, versions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from policy_helpers import one_step, small_train_config, synthetic_batch, uneven_batch

from ingest.arrays import npy_bytes, pack_floats, pack_ids
from ingest.db import transaction
from ingest.embedded import free_port
from ingest.tables import SegmentRow, SessionRow
from policy.forward import score_tokens
from policy.model import build_model, save_checkpoint
from policy.rollouts import Rollout, filter_stale, rollouts_from_sessions, version_number
from policy.trainer import (
    STATE_FILE,
    TrainConfig,
    load_state,
    make_optimizer,
    train_offline,
    train_on_rollouts,
    update_step,
)
from policy.versions import latest_version, list_versions, record_version

ROOT = Path(__file__).resolve().parents[2]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_update_with_replay_has_zero_train_serve_gap(tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    batch = synthetic_batch(tiny, tokenizer)
    before = _weights(tiny)
    cfg = TrainConfig(lr=1e-2)
    metrics = update_step(tiny, make_optimizer(tiny, cfg), batch, cfg)
    assert metrics["gap/max_abs_logprob"] == 0.0  # bit-identical to the served logprobs
    assert metrics["ratio/clip_frac"] == 0.0 and metrics["is/mean_weight"] == 1.0
    assert not _same(before, _weights(tiny))
    # the rewarded completions gained probability relative to the others
    after = [float(score_tokens(tiny, r.prompt_ids + r.completion_ids, prompt_len=3).logprobs.sum()) for r in batch]
    served = [float(r.served_logprobs.sum()) for r in batch]  # type: ignore[union-attr]
    gain = [a - s for a, s in zip(after, served, strict=True)]
    rewarded = np.mean([g for g, r in zip(gain, batch, strict=True) if r.reward > 0.5])
    unrewarded = np.mean([g for g, r in zip(gain, batch, strict=True) if r.reward < 0.5])
    assert rewarded > unrewarded


def test_same_seed_gives_bit_identical_weights(tokenizer) -> None:  # type: ignore[no-untyped-def]
    runs = []
    for _ in range(2):
        model = build_model("tiny", len(tokenizer), seed=0)
        train_offline(model, tokenizer, small_train_config(2))
        runs.append(_weights(model))
    assert _same(runs[0], runs[1])
    assert not _same(runs[0], _weights(build_model("tiny", len(tokenizer), seed=0)))


def test_resume_after_sigkill_matches_uninterrupted_run(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    steps = 3
    reference = build_model("tiny", len(tokenizer), seed=0)
    train_offline(reference, tokenizer, small_train_config(steps))

    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "tests" / "policy" / "policy_helpers.py"), "resume", str(state), str(steps)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (state / STATE_FILE).exists():
            assert proc.poll() is None, "worker exited before its first checkpoint"
            assert time.monotonic() < deadline, "worker made no checkpoint in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    saved_step = torch.load(state / STATE_FILE, weights_only=False)["step"]
    assert 1 <= saved_step <= steps

    resumed = build_model("tiny", len(tokenizer), seed=0)
    summary = train_offline(resumed, tokenizer, small_train_config(steps), state_dir=state)
    assert summary["train/step"] == steps
    assert _same(_weights(reference), _weights(resumed))


def test_stale_samples_are_dropped_and_counted() -> None:
    rollouts = [Rollout([0], [1], 1.0, policy_version=v) for v in (10, 9, 7, 5, None, 11)]
    kept, stats = filter_stale(rollouts, current=10, max_staleness=3)
    assert [r.policy_version for r in kept] == [10, 9, 7]
    assert stats.dropped == 3 and stats.unknown == 1 and stats.max == 3 and stats.mean == pytest.approx(4 / 3)
    assert version_number("v0012") == 12 and version_number("main") is None and version_number(None) is None
    # v9 was rolled back beside the line 10 <- 8 <- 7: its rollouts drop with the stale ones, counted apart
    kept, stats = filter_stale(rollouts, current=10, max_staleness=3, lineage={10, 8, 7})
    assert [r.policy_version for r in kept] == [10, 7]
    assert stats.dropped == 4 and stats.off_lineage == 1 and stats.unknown == 1 and stats.mean == pytest.approx(3 / 2)


def _store_session(engine, sid: str, model, prompt: list[int], completion: list[int], version: str) -> None:  # type: ignore[no-untyped-def]
    scored = score_tokens(model, prompt + completion, prompt_len=len(prompt))
    now = datetime.now(UTC)
    with transaction(engine) as db:
        db.add(
            SessionRow(
                session_id=sid, event_id=f"e-{sid}", user_id="u", occurred_at=now, received_at=now, model="tiny",
                policy_version=version, group_id="g1", candidate_index=0, prompt_text=None,
                prompt_token_ids=pack_ids(prompt), completion_text="", num_completion_tokens=len(completion),
                routed_experts=npy_bytes(scored.routed_experts), logprobs_mode="raw", extra={},
                segments=[
                    SegmentRow(idx=0, role="assistant", text=None, token_ids=pack_ids(completion),
                               logprobs=pack_floats(scored.logprobs.astype(np.float64)))
                ],
            )
        )  # fmt: skip


def test_rollouts_from_database_sessions_replay_exactly(engine, tiny, tokenizer) -> None:  # type: ignore[no-untyped-def]
    _store_session(engine, "s1", tiny, [0, 5, 6], [7, 8, 9, 0], "v0003")
    _store_session(engine, "s2", tiny, [0, 5, 6], [9, 9, 0], "v0003")
    _store_session(engine, "s3", tiny, [0, 5, 6], [4, 0], "v0003")  # no reward yet
    rewards = {"s1": 1.0, "s2": 0.0}
    with transaction(engine) as db:
        sessions = list(db.query(SessionRow).order_by(SessionRow.session_id))
        rollouts, dropped = rollouts_from_sessions(
            sessions, lambda s: rewards.get(s.session_id), max_tokens=64, summary_token_id=2
        )
    assert dropped == 0 and [r.session_id for r in rollouts] == ["s1", "s2"]
    assert all(r.routed_experts is not None and r.policy_version == 3 for r in rollouts)
    metrics, stats = train_on_rollouts(tiny, rollouts, TrainConfig(), current_version=4)
    assert metrics["gap/max_abs_logprob"] == 0.0 and metrics["train/steps"] == 1.0
    assert stats.kept == 2 and stats.mean == 1.0 and stats.dropped == 0
    _, stale = train_on_rollouts(tiny, rollouts, TrainConfig(max_staleness=0), current_version=4)
    assert stale.dropped == 2 and stale.kept == 0


def test_version_rows_record_lineage(engine, tiny, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = save_checkpoint(tiny, tokenizer, tmp_path / "v0000")
    record_version(engine, version="v0000", parent=None, step=0, checkpoint_path=path, metrics={"eval/keep_rate": 0.3})
    record_version(
        engine, version="v0001", parent="v0000", step=8, checkpoint_path=path, metrics={"eval/keep_rate": 0.4},
        num_samples=96, num_dropped_stale=2, staleness_mean=0.5, staleness_max=1,
    )  # fmt: skip
    latest = latest_version(engine)
    assert latest is not None and latest.version_id == "v0001" and latest.parent_id == "v0000"
    assert [r.version_id for r in list_versions(engine)] == ["v0000", "v0001"]
    with pytest.raises(ValueError):
        record_version(engine, version="v0001", parent=None, step=0, checkpoint_path=path, metrics={})
    with pytest.raises(FileNotFoundError):
        record_version(engine, version="v0009", parent=None, step=0, checkpoint_path=tmp_path / "nope", metrics={})


GRAD_CLIP = 0.05
"""Small enough that the clip is active: the sharded gradient norm must match the whole one."""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_processes_match_one_process(mode: str, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = build_model("tiny", len(tokenizer), seed=0)
    reference, _ = one_step(model, uneven_batch(model, tokenizer), GRAD_CLIP)
    assert reference["optim/grad_norm"] > GRAD_CLIP
    out = tmp_path / f"{mode}.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "--master_addr=127.0.0.1", str(ROOT / "tests" / "policy" / "policy_helpers.py"), mode, str(out),
        str(GRAD_CLIP),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    two = torch.load(out, weights_only=False)
    for key in ("loss/total", "optim/grad_norm", "batch/trained_tokens", "loss/policy"):
        assert two["metrics"][key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    assert two["metrics"]["gap/max_abs_logprob"] == 0.0  # routing replay is exact under sharding too
    one = model.state_dict()
    assert two["weights"].keys() == one.keys()
    for k, v in one.items():
        assert torch.allclose(v, two["weights"][k], rtol=1e-5, atol=1e-7), k
    assert not _same(one, _weights(build_model("tiny", len(tokenizer), seed=0)))
    assert two["reloaded_same"]  # the saved state resumes into 2 ranks (sharded for fsdp) exactly
    # the state the 2 ranks saved (rank 0 wrote it) resumes in one process with the same weights
    plain = build_model("tiny", len(tokenizer), seed=1)
    step, extra = load_state(
        out.with_suffix(".state"), plain, torch.optim.SGD(plain.parameters(), lr=1.0, momentum=0.9)
    )
    assert step == 1 and extra == {"mode": mode}
    assert _same(_weights(plain), two["weights"])


def test_device_and_backend_follow_the_hardware() -> None:
    from policy.distributed import backend_for, on_cpu, train_device

    assert train_device("cpu") == torch.device("cpu") and backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    if torch.cuda.is_available():
        assert train_device("auto").type == "cuda"
    else:
        assert train_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="no CUDA"):
            train_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        train_device("tpu")
    model = torch.nn.Linear(2, 2)
    assert on_cpu(model) is model  # already there: no copy


def test_bf16_autocast_trains_in_float32_weights(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from policy.trainer import autocast

    assert isinstance(
        autocast(torch.device("cpu"), TrainConfig()), type(autocast(torch.device("cpu"), TrainConfig(autocast="off")))
    )
    with autocast(torch.device("cpu"), TrainConfig()):  # auto on CPU: float32 (replay's exact logprobs)
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="autocast"):
        autocast(torch.device("cpu"), TrainConfig(autocast="fp8"))
    results = {}
    for mode in ("off", "bf16"):
        for pack in (0, 64):
            model = build_model("tiny", len(tokenizer), seed=0)
            batch = synthetic_batch(model, tokenizer)
            before = _weights(model)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            cfg = TrainConfig(autocast=mode, pack_tokens=pack, grad_clip=1e9)
            metrics = update_step(model, opt, batch, cfg)
            after = _weights(model)
            assert all(v.dtype == torch.float32 for v in after.values())
            assert np.isfinite(metrics["loss/total"]) and metrics["optim/grad_norm"] > 0
            results[(mode, pack)] = (metrics, {k: after[k] - before[k] for k in after})
    for pack in (0, 64):
        (m32, g32), (m16, g16) = results[("off", pack)], results[("bf16", pack)]
        # bf16 keeps ~3 significant digits: the update is the same one, to that precision
        assert m16["loss/total"] == pytest.approx(m32["loss/total"], rel=0.05, abs=1e-3)
        assert m16["gap/max_abs_logprob"] > m32["gap/max_abs_logprob"]  # and it is visible in the gap
        flat32 = torch.cat([g.flatten() for g in g32.values()])
        flat16 = torch.cat([g.flatten() for g in g16.values()])
        assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.95


def _framing_batch(tokenizer) -> list[Rollout]:  # type: ignore[no-untyped-def]
    """Two agent sessions on one task with the same framing: one succeeds in one turn, the other
    fails through four turns of exactly the same tokens (as a session that keeps trying does)."""
    prompt = [int(t) for t in tokenizer("def f(x):", add_special_tokens=False)["input_ids"]]
    call = [int(t) for t in tokenizer(' {"name": "submit"}', add_special_tokens=False)["input_ids"]]
    won = Rollout(prompt, call, reward=1.0, group_id="g", session_id="won")
    lost = [Rollout(prompt, call, reward=0.0, group_id="g", session_id="lost") for _ in range(4)]
    return [won, *lost]


@pytest.mark.parametrize("normalize", ["token", "session"])
def test_session_mean_stops_long_failures_pushing_down_shared_tokens(tiny, tokenizer, normalize) -> None:  # type: ignore[no-untyped-def]
    """Under the token mean the four-turn failure outweighs the one-turn success on the tokens both
    wrote, so they lose probability; with each session weighed once they do not move."""
    batch = _framing_batch(tokenizer)
    r = batch[0]

    def logp() -> float:
        return float(score_tokens(tiny, r.prompt_ids + r.completion_ids, prompt_len=len(r.prompt_ids)).logprobs.sum())

    before = logp()
    cfg = TrainConfig(lr=0.5, normalize=normalize, grad_clip=1e9)
    sgd = torch.optim.SGD(tiny.parameters(), lr=cfg.lr)  # moves by the gradient itself (Adam would rescale)
    update_step(tiny, sgd, batch, cfg)
    moved = logp() - before
    if normalize == "token":
        assert moved < -1e-3
    else:
        assert abs(moved) < 1e-5


def test_session_weights_average_sessions_not_tokens() -> None:
    from policy.trainer import session_weights

    a = Rollout([1], [2, 3], 1.0, session_id="a")
    b1, b2 = Rollout([1], [2, 3, 4], 0.0, session_id="b"), Rollout([1], [5], 0.0, session_id="b")
    single = Rollout([1], [2, 3, 4, 5], 0.0)  # no session id: a session of its own
    weights = session_weights([a, b1, b2, single], "session")
    total = 2 + 4 + 4
    assert weights == pytest.approx([total / (3 * 2), total / (3 * 4), total / (3 * 4), total / (3 * 4)])
    assert session_weights([a, b1], "token") == [1.0, 1.0]
    with pytest.raises(ValueError, match="token or session"):
        session_weights([a], "sequence")
