"""Init process of the checker's sandbox: builds the filesystem view, then runs candidates one by one.

The checker (:mod:`policy.checker`) starts this file's source with ``python -I -S -c`` under
``unshare`` (new user, mount, pid, network, IPC and UTS namespaces), so it runs as pid 1 of an
empty pid namespace, as root of a fresh user namespace, with no network. It is stdlib-only and
never imports the project: the project's directories are hidden from inside.

Setup, before any candidate code exists in the process:

1. every inherited mount is remounted read-only (keeping its locked flags);
2. a small tmpfs goes over ``/tmp``: the only writable place (cwd, ``HOME`` and ``TMPDIR``);
3. ``/dev`` is replaced by a read-only tmpfs holding only ``null``, ``zero``, ``random`` and
   ``urandom`` (no disks, no terminals, no shared memory);
4. the directories the harness names (``/root``, ``/home``, ``/run``, the repository, the
   Undertow home...) are covered by empty read-only tmpfs mounts; the interpreter's prefix is
   moved back into place when it lives under one of them; the package that generates the tests
   is covered last, even inside the prefix;
5. the process drops every capability (bounding set included), sets ``no_new_privs``, becomes
   non-dumpable (so a candidate, same uid but no capability, can neither ptrace it nor read its
   memory through ``/proc``) and ignores the signals it would otherwise act on.

Then, per candidate: a pipe, a fork. The child gets its own session, ``/dev/null`` on 0/1/2,
only the write end of its pipe (at a random descriptor number), a clean environment, rlimits
(address space, CPU, file size, open files, processes, no core), runs the body, calls ``f`` on
each test's *inputs* and writes one JSON line per call. Only exact ``int``/``float``/``str``/
``bool``/``None``/``list``/``tuple``/``dict`` with ``str`` keys are serialized (tuples as
lists); anything else is reported as "not a plain JSON value". After the child exits, or when
its time is up, pid 1 kills every other process of the namespace (``kill(-1, SIGKILL)``),
reaps them all and empties ``/tmp``, so nothing of one candidate survives into the next.

Frames to the harness (on the original stdout, which children never hold): a 4-byte big-endian
length then a JSON object, first ``{"ready": true}`` (or ``{"error": ...}`` if the setup
failed), then one ``{"i", "status", "out"}`` per candidate. The harness holds the expected
values; nothing here ever sees them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import secrets
import select
import signal
import stat
import sys
import time
from typing import Any

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
STAGE = "/tmp/.stage"
DEVICES = ("null", "zero", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if (
        libc.mount(
            src.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        )
        != 0
    ):
        _fail(f"mount {target}")


def _unescape(field: str) -> str:
    """Mount points in mountinfo escape space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _locked_flags(options: str) -> int:
    """Per-mount flags that must be kept when remounting a mount inherited from the parent namespace."""
    opts = set(options.split(","))
    flags = 0
    for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC)):
        if name in opts:
            flags |= bit
    if "noatime" in opts:
        flags |= MS_NOATIME
    elif "relatime" in opts:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    if "nodiratime" in opts:
        flags |= MS_NODIRATIME
    return flags


def _remount_all_readonly() -> None:
    with open("/proc/self/mountinfo") as fh:
        lines = fh.read().splitlines()
    done = set()
    for line in reversed(lines):  # the last entry of a mount point is the one on top
        fields = line.split()
        target, options = _unescape(fields[4]), fields[5]
        if target in done:
            continue
        done.add(target)
        _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(options))


def _readonly(target: str) -> None:
    _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _tmpfs(target: str, size: int, mode: str = "755") -> None:
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


def _build_dev() -> None:
    new = f"{STAGE}/dev"
    os.mkdir(new)
    _tmpfs(new, 64 << 10)
    for name in DEVICES:
        with open(f"{new}/{name}", "w"):
            pass
        _mount(f"/dev/{name}", f"{new}/{name}", None, MS_BIND)
    os.symlink("/proc/self/fd", f"{new}/fd")
    _readonly(new)
    _mount(new, "/dev", None, MS_MOVE)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _setup(masks: list[str], expose: list[str], late_masks: list[str], scratch_bytes: int) -> None:
    _remount_all_readonly()
    _tmpfs("/tmp", scratch_bytes, "1777")
    os.mkdir(STAGE)
    _build_dev()
    staged = []
    for n, path in enumerate(expose):
        if any(_under(path, m) for m in masks):
            where = f"{STAGE}/x{n}"
            os.mkdir(where)
            _mount(path, where, None, MS_BIND | MS_REC)
            staged.append((where, path))
    for path in masks:
        if os.path.isdir(path):
            _tmpfs(path, 64 << 10)
    for where, path in staged:
        os.makedirs(path, exist_ok=True)
        _mount(where, path, None, MS_MOVE)
    for path in masks:
        if os.path.isdir(path):
            _readonly(path)
    for path in late_masks:
        if os.path.isdir(path):
            _tmpfs(path, 4 << 10)
            _readonly(path)
    for name in os.listdir(STAGE):
        os.rmdir(f"{STAGE}/{name}")
    os.rmdir(STAGE)
    _drop_privileges()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_privileges() -> None:
    """No capability left (bounding set, ambient, effective, permitted), no_new_privs, not dumpable."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == 0:
        cap += 1
    if cap == 0:
        _fail("drop capability bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        _fail("capset")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("no_new_privs")
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        _fail("dumpable")


class _NotPlain(Exception):
    pass


def _plain(value: Any, budget: list[int], depth: int = 0) -> Any:
    """The value as plain JSON data (exact builtin types only), or raise _NotPlain.

    ``budget`` holds the characters still allowed; it shrinks by each string's length and by a
    few characters per other item, so a huge value is refused before it is serialized.
    """
    kind = type(value)
    budget[0] -= len(value) if kind is str else 8
    if budget[0] < 0 or depth > 32:
        raise _NotPlain()
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        if not math.isfinite(value):
            raise _NotPlain()
        return value
    if kind is list or kind is tuple:
        return [_plain(v, budget, depth + 1) for v in value]
    if kind is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _NotPlain()
            budget[0] -= len(k)
            out[k] = _plain(v, budget, depth + 1)
        return out
    raise _NotPlain()


def _candidate(job: dict[str, Any], fd: int, limits: dict[str, Any]) -> None:
    """Body of one forked child: run the candidate on each input, one JSON line per call on ``fd``."""
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    channel = 10 + secrets.randbelow(limits["open_files"] - 12)
    os.dup2(fd, channel)
    null = os.open("/dev/null", os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) != channel:
            with contextlib.suppress(OSError):
                os.close(int(name))
    out = os.fdopen(channel, "w", encoding="utf-8")
    cpu = math.ceil(limits["per_candidate_s"]) + 1
    for res, value in (
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    os.environ.clear()
    os.environ.update({"HOME": "/tmp", "TMPDIR": "/tmp", "PATH": "/usr/bin:/bin"})
    dumps, plain, cap, write, flush = json.dumps, _plain, limits["output_bytes"], out.write, out.flush
    not_plain, inputs = _NotPlain, [list(args) for args in job["args"]]
    del job["args"]
    try:
        ns: dict[str, Any] = {"__name__": "candidate", "__builtins__": __builtins__}
        exec(compile(job.pop("code"), "<candidate>", "exec"), ns)
        fn = ns["f"]
        if not callable(fn):
            raise TypeError("f is not callable")
    except BaseException as exc:
        write(dumps(["c", type(exc).__name__]) + "\n")
        flush()
        os._exit(0)
    for args in inputs:
        try:
            value = fn(*args)
        except BaseException as exc:
            line = dumps(["e", type(exc).__name__])
        else:
            try:
                line = dumps(["v", plain(value, [cap])], allow_nan=False)
                if len(line) > cap:
                    raise not_plain()
            except BaseException:
                line = dumps(["x"])
        write(line + "\n")
        flush()
    write(dumps(["d"]) + "\n")
    flush()
    os._exit(0)


def _kill_everything_else() -> None:
    """As pid 1 of the namespace: kill every other process in it and reap them all."""
    while True:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _wipe(path: str) -> None:
    for entry in os.scandir(path):
        full = entry.path
        try:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(full, stat.S_IRWXU)
                _wipe(full)
                os.rmdir(full)
            else:
                os.unlink(full)
        except OSError:
            pass


def _run_one(job: dict[str, Any], limits: dict[str, Any]) -> tuple[str, bytes]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _candidate(job, w, limits)
        finally:
            os._exit(1)
    os.close(w)
    deadline = time.monotonic() + limits["per_candidate_s"]
    chunks: list[bytes] = []
    size, status, exited = 0, "", False
    while not status:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        ready, _, _ = select.select([r], [], [], min(left, 0.05))
        if ready:
            data = os.read(r, 1 << 16)
            if not data:
                status = "exited"
                break
            chunks.append(data)
            size += len(data)
            if size > limits["output_bytes"]:
                status = "too_big"
        elif exited:
            status = "exited"  # the child is gone; a grandchild keeps the pipe open
        else:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                exited = True
                status = "" if os.waitstatus_to_exitcode(code) == 0 else "crashed"
    if status == "exited":
        try:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done and os.waitstatus_to_exitcode(code) != 0:
                status = "crashed"
        except ChildProcessError:
            pass
    os.close(r)
    _kill_everything_else()
    _wipe("/tmp")
    return ("ok" if status == "exited" else status), b"".join(chunks)


def _send(channel: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(channel, view) :]


def main() -> None:
    """Entry point (pid 1 of the sandbox); reads its whole request on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    request = json.loads(sys.stdin.buffer.read())
    limits = request["limits"]
    channel = os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    os.close(null)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    try:
        _setup(request["masks"], request["expose"], request["late_masks"], limits["scratch_bytes"])
        os.chdir("/tmp")
    except Exception as exc:
        _send(channel, {"error": f"{type(exc).__name__}: {exc}"})
        return
    _send(channel, {"ready": True})
    for i, job in enumerate(request.pop("jobs")):
        status, out = _run_one(job, limits)
        _send(channel, {"i": i, "status": status, "out": out.decode("utf-8", "replace")})


if __name__ == "__main__":
    main()
