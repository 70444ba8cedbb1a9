"""The demo's services, started and stopped as one unit on one machine.

- the embedded stack (:class:`scheduler.runtime.embedded.EmbeddedStack`): Kafka (Tansu), the migrated SQLite
  database and the ingest consumer thread;
- policy v0 (cached under the Undertow home: trained by warm-up once, reused by later runs),
  recorded as ``v0000`` and put in the weight store as the first full snapshot;
- ``replicas`` CPU engine processes serving v0 from the store, registered in the fleet registry,
  with the pool's target set to v0;
- the gateway (registry balancing, health checks, telemetry to Kafka) and the control-plane API with
  its dashboards, each under uvicorn in a thread;
- a Celery worker subprocess (``--pool=solo``) on the SQLAlchemy broker in the same database.

Every child process inherits the demo's ``UNDERTOW_*`` environment, so the worker, the engines and
this process read the same settings.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from policy.sft import Mixes
    from scheduler.settings import Settings

log = structlog.get_logger(__name__)
V0_ID = "v0000"


def v0_cache(
    settings: Settings,
    cache_root: Path,
    *,
    sft_steps: int,
    eval_cfg: Any,
    agent_every: int = 0,
    mixes: Mixes | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The cached v0 checkpoint and its held-out metrics; trained (warm-up, every ``agent_every``-th
    step on agent transcripts, the corpus mixed per ``mixes``, None: :data:`policy.sft.MIXES`) and
    evaluated when missing."""
    from policy.evaluate import evaluate
    from policy.model import PRESETS_REVISION, save_checkpoint
    from policy.sft import MIXES, SFTConfig, warmup
    from policy.tokenizer import REVISION

    cfg = settings.policy
    key = (
        f"v0-{cfg.preset}-seed{cfg.seed}-sft{sft_steps}a{agent_every}"
        f"-eval{eval_cfg.per_tier}x{eval_cfg.samples_per_task}a{eval_cfg.agent_per_tier}x{eval_cfg.agent_samples}"
        f"-tok{REVISION}-m{PRESETS_REVISION}"
    )
    if mixes is not None and dict(mixes) != MIXES:  # the default mix keeps the default's key
        mix = json.dumps(sorted((int(k), list(v)) for k, v in mixes.items()))
        key += "-mix" + hashlib.sha256(mix.encode()).hexdigest()[:8]
    path = cache_root / key
    meta = path / "demo_metrics.json"
    if meta.exists():
        return path, json.loads(meta.read_text())
    import torch

    threads = torch.get_num_threads()
    # the warm-up runs before the stack starts: every core is free for it
    torch.set_num_threads(max(cfg.threads, os.cpu_count() or 1))
    log.info("demo.v0_warmup", steps=sft_steps, cache=str(path))
    sft = SFTConfig(preset=cfg.preset, seed=cfg.seed, steps=sft_steps, agent_every=agent_every, mixes=mixes)
    try:
        model, tokenizer, metrics = warmup(sft)
        metrics.update(evaluate(model, tokenizer, eval_cfg))
    finally:
        torch.set_num_threads(threads)
    tmp = cache_root / (key + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tokenizer, tmp)
    (tmp / "demo_metrics.json").write_text(json.dumps(metrics))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path, metrics


class CeleryWorker:
    """``celery -A scheduler.loop.app worker --pool=solo`` in its own process group."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryWorker:
        cmd = [sys.executable, "-m", "celery", "-A", "scheduler.loop.app", "worker", "--pool=solo"]
        cmd += ["--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", "demo@%h"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "ready." in self.log_path.read_text(errors="replace"):
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the Celery worker exited; see {self.log_path}")
            time.sleep(0.3)
        raise TimeoutError(f"the Celery worker was not ready in {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class DemoStack:
    """Everything the demo runs (see the module docstring); ``stop()`` ends what it started."""

    def __init__(self, settings: Settings, v0_path: Path, v0_metrics: dict[str, Any], replicas: int = 3) -> None:
        self.settings = settings
        self.v0_path = v0_path
        self.v0_metrics = v0_metrics
        self.n_replicas = replicas
        self.logs = settings.home / "logs"
        self.engines: list[Any] = []
        self.servers: list[Any] = []
        self.worker: CeleryWorker | None = None
        self.embedded: Any = None
        self.gateway: Any = None
        self.gateway_url = ""
        self.api_url = ""
        self.api_token = ""
        self.gateway_key = ""
        self.v0_hash = ""

    @property
    def engine(self) -> Any:
        return self.embedded.engine

    def store_url(self) -> str:
        """Where the weight store is (``policy.weights_url``, resolved against the home)."""
        from policy.weights import resolve_store_url

        return resolve_store_url(self.settings.policy.weights_url, self.settings.home)

    def start(self) -> DemoStack:
        from ingest.db import transaction  # noqa: F401  (database modules load before the threads start)
        from policy.versions import record_version
        from policy.weights import open_store
        from scheduler.runtime.embedded import EmbeddedStack
        from serving import fleet
        from serving.launch import start_engines

        self.logs.mkdir(parents=True, exist_ok=True)
        self.embedded = EmbeddedStack(self.settings).start()
        self.embedded.start_ingest()
        metrics = {k: v for k, v in self.v0_metrics.items() if isinstance(v, int | float)}
        record_version(self.engine, version=V0_ID, parent=None, step=0, checkpoint_path=self.v0_path, metrics=metrics)
        store = open_store(self.settings.policy, self.settings.home)
        self.v0_hash = store.put(self.v0_path, version=V0_ID, full=True).version_hash
        fleet.set_target(self.engine, V0_ID, self.v0_hash)
        self.worker = CeleryWorker(self.logs / "worker.log").start()
        self.engines = start_engines(
            self.v0_path, self.n_replicas, store=self.store_url(), version=V0_ID, log_dir=self.logs
        )
        for i, proc in enumerate(self.engines):
            fleet.register_replica(self.engine, f"r{i}", proc.url)
        asyncio.run(fleet.check_fleet(self.engine, self.settings.serving.fleet))
        self._start_gateway()
        self._start_api()
        self.worker.wait_ready()
        log.info("demo.stack_ready", gateway=self.gateway_url, api=self.api_url, replicas=len(self.engines))
        return self

    def _start_gateway(self) -> None:
        from scheduler.runtime.gateway import gateway_emitter, gateway_keys
        from serving.gateway import Gateway, create_gateway_app, health_loop, registry_source
        from serving.keys import create_key
        from serving.launch import ServerThread

        cfg = self.settings.serving
        emitter = gateway_emitter(self.settings, self.embedded.bootstrap)
        source = registry_source(self.engine, "default", cfg.gateway.fleet_refresh_s)
        keys = gateway_keys(self.settings, self.engine) if cfg.gateway.require_keys else None
        _row, self.gateway_key = create_key(self.engine, f"demo-developers-{uuid.uuid4().hex[:8]}")
        self.gateway = Gateway(source, emitter, cfg.gateway, cfg.engine.served_model_name, keys)
        app = create_gateway_app(self.gateway, [health_loop(self.engine, cfg.fleet, "default")])
        server = ServerThread(app, port=cfg.gateway_port).__enter__()
        self.servers.append(server)
        self.gateway_url = server.url

    def _start_api(self) -> None:
        from scheduler.api.app import create_app
        from scheduler.api.auth import create_token
        from serving.launch import ServerThread

        _row, self.api_token = create_token(self.engine, "demo-operator", "operator")
        server = ServerThread(create_app(self.settings, self.engine), port=self.settings.api.port).__enter__()
        self.servers.append(server)
        self.api_url = server.url

    def stop(self) -> None:
        """Stop everything this stack started, newest first."""
        for server in reversed(self.servers):
            server.__exit__(None, None, None)
        self.servers = []
        if self.worker is not None:
            self.worker.stop()
        for proc in self.engines:
            proc.stop()
        if self.embedded is not None:
            self.embedded.stop()
