"""Sandboxed checker: runs candidate function bodies against hidden tests; its verdict is the RL reward.

Trust is split in two. The *harness* (this module, in the calling process) holds the tests and
never touches an object a candidate made. The candidate runs in a sandbox that only receives the
test *inputs* and returns each call's result as JSON text; the harness parses that text (so it
only ever sees plain ``dict``/``list``/``str``/``int``/``float``/``bool``/``None``) and compares
it by value with the expected value normalized the same way (a JSON round trip: tuples become
lists on both sides; ``True`` is not ``1``). An object with a forged ``__eq__``, a frame walk
looking for ``expected`` or an ``import __main__`` finds nothing: the answers are not in the
sandbox.

The sandbox (see :mod:`policy.sandbox_init` for the inside) is one ``unshare`` process per
batch with new user, mount, pid, network, IPC and UTS namespaces, a fresh ``/proc`` and an empty
environment; inside it, every mount is read-only, ``/dev`` only has ``null``/``zero``/
``random``/``urandom``, a small tmpfs on ``/tmp`` is the only writable place, ``/root``,
``/home``, ``/run``, the repository and the Undertow home are hidden, and the init process drops
every capability. Its init forks one child per candidate (its own session, rlimits on address
space, CPU, file size, open files, processes and core, a private result pipe, ``/dev/null`` for
stdout and stderr) and, once the child is done or out of time, kills every other process in the
namespace and empties ``/tmp``, so a candidate can neither outlive its check nor touch another
candidate's. A candidate that breaks the init process only fails itself: the rest of the batch
goes to a fresh sandbox. ``Limits.wall_s`` bounds one sandbox process; ``per_candidate_s`` one
candidate.

There is no unsandboxed fallback: when ``unshare`` is missing or user namespaces cannot be
created, :func:`check_many` raises :class:`SandboxUnavailable` saying what to install or enable
(probed once per process).

Each result reports pass/fail, the number of tests passed, the body's size in characters,
whether it is *kept* (passes and fits the task's size limit) and a one-line reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from policy.tasks import Task

MAX_BODY_CHARS = 4096
UNSHARE_FLAGS = (
    "--user", "--map-root-user", "--mount", "--propagation", "private", "--pid", "--fork",
    "--kill-child", "--mount-proc", "--net", "--ipc", "--uts",
)  # fmt: skip
HIDDEN_DIRS = ("/root", "/home", "/run", "/var/run", "/var/tmp", "/mnt", "/media", "/srv")
"""Host directories covered by an empty read-only tmpfs inside the sandbox."""
_SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/tmp")
_PROJECT_PACKAGES = ("policy", "scheduler", "serving", "ingest", "reward_models")
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
_MAX_FRAME = 64 << 20


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; candidates are never run without it."""


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
    reason: str = ""
    """Why: "passed", "failed 3 of 8 tests", "timeout", "crashed", "body too long"..."""
    tests: int = 0
    """How many hidden tests the task has."""


@dataclass(frozen=True)
class Limits:
    """Sandbox limits."""

    per_candidate_s: float = 1.0
    """Wall-clock budget of one candidate (its process is killed then)."""
    wall_s: float = 60.0
    """Wall-clock budget of one sandbox process (a batch; what is left goes to a fresh one)."""
    cpu_s: int = 60
    """RLIMIT_CPU of the sandbox's init process (each candidate gets ``ceil(per_candidate_s) + 1``)."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS of the init process and of each candidate."""
    file_bytes: int = 1 << 20
    """RLIMIT_FSIZE of each candidate."""
    open_files: int = 64
    """RLIMIT_NOFILE of each candidate."""
    processes: int = 8
    """RLIMIT_NPROC of each candidate (counted inside the sandbox's user namespace, init included)."""
    scratch_bytes: int = 16 << 20
    """Size of the writable tmpfs on ``/tmp``."""
    output_bytes: int = 1 << 20
    """Most result bytes read from one candidate."""


def body_size(body: str) -> int:
    """Characters of a body, trailing whitespace stripped (what "concise" is measured on)."""
    return len(body.rstrip())


def _unshare_path() -> str | None:
    return shutil.which("unshare") or next(
        (p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None
    )


def _interpreter() -> str:
    """The real base interpreter (not a venv's symlink): the sandbox runs it with ``-I -S``, stdlib only."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@cache
def _init_source() -> str:
    return Path(__file__).with_name("sandbox_init.py").read_text(encoding="utf-8")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _views() -> dict[str, list[str]]:
    """What the sandbox hides (``masks``, ``late_masks``) and shows again (``expose``: the interpreter)."""
    interp = _interpreter()
    prefix = os.path.realpath(sys.base_prefix)
    expose = [prefix] + ([] if _under(interp, prefix) else [os.path.dirname(interp)])
    repo = Path(__file__).resolve().parents[1]
    candidates = [*HIDDEN_DIRS, str(repo), sys.prefix]
    with contextlib.suppress(OSError):  # the default Undertow home is relative to the working directory
        candidates.append(os.path.join(os.getcwd(), ".undertow"))
    if os.environ.get("UNDERTOW_HOME"):
        candidates.append(os.environ["UNDERTOW_HOME"])
    late = [str(repo / name) for name in _PROJECT_PACKAGES]
    masks: list[str] = []
    for raw in candidates:
        path = os.path.realpath(raw)
        if path == "/" or any(_under(path, s) or _under(s, path) for s in _SYSTEM_DIRS):
            continue
        if any(_under(path, e) for e in expose):
            late.append(path)
        else:
            masks.append(path)
    masks = sorted(set(masks), key=lambda p: (p.count("/"), p))
    masks = [m for m in masks if not any(_under(m, o) and m != o for o in masks)]
    return {"masks": masks, "expose": expose, "late_masks": sorted(set(late))}


def _unavailable(detail: str) -> SandboxUnavailable:
    hint = (
        "the checker runs candidates only inside a sandbox made with util-linux `unshare` "
        "(user, mount, pid and network namespaces); install util-linux and allow unprivileged "
        "user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 "
        "where it exists, and a container seccomp/AppArmor profile that permits unshare)"
    )
    return SandboxUnavailable(f"sandbox unavailable: {detail.strip()}; {hint}")


def _run_sandbox(jobs: list[dict[str, Any]], limits: Limits) -> tuple[list[dict[str, Any]], bool]:
    """Run jobs in one sandbox; returns the frames of the candidates that finished and whether time ran out."""
    unshare = _unshare_path()
    if unshare is None:
        raise _unavailable("the `unshare` command was not found")
    request = {"limits": asdict(limits), **_views(), "jobs": jobs}
    cmd = [unshare, *UNSHARE_FLAGS, _interpreter(), "-I", "-S", "-c", _init_source()]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_ENV,
        cwd="/",
        start_new_session=True,
        close_fds=True,
    )
    assert proc.stdin and proc.stdout and proc.stderr
    pending = memoryview(json.dumps(request).encode())
    buf, err = bytearray(), bytearray()
    frames: list[dict[str, Any]] = []
    ready = timed_out = False
    deadline = time.monotonic() + limits.wall_s
    sel = selectors.DefaultSelector()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    try:
        stdout_open = True
        while stdout_open:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, 1.0)):
                fd = key.fileobj
                if fd is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                assert fd is proc.stdout or fd is proc.stderr
                data = os.read(fd.fileno(), 1 << 16)
                if not data:
                    sel.unregister(fd)
                    stdout_open = stdout_open and fd is not proc.stdout
                elif fd is proc.stderr:
                    err += data[: max(0, 65536 - len(err))]
                else:
                    buf += data
            while len(buf) >= 4:
                size = int.from_bytes(buf[:4], "big")
                if size > _MAX_FRAME:
                    stdout_open = False
                    break
                if len(buf) < 4 + size:
                    break
                try:
                    frame = json.loads(bytes(buf[4 : 4 + size]))
                except ValueError:
                    frame = None
                del buf[: 4 + size]
                if not isinstance(frame, dict):
                    stdout_open = False
                    break
                if not ready:
                    if "error" in frame:
                        raise _unavailable(f"sandbox setup failed: {frame['error']}")
                    ready = True
                elif frame.get("i") == len(frames) and len(frames) < len(jobs):
                    frames.append(frame)
                else:  # out of sequence: the sandbox is not to be trusted any further
                    stdout_open = False
                    break
    finally:
        sel.close()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if not stream.closed:
                stream.close()
    if not ready and not timed_out:
        raise _unavailable(err.decode(errors="replace") or f"the sandbox exited with status {proc.returncode}")
    return frames, timed_out


@cache
def _probe() -> str | None:
    """None when the sandbox works end to end here, else why not (cached: probed once per process)."""
    job = {"code": "def f(x):\n    import json, math\n    return [x, math.floor(2.5)]\n", "args": [[1]]}
    try:
        frames, _ = _run_sandbox([job], Limits(per_candidate_s=10, wall_s=30))
    except SandboxUnavailable as exc:
        return str(exc)
    except OSError as exc:
        return str(_unavailable(f"could not start the sandbox: {exc}"))
    if not frames or frames[0].get("out") != '["v", [1, 2]]\n["d"]\n':
        got = frames[0] if frames else "nothing"
        return str(_unavailable(f"the sandbox ran but a known-good candidate failed there ({got})"))
    return None


def require_sandbox() -> None:
    """Raise :class:`SandboxUnavailable` unless candidates can be run sandboxed here."""
    problem = _probe()
    if problem is not None:
        raise SandboxUnavailable(problem)


def _normalize(value: Any) -> Any:
    """A value as the harness sees it after the JSON trip (tuples become lists)."""
    return json.loads(json.dumps(value))


def _same(got: Any, want: Any) -> bool:
    """Value equality between plain JSON data; booleans are not numbers."""
    if type(got) is bool or type(want) is bool:
        return type(got) is type(want) and got == want
    if type(got) in (int, float) and type(want) in (int, float):
        return bool(got == want)
    if type(got) is list and type(want) is list:
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if type(got) is dict and type(want) is dict:
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and bool(got == want)


def _verdict(task: Task, status: str, out: str) -> tuple[int, str, bool]:
    """Tests passed, reason and whether it passed, from one candidate's raw result lines."""
    expected = [_normalize(e) for _, e in task.tests]
    n = len(expected)
    items: list[Any] = []
    for line in out.split("\n")[: n + 2]:
        try:
            items.append(json.loads(line))
        except (ValueError, RecursionError):
            items.append(None)
    first = items[0] if items else None
    if isinstance(first, list) and first[:1] == ["c"]:
        name = first[1] if len(first) > 1 and isinstance(first[1], str) and first[1].isidentifier() else "error"
        syntax = name in ("SyntaxError", "IndentationError", "TabError")
        return 0, ("syntax error" if syntax else f"does not define a working f ({name[:40]})"), False
    passed, not_plain, answered = 0, False, 0
    for item, want in zip(items, expected, strict=False):
        if not isinstance(item, list) or not item or item[0] not in ("v", "e", "x"):
            break
        answered += 1
        if item[0] == "v" and len(item) == 2 and _same(item[1], want):
            passed += 1
        not_plain = not_plain or item[0] == "x"
    done = len(items) > n and items[n] == ["d"]
    if passed == n and status == "ok" and done:
        return passed, "passed", True
    if status == "timeout":
        return passed, "timeout", False
    if status == "too_big":
        return passed, "output too large", False
    if not_plain:
        return passed, "output is not a plain JSON value", False
    if status == "crashed" or answered < n or not done:
        return passed, "crashed", False
    return passed, f"failed {n - passed} of {n} tests", False


def check_many(items: list[tuple[Task, str]], limits: Limits | None = None) -> list[CheckResult]:
    """Check ``(task, body)`` pairs, in order; a body is the code under ``task.signature``."""
    limits = limits or Limits()
    require_sandbox()
    jobs: list[dict[str, Any]] = []
    slots: list[int] = []  # index into items of each job
    for k, (task, body) in enumerate(items):
        if len(body) <= MAX_BODY_CHARS:
            jobs.append({"code": f"{task.signature}\n{body}", "args": [list(a) for a, _ in task.tests]})
            slots.append(k)
    outcomes: dict[int, tuple[str, str]] = {}
    start = 0
    while start < len(jobs):
        frames, timed_out = _run_sandbox(jobs[start:], limits)
        for frame in frames:
            outcomes[slots[start + int(frame["i"])]] = (str(frame["status"]), str(frame["out"]))
        start += len(frames)
        if start < len(jobs):  # the candidate that broke or stalled the sandbox fails alone
            outcomes[slots[start]] = ("timeout" if timed_out else "crashed", "")
            start += 1
    results = []
    for k, (task, body) in enumerate(items):
        size = body_size(body)
        if k in outcomes:
            n, reason, ok = _verdict(task, *outcomes[k])
        else:
            n, reason, ok = 0, "body too long", False
        kept = ok and size <= task.size_limit
        results.append(CheckResult(ok, n, size, kept, reason=reason, tests=len(task.tests)))
    return results


def check(task: Task, body: str, limits: Limits | None = None) -> CheckResult:
    """Check one candidate body."""
    return check_many([(task, body)], limits)[0]
