"""Serving fixtures: a tiny checkpoint, a weight store with versions v0 -> v1 -> v2 (deltas both
ways and snapshots), and CPU engine processes on loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from serving_helpers import Versions, make_versions


@pytest.fixture(scope="session")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    """Checkpoint (v0) and store root with v0, v1, v2 and their hashes."""
    torch.set_num_threads(1)
    return make_versions(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def one_engine(versions: Versions, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One CPU engine process serving v0 with the store attached (control token: ``CONTROL_TOKEN``)."""
    procs = versions.start_engines(1, tmp_path_factory.mktemp("logs"))
    yield procs[0]
    for p in procs:
        p.kill()


def _unused(_: Path) -> None:
    return None
