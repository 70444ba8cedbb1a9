"""``scripts/gpu_check.sh``: its dry run on CPU goes through every step but the GPU ones (checkpoint,
serving, agent sessions through the gateway, a trained delta applied and its hash checked, logprob
gaps), and it says clearly what is wrong without a GPU or with a checkpoint vLLM cannot load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scheduler_helpers import REPO

from scheduler.gpu_check import checkpoint_report, vllm_command, vllm_env

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _run(*args: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "HOME": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
    )


def test_the_dry_run_goes_through_every_step_on_cpu(sandbox: None, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    work = tmp_path / "work"
    args = ("--dry-run", "--workdir", str(work), "--sft-steps", "20", "--sessions", "2", "--max-turns", "3")
    proc = _run(*args, "--out", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    assert result["ok"] and result["dry_run"] and result["backend"] == "cpu"
    assert result["checkpoint"]["architectures"] == ["Qwen3MoeForCausalLM"]
    command = result["vllm_command"]
    assert command[:3] == ["vllm", "serve", str(work / "v0")]
    for flag in ("--enable-return-routed-experts", "--worker-extension-cls", "--tool-call-parser"):
        assert flag in command
    assert result["vllm_env"]["VLLM_SERVER_DEV_MODE"] == "1"

    # sessions through the gateway became trajectories and one update: a delta, applied, its hash checked
    assert result["train"]["trajectories"]["sessions"] == 2 and result["train"]["trained_tokens"] > 0
    import torch

    gpu = torch.cuda.is_available()  # the trainer's CUDA path (bf16 autocast) where there is a GPU
    assert result["train"]["device"].startswith("cuda" if gpu else "cpu") and result["train"]["bf16_autocast"] is gpu
    delta = result["delta"]
    assert delta["kind"] == "delta" and delta["version"] == "v1" and delta["hash_matches"]
    assert result["train"]["delta_bytes"] > 0

    # every phase served tokens with experts; with replay the trainer reproduces them (CPU engine)
    for name in ("batch_invariant_off", "batch_invariant_on", "after_delta"):
        phase = result["phases"][name]
        assert phase["errors"] == [] and phase["turns"] >= phase["sessions"] > 0, (name, phase)
        assert phase["replay"]["tokens"] > 0 and phase["replay"]["turns_with_experts"] > 0
        assert phase["replay"]["max_abs"] < 1e-4, (name, phase)
    assert result["mean_turns"] > 0


def test_without_a_gpu_it_says_so_and_a_checkpoint_vllm_cannot_load_is_refused(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi") is None:
        proc = _run(tmp_path=tmp_path, timeout=60)
        assert proc.returncode == 2 and "no NVIDIA GPU" in proc.stderr and "--dry-run" in proc.stderr
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match=r"architectures.*safetensors.*tokenizer\.json.*chat template"):
        checkpoint_report(bad)


def test_the_vllm_command_and_environment() -> None:
    command = vllm_command(Path("/ckpt"), 8200, "bfloat16")
    assert command[command.index("--dtype") + 1] == "bfloat16" and command[command.index("--port") + 1] == "8200"
    assert command[command.index("--worker-extension-cls") + 1] == "serving.vllm_ext.UndertowWorkerExtension"
    assert vllm_env(Path("/store"), "v0", True)["VLLM_BATCH_INVARIANT"] == "1"
    assert vllm_env(Path("/store"), "v0", False)["VLLM_BATCH_INVARIANT"] == "0"
