"""Sandboxed checker: runs candidate function bodies against hidden tests in a subprocess.

Isolation, in layers (each cheap, none trusted alone):

- a separate ``python -I -S`` process (isolated mode, no site) with a minimal environment, in
  a fresh scratch directory that is deleted afterwards;
- resource limits set before ``exec``: address space (``RLIMIT_AS``), CPU seconds
  (``RLIMIT_CPU``), file size (``RLIMIT_FSIZE``), open files; a wall-clock timeout on top;
- no network: inside a new network namespace (``unshare -rn``) when the kernel allows it, and in
  any case the ``socket`` module is removed before candidate code runs;
- a per-candidate time limit (``setitimer``); a candidate that kills or hangs its process only
  fails itself: results stream back one line at a time, and the remaining candidates go to a
  fresh process.

Many candidates are checked in one process (one interpreter start for a whole RL batch).
Each result reports pass/fail, the number of tests passed, the body's size in characters and
whether it is *kept* (passes and fits the task's size limit).
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache

from policy.tasks import Task

MAX_BODY_CHARS = 4096

_HARNESS = r"""
import json, os, signal, sys
fd = os.dup(1)
out = os.fdopen(fd, "w")
sys.stdout = open(os.devnull, "w")
sys.stderr = open(os.devnull, "w")
sys.modules["socket"] = None
sys.modules["_socket"] = None
nonce = sys.argv[1]
per = float(sys.argv[2])
class Timeout(BaseException):
    pass
def alarm(*_):
    raise Timeout()
signal.signal(signal.SIGALRM, alarm)
jobs = json.loads(sys.stdin.read())
for job in jobs:
    passed = 0
    signal.setitimer(signal.ITIMER_REAL, per)
    try:
        ns = {"__builtins__": __builtins__}
        exec(compile(job["code"], "<candidate>", "exec"), ns)
        fn = ns["f"]
        for args, expected in job["tests"]:
            if fn(*args) == expected:
                passed += 1
    except BaseException:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    out.write(nonce + json.dumps(passed) + "\n")
    out.flush()
"""


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one candidate."""

    passed: bool
    """Every hidden test passed."""
    tests_passed: int
    """How many hidden tests passed."""
    size: int
    """Body size in characters (trailing whitespace stripped)."""
    kept: bool
    """Passed and ``size <= task.size_limit`` (pass-and-keep)."""


@dataclass(frozen=True)
class Limits:
    """Sandbox limits for one checker process."""

    per_candidate_s: float = 1.0
    """Wall-clock budget of one candidate (setitimer)."""
    wall_s: float = 60.0
    """Wall-clock budget of one checker process."""
    cpu_s: int = 60
    """RLIMIT_CPU of one checker process."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS of one checker process."""


@cache
def _can_unshare() -> bool:
    exe = shutil.which("unshare")
    if exe is None:
        return False
    probe = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10, check=False)
    return probe.returncode == 0


def _preexec(limits: Limits) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()


def body_size(body: str) -> int:
    """Characters of a body, trailing whitespace stripped (what "concise" is measured on)."""
    return len(body.rstrip())


def _run_batch(jobs: list[dict[str, object]], limits: Limits) -> list[int]:
    """Run jobs in one sandboxed process; returns tests passed for the prefix that finished."""
    nonce = secrets.token_hex(8)
    cmd = [sys.executable, "-I", "-S", "-c", _HARNESS, nonce, str(limits.per_candidate_s)]
    if _can_unshare():
        cmd = [str(shutil.which("unshare")), "-rn", *cmd]
    with tempfile.TemporaryDirectory(prefix="undertow-check-") as scratch:
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "PYTHONHASHSEED": "0"}
        try:
            proc = subprocess.run(
                cmd,
                input=json.dumps(jobs).encode(),
                capture_output=True,
                cwd=scratch,
                env=env,
                timeout=limits.wall_s,
                preexec_fn=lambda: _preexec(limits),
                check=False,
            )
            stdout = proc.stdout
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout or b""
    results = []
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(nonce):
            results.append(int(line[len(nonce) :]))
    return results[: len(jobs)]


def check_many(items: list[tuple[Task, str]], limits: Limits | None = None) -> list[CheckResult]:
    """Check ``(task, body)`` pairs, in order; a body is the code under ``task.signature``."""
    limits = limits or Limits()
    jobs: list[dict[str, object]] = []
    for task, body in items:
        code = f"{task.signature}\n{body[:MAX_BODY_CHARS]}" if len(body) <= MAX_BODY_CHARS else "raise SystemExit"
        jobs.append({"code": code, "tests": [[list(a), e] for a, e in task.tests]})
    passed: list[int] = []
    while len(passed) < len(jobs):
        chunk = _run_batch(jobs[len(passed) :], limits)
        passed += chunk
        if len(passed) < len(jobs):
            passed.append(0)  # the candidate that crashed or hung its process fails alone
    out = []
    for (task, body), n in zip(items, passed, strict=True):
        ok = n == len(task.tests)
        size = body_size(body)
        out.append(CheckResult(passed=ok, tests_passed=n, size=size, kept=ok and size <= task.size_limit))
    return out


def check(task: Task, body: str, limits: Limits | None = None) -> CheckResult:
    """Check one candidate body."""
    return check_many([(task, body)], limits)[0]
