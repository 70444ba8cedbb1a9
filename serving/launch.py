"""Start CPU engine replicas as separate processes (``undertow engine serve``) and wait for them.

Used by the tests, the benchmark and the demo's stack launcher; each replica loads a checkpoint
directory and pulls updates from a weight store. A replica inherits this process's ``UNDERTOW_*``
environment; ``control_token`` and ``public_key``, when given, override the settings it would read
there (``serving.fleet.control_token``, ``policy.weights.public_key``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ingest.embedded import free_port, free_ports


@dataclass
class EngineProcess:
    """One ``undertow engine serve`` process on a loopback port."""

    checkpoint: Path
    version: str = "v0"
    store: str | Path | None = None
    """Weight store: a directory or any store URL (``http://host:port/`` from ``undertow weights serve``)."""
    port: int = 0
    log_path: Path | None = None
    threads: int = 1
    control_token: str | None = None
    """The token its control routes require."""
    public_key: Path | None = None
    """The public keys the versions it pulls must be signed by."""
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        """Spawn the process (returns at once; call :meth:`wait_ready`)."""
        self.port = self.port or free_port()
        cmd = [
            sys.executable,
            "-m",
            "scheduler.cli",
            "engine",
            "serve",
            "--checkpoint",
            str(self.checkpoint),
            "--version",
            self.version,
            "--port",
            str(self.port),
        ]
        if self.store is not None:
            cmd += ["--store", str(self.store)]
        env = {
            **os.environ,
            "UNDERTOW_SERVING__ENGINE__THREADS": str(self.threads),
            "OMP_NUM_THREADS": str(self.threads),
        }
        if self.control_token is not None:
            env["UNDERTOW_SERVING__FLEET__CONTROL_TOKEN"] = self.control_token
        if self.public_key is not None:
            env["UNDERTOW_POLICY__WEIGHTS__PUBLIC_KEY"] = str(Path(self.public_key).resolve())
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> EngineProcess:
        """Block until ``/health`` answers, or raise with the exit code."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"engine on port {self.port} exited with code {self.process.returncode}; see {self.log_path}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200 and self.process.poll() is None:
                    return self  # answered, and by a live process of ours (not another on the same port)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine on port {self.port} not ready in {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL (fault tests)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


def start_engines(
    checkpoint: Path,
    n: int,
    *,
    store: str | Path | None,
    version: str = "v0",
    log_dir: Path | None = None,
    control_token: str | None = None,
    public_key: Path | None = None,
) -> list[EngineProcess]:
    """Start ``n`` replicas in parallel (on ``n`` distinct ports) and wait for all of them."""
    ports = free_ports(n)
    procs = [
        EngineProcess(
            checkpoint,
            version,
            store,
            port=ports[i],
            log_path=(log_dir / f"engine-{i}.log") if log_dir else None,
            control_token=control_token,
            public_key=public_key,
        ).start()
        for i in range(n)
    ]
    try:
        for p in procs:
            p.wait_ready()
    except Exception:
        for p in procs:
            p.kill()
        raise
    return procs


class ServerThread:
    """An ASGI app (the gateway) under uvicorn in a background thread on a free loopback port."""

    def __init__(self, app: object, port: int = 0) -> None:
        import threading

        import uvicorn

        self.port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} failed to start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
