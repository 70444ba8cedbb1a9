"""Fixtures for the scheduler tests: a migrated SQLite home and real Celery worker subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The API end-to-end tests build weight versions and seed telemetry with the serving and API tests' helpers.
sys.path += [str(REPO / "tests" / "serving"), str(REPO / "tests" / "api")]


def make_env(root: Path) -> dict[str, str]:
    """Environment of a scheduler home on SQLite wired to the test fleet and trainer (the two override points)."""
    from ingest.db import upgrade

    home = root / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'undertow.db'}"
    upgrade(url)
    from sched_support import FileFleet

    FileFleet.create(home)
    env = {
        "UNDERTOW_HOME": str(home),
        "UNDERTOW_DATABASE_URL": url,
        "UNDERTOW_SCHEDULER__FLEET_CONTROL": "sched_support:fleet",
        "UNDERTOW_SCHEDULER__RL_TRAINER": "sched_support:trainer",
        "UNDERTOW_SCHEDULER__JOB_HEARTBEAT_S": "0.5",
        "UNDERTOW_SCHEDULER__JOB_LOST_AFTER_S": "4",
        "UNDERTOW_SCHEDULER__LEASE_TTL_S": "3",
        "UNDERTOW_SCHEDULER__PREEMPT_RESUME_S": "0.5",
        "UNDERTOW_SCHEDULER__CHECKPOINT_EVERY_STEPS": "5",
        "UNDERTOW_LOG_LEVEL": "WARNING",
    }
    return env


@pytest.fixture
def sched_env(tmp_path: Path) -> dict[str, str]:
    """A fresh scheduler home of the test's own."""
    return make_env(tmp_path)


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


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One scheduler home and one worker shared by the tests of a module (starting one costs seconds)."""
    root = tmp_path_factory.mktemp("shared")
    env = make_env(root)
    w = Worker(env, root / "shared.log", "shared")
    try:
        w.wait_ready()
        yield env
    finally:
        w.stop()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start real workers; every one started is stopped at teardown."""
    started: list[Worker] = []

    def start(env: dict[str, str], name: str = "w1", queues: str = "celery") -> Worker:
        w = Worker(env, tmp_path / f"{name}.log", name, queues)
        started.append(w)
        w.wait_ready()
        return w

    yield start
    for w in started:
        w.stop()
