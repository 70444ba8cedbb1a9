"""Helpers of the scheduler tests. Test doubles for the two things the scheduler drives but does
not own, importable by a real Celery worker (its ``PYTHONPATH`` includes this directory):

- ``FileFleet``: a fleet whose replicas live in a JSON file under the Undertow home, so the
  worker process and the test see the same state; it records every call in order;
- ``ToyTrainer``: a real, deterministic torch training loop (a small MLP regression), checkpointed
  with ``torch.save``; its weights digest tells whether a preempted run ended where an
  uninterrupted one does.

and the means to run one: ``make_env`` (a scheduler home on SQLite wired to those two doubles)
and ``Worker`` (a real ``celery`` worker subprocess), used by ``conftest.py`` and the tests of
``loop/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


class FileFleet:
    """Replicas ``r0..rN`` of one pool, state in ``<home>/fleet.json``."""

    def __init__(self, home: Path) -> None:
        self.path = Path(home) / "fleet.json"

    @staticmethod
    def create(home: Path, n: int = 4, pool: str = "default", load_rps: float = 50.0) -> FileFleet:
        fleet = FileFleet(home)
        state = {
            "replicas": {f"r{i}": {"pool": pool, "state": "serving", "version": "v1"} for i in range(n)},
            "calls": [],
            "load_rps": load_rps,
            "target_version": "v1",
        }
        fleet.path.write_text(json.dumps(state))
        return fleet

    @contextmanager
    def _edit(self) -> Any:
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(self.path.read_text())
            yield state
            self.path.write_text(json.dumps(state))

    def read(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())

    def _move(self, replica_id: str, call: str, state: str) -> None:
        with self._edit() as s:
            s["replicas"][replica_id]["state"] = state
            s["calls"].append([call, replica_id, time.time()])

    def replicas(self, pool: str) -> list[str]:
        return sorted(r for r, v in self.read()["replicas"].items() if v["pool"] == pool)

    def drain(self, replica_id: str) -> None:
        self._move(replica_id, "drain", "drained")

    def sleep(self, replica_id: str) -> None:
        self._move(replica_id, "sleep", "asleep")

    def wake(self, replica_id: str) -> None:
        self._move(replica_id, "wake", "awake")

    def verify(self, replica_id: str) -> str:
        return str(self.read()["replicas"][replica_id]["version"])

    def rejoin(self, replica_id: str) -> None:
        self._move(replica_id, "rejoin", "serving")

    def serving_version(self, pool: str) -> str:
        return str(self.read()["target_version"])

    def capacity_rps(self, pool: str) -> float:
        return 100.0

    def load_history(self, pool: str, window_s: int) -> np.ndarray:
        wpd = 86400 // window_s
        t = np.arange(2 * wpd)
        base = self.read()["load_rps"]
        return base * (1.0 + 0.2 * np.sin(2 * np.pi * t / wpd))


def fleet(settings: Any) -> FileFleet:
    return FileFleet(settings.home)


class ToyTrainer:
    """``steps`` SGD steps on a seeded regression task; each step's batch depends only on its index."""

    def __init__(self, steps: int = 20, step_sleep_s: float = 0.0, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.total = steps
        self.sleep = step_sleep_s
        self.seed = seed
        self.i = 0

    @property
    def done(self) -> bool:
        return self.i >= self.total

    def step(self) -> dict[str, float]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.i)
        x = torch.randn(32, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.i += 1
        if self.sleep:
            time.sleep(self.sleep)
        return {"loss/mse": float(loss.detach())}

    def save(self, path: Path) -> None:
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "i": self.i}, path)

    def load(self, path: Path) -> None:
        data = torch.load(path, weights_only=True)
        self.model.load_state_dict(data["model"])
        self.opt.load_state_dict(data["opt"])
        self.i = int(data["i"])

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.model.state_dict().values():
            h.update(t.detach().numpy().tobytes())
        return h.hexdigest()

    def result(self) -> dict[str, Any]:
        digest = self.digest()
        return {
            "version": f"toy-{digest[:12]}",
            "checkpoint": f"toy-{digest[:12]}",
            "metrics": {"weights_sha256": digest, "steps": self.i},
        }


def trainer(settings: Any, state: Any) -> ToyTrainer:
    """The ``scheduler.rl_trainer`` override: steps from the job, sleep and seed from ``rl.extra``."""
    torch.set_num_threads(1)
    extra = state.rl.extra
    return ToyTrainer(state.rl.steps or 20, float(extra.get("step_sleep_s", 0.0)), int(extra.get("seed", 0)))


def settings_for(env: dict[str, str], **extra: Any) -> Any:
    """Settings as the worker sees them, built in the test process."""
    from scheduler.settings import Settings

    old = dict(os.environ)
    os.environ.update(env)
    try:
        return Settings(**extra)
    finally:
        os.environ.clear()
        os.environ.update(old)


def wait_for(pred: Callable[[], Any], timeout: float = 60.0, every: float = 0.2, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")


def make_env(root: Path, url: str | None = None) -> dict[str, str]:
    """Environment of a scheduler home wired to the test fleet and trainer (the two override points), on
    the database ``url`` (default: a SQLite file in the home; the broker is the SQLAlchemy transport on it)."""
    from ingest.db import upgrade

    home = root / "home"
    home.mkdir()
    url = url or f"sqlite:///{home / 'undertow.db'}"
    upgrade(url)
    FileFleet.create(home)
    env = {
        "UNDERTOW_HOME": str(home),
        "UNDERTOW_DATABASE_URL": url,
        "UNDERTOW_SCHEDULER__FLEET_CONTROL": "scheduler_helpers:fleet",
        "UNDERTOW_SCHEDULER__RL_TRAINER": "scheduler_helpers:trainer",
        "UNDERTOW_SCHEDULER__JOB_HEARTBEAT_S": "0.5",
        "UNDERTOW_SCHEDULER__JOB_LOST_AFTER_S": "4",
        "UNDERTOW_SCHEDULER__LEASE_TTL_S": "3",
        "UNDERTOW_SCHEDULER__PREEMPT_RESUME_S": "0.5",
        "UNDERTOW_SCHEDULER__CHECKPOINT_EVERY_STEPS": "5",
        "UNDERTOW_LOG_LEVEL": "WARNING",
    }
    return env


class Worker:
    """A ``celery -A scheduler.loop.app worker --pool=solo`` subprocess in its own process group."""

    def __init__(self, env: dict[str, str], log: Path, name: str, queues: str = "celery") -> None:
        full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "scheduler.loop.app",
                "worker",
                "--pool=solo",
                "--loglevel=INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-n",
                f"{name}@%h",
                "-Q",
                queues,
            ],
            env=full,
            cwd=str(log.parent),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if "ready." in self.log.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"worker not ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
