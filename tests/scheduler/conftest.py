"""Fixtures for the scheduler tests: a migrated SQLite home and real Celery worker subprocesses
(``Worker`` and ``make_env`` live in ``scheduler_helpers``, importable by the test modules)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from scheduler_helpers import REPO, Worker, make_env

# The API end-to-end tests build weight versions and seed telemetry with the serving and API tests' helpers.
sys.path += [str(REPO / "tests" / "serving"), str(REPO / "tests" / "scheduler" / "api")]


@pytest.fixture
def sched_env(tmp_path: Path) -> dict[str, str]:
    """A fresh scheduler home of the test's own."""
    return make_env(tmp_path)


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
