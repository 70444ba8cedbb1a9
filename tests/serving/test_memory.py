"""Staging memory reserved at engine start: after :func:`serving.memory.reserve` on a thread whose
process keeps freed memory, that thread's next staging allocations fault (almost) no pages in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from serving.memory import reserve

_PROBE = """
import json, resource, sys
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from serving.memory import reserve, retain_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def stage():  # an update's staging: many per-tensor arrays kept, a scratch buffer, one large cast
    kept = [(np.ones(40_000, dtype=np.int64), np.ones(40_000, dtype=np.uint16)) for _ in range(150)]
    return kept, np.ones(4_000_000, dtype=np.float32)

thread = ThreadPoolExecutor(1)
if sys.argv[1] == "reserved":
    assert retain_freed_memory()
    thread.submit(reserve, 96 << 20).result()
start = faults()
thread.submit(stage).result()
print(json.dumps({"faults": faults() - start}))
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["faults"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator options")
def test_a_reserved_thread_stages_without_faulting_pages_in() -> None:
    plain, reserved = _faults("plain"), _faults("reserved")
    # About 25 MB of staging: thousands of pages fault in on a fresh thread, almost none once reserved.
    assert plain > 3000, plain
    assert reserved < plain // 10, (plain, reserved)


def test_reserve_touches_whole_blocks_and_nothing_for_nothing() -> None:
    assert reserve(0) == 0
    assert reserve(1) == 4 << 20
    assert reserve(9 << 20) == 12 << 20
