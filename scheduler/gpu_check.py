"""The GPU serving path checked in one run, or its dry run on CPU (``scripts/gpu_check.sh``).

The steps, in order (the dry run does every one, with the CPU engine where vLLM would serve):

1. **checkpoint**: the policy's v0 (``--checkpoint``, e.g. the demo's ``<home>/policy/v0000``, or
   a short warm-up) checked as a Hugging Face directory vLLM loads: ``config.json`` naming the
   architecture, safetensors weights, the tokenizer with its chat template (``chat_template.jinja``,
   which both ``transformers`` and vLLM read); it goes into a fresh weight store as v0.
2. **serve**: ``vllm serve`` with Undertow's worker extension, the ``hermes`` tool-call parser,
   routed experts returned, prefix caching and the control token on its control routes
   (:func:`vllm_command`, :func:`vllm_env`); in the dry run, the CPU engine (``undertow engine
   serve``) on the same checkpoint and store. The store's versions are signed with a key made for
   the check, and the server verifies them with its public key.
3. **sessions**: the agent harness (:mod:`policy.agent`) runs held-out tasks through a gateway in
   front of the server, several at once (so the server batches them); the gateway's telemetry
   events are kept.
4. **train**: the events are written to a SQLite database (the ingest writer), joined into
   trajectories (:mod:`policy.trajectories`) and used for one REINFORCE step from v0 (the
   harness's rewards against a baseline of 0.5), packed, on the GPU with bf16 autocast when there
   is one (the trainer's CUDA path; the CPU in the dry run): v1, a delta in the store.
5. **delta**: v1 is prefetched and applied on the server over ``collective_rpc`` (the engine
   contract's weight RPCs), and the hash the server reports is compared with the store's.
6. **gap**: the trainer's logprobs of every served token (CPU, float32, the trainer's forward
   path) against the served ones, with routing replay and without; for sessions served with
   batch invariance off and on (``VLLM_BATCH_INVARIANT``, a restart), and for a session served
   after the delta (against v0 updated to v1 as the server updates itself: the delta applied bit
   for bit shows as the same gap as before it).

The result is one JSON object (:func:`run_check`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import structlog

from serving.engine_auth import TOKEN_ENV

log = structlog.get_logger(__name__)

MODEL_NAME = "undertow-policy"
SHORT_TOOLS = [{"type": "function", "function": {"name": name}} for name in ("run_tests", "submit")]
"""Tool specs by name only: the tiny presets' context is 512 tokens (the harness runs both tools)."""


@dataclass(frozen=True)
class CheckConfig:
    """What one check runs."""

    backend: Literal["vllm", "cpu"] = "cpu"
    workdir: Path = Path(".undertow/gpu-check")
    checkpoint: Path | None = None
    """v0 to serve (None: a warm-up of ``sft_steps``)."""
    sft_steps: int = 300
    sessions: int = 4
    concurrency: int = 4
    max_turns: int = 4
    max_tokens: int = 48
    context_budget_chars: int = 700
    dtype: str = "auto"
    """vLLM's ``--dtype``."""
    seed: int = 0
    ready_timeout_s: float = 900.0


@dataclass
class Gap:
    """Trainer against server logprobs over the served tokens."""

    tokens: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    turns_with_experts: int = 0


@dataclass
class Phase:
    """One serving phase: its sessions and the gaps of what it served."""

    sessions: int = 0
    turns: int = 0
    summaries: int = 0
    tool_calls: int = 0
    errors: list[str] = field(default_factory=list)
    replay: Gap = field(default_factory=Gap)
    no_replay: Gap = field(default_factory=Gap)


def vllm_command(checkpoint: Path, port: int, dtype: str = "auto") -> list[str]:
    """``vllm serve`` for a policy checkpoint, as ``docs/serving.md`` gives it."""
    return [
        "vllm",
        "serve",
        str(checkpoint),
        "--served-model-name",
        MODEL_NAME,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enable-return-routed-experts",
        "--enable-prefix-caching",
        "--worker-extension-cls",
        "serving.vllm_ext.UndertowWorkerExtension",
        "--middleware",
        "serving.engine_auth.ControlAuth",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]


def vllm_env(store: Path, version: str, batch_invariant: bool, public_key: Path | None = None) -> dict[str, str]:
    """The environment ``vllm serve`` needs for the worker extension and the RPCs (the control token,
    ``UNDERTOW_SERVING__FLEET__CONTROL_TOKEN``, is a secret: it is added where the server starts)."""
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_BATCH_INVARIANT": "1" if batch_invariant else "0",
        "UNDERTOW_WEIGHTS_STORE": str(store),
        "UNDERTOW_WEIGHTS_VERSION": version,
    }
    if public_key is not None:
        env["UNDERTOW_WEIGHTS_PUBLIC_KEY"] = str(public_key)
    return env


def checkpoint_report(path: Path) -> dict[str, Any]:
    """What a loader of a Hugging Face checkpoint needs, checked; raises ValueError naming what is missing."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} has no config.json; save checkpoints with policy.model.save_checkpoint")
    config = json.loads(config_file.read_text())
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    tokenizer_config = path / "tokenizer_config.json"
    template = (path / "chat_template.jinja").exists() or (
        tokenizer_config.exists() and bool(json.loads(tokenizer_config.read_text()).get("chat_template"))
    )
    missing = [
        name
        for name, ok in (
            ("architectures in config.json", bool(config.get("architectures"))),
            ("*.safetensors weights", bool(weights)),
            ("tokenizer.json", (path / "tokenizer.json").exists()),
            ("a chat template (chat_template.jinja or tokenizer_config.json)", template),
        )
        if not ok
    ]
    if missing:
        raise ValueError(f"{path} is not a checkpoint vLLM loads: it lacks {', '.join(missing)}")
    return {
        "path": str(path),
        "architectures": config["architectures"],
        "model_type": config.get("model_type"),
        "num_experts": config.get("num_experts"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "weights": weights,
    }


def _v0(cfg: CheckConfig, workdir: Path) -> Path:
    if cfg.checkpoint is not None:
        return cfg.checkpoint
    from policy.model import save_checkpoint
    from policy.sft import SFTConfig, warmup

    model, tokenizer, _ = warmup(SFTConfig(preset="tiny", seed=cfg.seed, steps=cfg.sft_steps))
    return save_checkpoint(model, tokenizer, workdir / "v0")


class _Server:
    """The server under test: ``vllm serve`` or the CPU engine, with the same HTTP contract."""

    def __init__(
        self,
        cfg: CheckConfig,
        checkpoint: Path,
        store: Path,
        workdir: Path,
        batch_invariant: bool,
        public_key: Path,
        token: str,
    ) -> None:
        from serving.launch import EngineProcess, free_port

        self.backend = cfg.backend
        self.port = free_port()
        self.log_path = workdir / f"server-{'bi' if batch_invariant else 'plain'}.log"
        self.engine: EngineProcess | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.command = vllm_command(checkpoint, self.port, cfg.dtype)
        self.env = vllm_env(store, "v0", batch_invariant, public_key)
        self.token = token
        if cfg.backend == "cpu":
            self.engine = EngineProcess(
                checkpoint,
                "v0",
                store,
                port=self.port,
                log_path=self.log_path,
                control_token=token,
                public_key=public_key,
            )
        self.timeout_s = cfg.ready_timeout_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> _Server:
        if self.engine is not None:
            self.engine.start().wait_ready(self.timeout_s)
            return self
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, TOKEN_ENV: self.token},
                start_new_session=True,
            )
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready in {self.timeout_s}s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class _Capture:
    """A telemetry emitter that keeps the gateway's events in memory."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.stats: dict[str, int] = {"sent": 0}

    def admits(self, kind: str) -> bool:
        return True  # memory is never full here

    def emit(self, event: dict[str, Any]) -> bool:
        self.events.append(event)
        self.stats["sent"] += 1
        return True

    def snapshot(self) -> dict[str, int]:
        return dict(self.stats)

    def close(self) -> None:
        return None


@contextmanager
def _gateway(url: str) -> Iterator[tuple[str, _Capture]]:
    from serving.config import GatewayConfig
    from serving.gateway import Gateway, create_gateway_app, static_replicas
    from serving.launch import ServerThread

    capture = _Capture()
    gateway = Gateway(
        static_replicas([url], "v0"),
        capture,  # type: ignore[arg-type]
        GatewayConfig(require_keys=False, max_prompt_chars=8000),
        MODEL_NAME,
    )
    with ServerThread(create_gateway_app(gateway)) as server:
        yield server.url, capture


def _sessions(cfg: CheckConfig, url: str, tag: str, count: int) -> tuple[Phase, list[dict[str, Any]], dict[str, float]]:
    """Run ``count`` harness sessions on held-out tasks through a gateway before ``url``."""
    from policy.agent import gateway_client, run_session
    from policy.tasks import heldout_eval_set

    tasks = heldout_eval_set()
    phase = Phase()
    rewards: dict[str, float] = {}
    with _gateway(url) as (gateway_url, capture):

        def one(i: int) -> Any:
            with gateway_client(gateway_url, timeout_s=300) as client:
                return run_session(
                    client,
                    tasks[(i * 7) % len(tasks)],
                    model=MODEL_NAME,
                    session_id=f"gpu-check-{tag}-{i}",
                    max_turns=cfg.max_turns,
                    context_budget_chars=cfg.context_budget_chars,
                    max_tokens=cfg.max_tokens,
                    summary_max_tokens=cfg.max_tokens,
                    temperature=1.0,
                    seed=cfg.seed * 1000 + i,
                    system_prompt="Coding agent.",
                    tools=SHORT_TOOLS,
                )

        with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
            results = list(pool.map(one, range(count)))
        deadline = time.monotonic() + 10
        while len(capture.events) < sum(r.requests for r in results) and time.monotonic() < deadline:
            time.sleep(0.05)
    for r in results:
        phase.sessions += 1
        phase.turns += r.turns
        phase.summaries += r.summaries
        phase.tool_calls += r.tool_calls_ok + r.tool_calls_malformed
        if r.error:
            phase.errors.append(r.error[:300])
        rewards[r.session_id] = r.reward
    return phase, capture.events, rewards


def served_model(
    checkpoint: Path, store_dir: Path | None = None, version: str | None = None, public_key: Path | None = None
) -> Any:
    """The checkpoint's model on CPU in float32; with ``version``, updated to it from the store
    exactly as a server started from ``checkpoint`` is (:class:`serving.weights.WeightUpdater`:
    the store keeps the serving dtype, so the served weights are the trained ones rounded where
    the update touched them)."""
    import threading

    from policy.model import load_checkpoint
    from policy.weights import WeightStore
    from serving.params import ModelParams
    from serving.protocol import ApplyRequest, PrefetchRequest
    from serving.weights import WeightUpdater

    model, _ = load_checkpoint(checkpoint)
    if store_dir is not None and version is not None:
        updater = WeightUpdater(
            ModelParams(model, checkpoint, threading.Lock()),
            version="v0",
            store_url=str(store_dir),
            public_key=public_key,
        )
        updater.prefetch(PrefetchRequest(to_version=version, from_version="v0", kind="delta"))
        expected = WeightStore(store_dir).manifest(version).version_hash
        if updater.apply(ApplyRequest(to_version=version, expected_hash=expected)).hash != expected:
            raise RuntimeError(f"the trainer-side copy of {version} does not hash as the store's")
    return model


def logprob_gap(model: Any, events: list[dict[str, Any]], *, replay: bool) -> Gap:
    """The trainer's forward pass (CPU, float32) against the served logprobs of every served token."""
    from ingest.arrays import npy_from_b64
    from policy.forward import score_tokens

    gap = Gap()
    diffs: list[np.ndarray] = []
    for event in events:
        payload = event["payload"]
        segment = payload["segments"][0]
        prompt, generated = payload["prompt"].get("token_ids") or [], segment.get("token_ids") or []
        served = segment.get("logprobs")
        if not prompt or not generated or served is None or len(served) != len(generated):
            continue
        experts = npy_from_b64(payload["routed_experts"]) if payload.get("routed_experts") else None
        gap.turns_with_experts += experts is not None
        scored = score_tokens(
            model, prompt + generated, prompt_len=len(prompt), routed_experts=experts if replay else None
        )
        diffs.append(np.abs(scored.logprobs.astype(np.float64) - np.asarray(served, dtype=np.float64)))
    if diffs:
        joined = np.concatenate(diffs)
        gap.tokens, gap.max_abs, gap.mean_abs = int(joined.size), float(joined.max()), float(joined.mean())
    return gap


def _train_v1(v0: Path, events: list[dict[str, Any]], rewards: dict[str, float], workdir: Path) -> tuple[Path, dict]:
    """One REINFORCE step from v0 on the served sessions as trajectories, through the ingest writer."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session, selectinload

    from ingest.db import make_engine, transaction, upgrade
    from ingest.schemas import validate_event
    from ingest.tables import SessionRow
    from ingest.writer import write_events
    from policy.advantages import RunningBaseline
    from policy.distributed import on_cpu, place, train_device
    from policy.model import load_checkpoint, save_checkpoint
    from policy.trainer import TrainConfig, make_optimizer, update_step
    from policy.trajectories import session_trajectories, turn_of

    url = f"sqlite:///{workdir / 'telemetry.db'}"
    upgrade(url)
    engine = make_engine(url)
    with transaction(engine) as db:
        write_events(db, [validate_event(e) for e in events])
    with Session(engine) as db:
        rows = list(db.scalars(select(SessionRow).options(selectinload(SessionRow.segments))))
        rollouts, stats = session_trajectories(
            rows, lambda r: rewards.get(str((turn_of(r) or {}).get("session_id"))), max_tokens=4096
        )
    engine.dispose()
    model, tokenizer = load_checkpoint(v0)
    device = train_device("auto")  # the GPU when there is one (bf16 autocast, packed rows), else the CPU
    place(model, device)
    cfg = TrainConfig(lr=1e-3, steps=1, advantage="reinforce", pack_tokens=4096, pack_rows=8)
    metrics = update_step(model, make_optimizer(model, cfg), rollouts, cfg, baseline=RunningBaseline(default=0.5))
    path = save_checkpoint(on_cpu(model), tokenizer, workdir / "v1")
    return path, {
        "trajectories": asdict(stats),
        "trained_tokens": metrics["batch/trained_tokens"],
        "device": str(device),
        "bf16_autocast": device.type == "cuda",
        "step_gap_max_abs_logprob": metrics["gap/max_abs_logprob"],
    }


def _apply_delta(url: str, expected_hash: str, token: str) -> dict[str, Any]:
    from serving.client import EngineClient
    from serving.protocol import ApplyRequest, PrefetchRequest

    async def go() -> dict[str, Any]:
        async with EngineClient(url, timeout_s=600, token=token) as client:
            started = time.monotonic()
            pulled = await client.prefetch(PrefetchRequest(to_version="v1", from_version="v0", kind="delta"))
            await client.pause()
            try:
                info = await client.apply(ApplyRequest(to_version="v1", expected_hash=expected_hash))
            finally:
                await client.resume()
            return {
                "prefetch": pulled,
                "version": info.version,
                "hash": info.hash,
                "kind": info.kind,
                "hash_matches": info.hash == expected_hash,
                "seconds": round(time.monotonic() - started, 3),
            }

    return asyncio.run(go())


def run_check(cfg: CheckConfig) -> dict[str, Any]:
    """Every step of the module docstring; returns the figures as one JSON-able object."""
    from policy.checker import require_sandbox
    from policy.weights import SigningKey, WeightStore

    started = time.monotonic()
    require_sandbox()  # the harness's tools run candidates in the checker's sandbox
    if cfg.backend == "vllm" and shutil.which("vllm") is None:
        raise RuntimeError("vllm is not installed; install the extra (pip install -e '.[vllm]') or use --dry-run")
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"backend": cfg.backend, "dry_run": cfg.backend == "cpu"}
    v0 = _v0(cfg, workdir)
    out["checkpoint"] = checkpoint_report(v0)
    store_dir = Path(tempfile.mkdtemp(prefix="store-", dir=workdir))
    keys = Path(tempfile.mkdtemp(prefix="keys-", dir=workdir))
    public_key, token = keys / "weights.pub", secrets.token_urlsafe(32)
    store = WeightStore(store_dir, signer=SigningKey(keys / "weights.pem", public_key))
    store.put(v0, version="v0", full=True)

    with _Server(cfg, v0, store_dir, workdir, False, public_key, token) as server:
        out["vllm_command"], out["vllm_env"] = server.command, server.env
        plain, events, rewards = _sessions(cfg, server.url, "plain", cfg.sessions)
        model_v0 = served_model(v0)
        plain.replay = logprob_gap(model_v0, events, replay=True)
        plain.no_replay = logprob_gap(model_v0, events, replay=False)
        v1, trained = _train_v1(v0, events, rewards, workdir)
        manifest = store.put(v1, version="v1", parent="v0")
        out["train"] = {**trained, "delta_bytes": manifest.delta.bytes if manifest.delta is not None else None}
        out["delta"] = _apply_delta(server.url, manifest.version_hash, token)
        after, after_events, _ = _sessions(cfg, server.url, "after", 1)
        model_v1 = served_model(v0, store_dir, "v1", public_key)
        after.replay = logprob_gap(model_v1, after_events, replay=True)
        after.no_replay = logprob_gap(model_v1, after_events, replay=False)
    with _Server(cfg, v0, store_dir, workdir, True, public_key, token) as server:
        invariant, events, _ = _sessions(cfg, server.url, "invariant", cfg.sessions)
        invariant.replay = logprob_gap(model_v0, events, replay=True)
        invariant.no_replay = logprob_gap(model_v0, events, replay=False)
    phases = {"batch_invariant_off": plain, "batch_invariant_on": invariant, "after_delta": after}
    out["phases"] = {name: asdict(phase) for name, phase in phases.items()}
    turns = plain.turns + invariant.turns + after.turns
    count = plain.sessions + invariant.sessions + after.sessions
    out["mean_turns"] = round(turns / count, 2) if count else 0.0
    out["ok"] = bool(out["delta"]["hash_matches"]) and not any(p.errors for p in phases.values())
    out["seconds"] = round(time.monotonic() - started, 1)
    return out
